# Two commands: `make demo` (the main job) and `make test`. Both set up .venv first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.ready

.PHONY: demo test test-all bench setup clean

setup: $(READY)

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(READY)

demo: $(READY)
	$(BIN)/python examples/demo.py

test: $(READY)
	$(BIN)/python -m pytest -q

test-all: $(READY)
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: $(READY)
	$(BIN)/python benchmarks/infer_cpu.py

clean:
	rm -rf $(VENV) pipeline_dump
