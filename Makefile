# The two quickstart commands (README.md): `make demo` and `make test`. Both create or reuse .venv.
# On a machine without CUDA, torch is TORCH_SPEC from TORCH_INDEX (pip's indexes when empty; README.md);
# with CUDA, pip's default build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
SHARED ?= ../shared/data
# The demo reads local copies of the benchmark files when ../shared is there, the hub otherwise.
MATH500 := $(if $(wildcard $(SHARED)/math/math500.jsonl),--set dataset.path=$(SHARED)/math/math500.jsonl,--set dataset.path=HuggingFaceH4/MATH-500 --set dataset.split=test)
TOKENIZER := $(if $(wildcard $(SHARED)/tokenizers/qwen2.5-0.5b-instruct/vocab.json),$(SHARED)/tokenizers/qwen2.5-0.5b-instruct,Qwen/Qwen2.5-0.5B-Instruct)

.PHONY: setup demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamp file: reinstall when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	 else $(BIN)/pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e '.[dev,docker,tracking]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/agentrl tasks validate tasks/*.yaml
	$(BIN)/agentrl tasks show tasks/torl_math.yaml -n 2 $(MATH500) --tokenizer $(TOKENIZER)
	$(BIN)/agentrl tasks check tasks/torl_math.yaml $(MATH500) --out runs/demo
	$(BIN)/agentrl train configs/debug_cpu.yaml --set trainer.run_dir=runs/demo/train

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
