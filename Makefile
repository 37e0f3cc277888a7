# Two entry points do all the set-up: `make serve` and `make test`.
# TORCH_SPEC pins the CPU wheel; a GPU user sets it to the torch build of their CUDA, e.g.
#   make serve TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install serve test bench demo-models gpu-check fuzz

$(BIN)/specserve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH_SPEC)
	$(BIN)/pip install -e ".[test]"
	touch $@

install: $(BIN)/specserve

serve: install
	$(BIN)/specserve serve

demo-models: install
	$(BIN)/specserve demo-models

bench: install
	$(BIN)/specserve bench

test: install
	$(BIN)/python -m pytest -q

# against a live app: schemathesis, FUZZ_CASES bodies per endpoint and mode (2 x 2); then hostile bodies
# (HOSTILE_CASES generated, past the schema's bounds) beside greedy streams. 0 x 5xx expected
fuzz: install
	FUZZ_CASES=$${FUZZ_CASES:-500} HOSTILE_CASES=$${HOSTILE_CASES:-3000} $(BIN)/python -m pytest -q -s tests/test_fuzz.py tests/test_hostile.py

# on a machine with one NVIDIA GPU (and a CUDA torch: see TORCH_SPEC above); no Ray, no network
gpu-check: install
	$(BIN)/python -m app.gpu_check --json gpu-check.json
