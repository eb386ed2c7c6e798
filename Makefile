# Two commands: `make demo` (the main job) and `make test`. Both set up .venv first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.ready

.PHONY: demo test test-mutants test-all bench setup clean

setup: $(READY)

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq graphviz) >/dev/null 2>&1; } || \
		echo "Graphviz's dot is missing (apt-get install graphviz): pipeline.draw writes .dot only; its SVG tests skip"
	touch $(READY)

demo: $(READY)
	$(BIN)/python examples/demo.py

# the TE and nvFuser test files again with stand-ins for those libraries (as the GPU machine imports
# them): a CPU test that reaches a real GPU library fails here (tests/gpu_library_stand_ins/)
GPU_LIBRARY_TESTS := tests/test_executor_options.py tests/test_te_regions.py tests/test_group_linears.py \
	tests/test_fusion_islands.py tests/test_partition_memory.py

test: $(READY)
	$(BIN)/python scripts/line_budget.py
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -p no:cacheprovider --gpu-library-stand-ins $(GPU_LIBRARY_TESTS)

# a few deliberate bugs (tests/mutants.py), each of which a fast subset of the tests must catch
test-mutants: $(READY)
	$(BIN)/python scripts/mutants.py

test-all: $(READY)
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: $(READY)
	$(BIN)/python benchmarks/infer_cpu.py

clean:
	rm -rf $(VENV) pipeline_dump
