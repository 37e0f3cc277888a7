# Two entry points do all the set-up: `make serve` and `make test`.
# TORCH_SPEC pins the CPU wheel; a GPU user sets it to the torch build of their CUDA, e.g.
#   make serve TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# pip byte-compiles every file it installs on one core; compileall does the same on all cores.
PIP := $(BIN)/pip install --no-compile
COMPILE := $(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true  # a few test-data files never compile

.PHONY: install install-test serve test bench demo-models gpu-check fuzz

# serving needs only the package; the suite's tools (pytest, scipy, schemathesis...) come with `make test`
$(BIN)/specserve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_SPEC)
	$(PIP) -e .
	$(COMPILE)
	touch $@

$(VENV)/.test-tools: $(BIN)/specserve
	$(PIP) -e ".[test]"
	$(COMPILE)
	touch $@

install: $(BIN)/specserve

install-test: $(VENV)/.test-tools

serve: install
	$(BIN)/specserve serve

demo-models: install
	$(BIN)/specserve demo-models

bench: install
	$(BIN)/specserve bench

# the engine's tests on every core (pytest-xdist: 1.3x on 2 cores); then the Ray tests (marked slow) one at
# a time, in one process: they share one local cluster (tests/serving.py), whose replicas use every core
TEST_WORKERS ?= logical
test: install-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"
	$(BIN)/python -m pytest -q -m slow

# against a live app: schemathesis, FUZZ_CASES bodies per endpoint and mode (2 x 2); then hostile bodies
# (HOSTILE_CASES generated, past the schema's bounds) beside greedy streams. 0 x 5xx expected
fuzz: install-test
	FUZZ_CASES=$${FUZZ_CASES:-500} HOSTILE_CASES=$${HOSTILE_CASES:-3000} $(BIN)/python -m pytest -q -s tests/test_fuzz.py tests/test_hostile.py

# on a machine with one NVIDIA GPU (and a CUDA torch: see TORCH_SPEC above); no Ray, no network
gpu-check: install-test
	$(BIN)/python -m specserve.gpu.check --isolate 300 --json gpu-check.json
