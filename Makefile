.PHONY: install test faults demo bench bench-cpu lint docs

PY := .venv/bin/python

install:
	bash scripts/install.sh

# The suite on TEST_WORKERS pytest-xdist workers: most tests wait on processes, not the
# CPU, so three workers on two cores finish sooner; a module stays on one worker and the
# Ray tests share one (tests/conftest.py). TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 3

test: install
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests

# The long kill -9 fault suite (10 kills of a daemon with ~100 sandboxes); `make test`
# runs its short form. Figures: benchmarks/results/faults.json.
faults: install
	CORRAL_FAULTS_KILLS=10 CORRAL_FAULTS_SANDBOXES=100 \
	CORRAL_FAULTS_REPORT=benchmarks/results/faults.json $(PY) -m pytest -q -s tests/faults

demo: install
	$(PY) examples/policy_eval_demo.py

# setup_ray_sandbox.py: Ray's sandboxes' tools in a private prefix (host apt untouched);
# if it cannot, the benchmarks say why Ray's sandboxes were not measured.
bench: install
	bash scripts/install-bench.sh && \
	{ $(PY) benchmarks/setup_ray_sandbox.py || echo "warning: Ray's sandboxes will not be measured" >&2; } && \
	$(PY) benchmarks/run.py $(if $(QUICK),--quick,)

# CPU per create+exec+delete, per exec (and per demo run) of git refs side by side, each in
# its own worktree, daemon and image cache (docs/performance.md); `make bench` runs it on
# this tree alone. make bench-cpu REFS="f42e1d2 HEAD" [DEMO=4]
REFS ?= f42e1d2 HEAD
bench-cpu: install
	$(PY) benchmarks/bench_cpu_cost.py --refs $(REFS) $(if $(DEMO),--demo $(DEMO),)

# The documentation site (mkdocs.yml, docs/) into site/; tests/test_docs.py builds it too.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

lint:
	$(PY) -m ruff check src tests benchmarks examples
