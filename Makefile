.PHONY: install test faults demo bench lint clean-state

PY := .venv/bin/python

install:
	bash scripts/install.sh

test: install
	$(PY) -m pytest -q -ra tests

# The long kill -9 fault suite (10 kills of a daemon with ~100 sandboxes); `make test`
# runs its short form. Figures: benchmarks/results/faults.json.
faults: install
	CORRAL_FAULTS_KILLS=10 CORRAL_FAULTS_SANDBOXES=100 \
	CORRAL_FAULTS_REPORT=benchmarks/results/faults.json $(PY) -m pytest -q -s tests/faults

demo: install
	$(PY) examples/policy_eval_demo.py

bench: install
	bash scripts/install-bench.sh && $(PY) benchmarks/run.py $(if $(QUICK),--quick,)

lint:
	$(PY) -m ruff check src tests benchmarks examples
