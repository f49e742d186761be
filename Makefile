# The two commands of the README: `make demo` (the main job) and `make test` (the test suite);
# `make demo-tools` is the multi-turn tool-use demo (README, docs/environments.md).
# All three install the pinned environment first if it is missing or older than the requirements.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest

.PHONY: setup test test-unit test-dist test-integration test-e2e demo demo-tools bench clean-venv

setup: $(STAMP)

$(STAMP): requirements/install.sh requirements/constraints.txt requirements/base.txt requirements/sglang-0.5.23-cpu-nodeps.txt setup.py
	VENV=$(VENV) bash requirements/install.sh

test: $(STAMP)
	PY=$(PY) bash tools/test_suite.sh

test-unit: $(STAMP)
	$(PYTEST) -m unit tests

test-dist: $(STAMP)
	$(PYTEST) -m dist tests

test-integration: $(STAMP)
	$(PYTEST) -m integration tests

test-e2e: $(STAMP)
	$(PYTEST) -m e2e tests

demo: $(STAMP)
	$(PY) -m examples.demo.run

# The tool-use demo (examples/tool_demo/run.py): multi-turn rollouts with a Python tool.
demo-tools: $(STAMP)
	$(PY) -m examples.tool_demo.run

bench: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
