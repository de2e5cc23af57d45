.PHONY: install test demo bench lint clean-state

PY := .venv/bin/python

install:
	bash scripts/install.sh

test: install
	$(PY) -m pytest -q -ra tests

demo: install
	$(PY) examples/policy_eval_demo.py

bench: install
	bash scripts/install-bench.sh && $(PY) benchmarks/run.py $(if $(QUICK),--quick,)

lint:
	$(PY) -m ruff check src tests benchmarks examples
