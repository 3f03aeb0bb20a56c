# The two quickstart commands (README.md): `make demo` and `make test` (and `make test-fast`, the edit loop's tier). Both create or reuse .venv.
# On a machine without CUDA, torch is TORCH_SPEC from TORCH_INDEX (pip's indexes when empty; README.md);
# with CUDA, pip's default build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup demo test test-fast lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamp file: reinstall when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	 else $(BIN)/pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e '.[dev,docker,tracking,faiss-cpu]'
	touch $@

setup: $(VENV)/.installed

# The quickstart (README.md): a tiny model trained from scratch learns to use the interpreter, then the
# search engine: data and tokenizer from seeds, SFT on mixed traces, held-out eval, GRPO, eval again.
QS := runs/quickstart
EVAL := $(BIN)/agentrl eval --benchmarks task --limit 200 --n 4 --temperature 1

demo: setup
	rm -rf $(QS)
	$(BIN)/python -m agentrl.quickstart prepare $(QS)
	$(BIN)/agentrl tasks validate tasks/*.yaml
	$(BIN)/agentrl sft configs/quickstart_code_sft.yaml
	$(EVAL) --task tasks/quickstart_code.yaml --set dataset.path=$(QS)/code/test.jsonl \
	    --model $(QS)/code_sft/export --out $(QS)/code_sft/eval
	$(BIN)/agentrl train configs/quickstart_code.yaml
	$(EVAL) --task tasks/quickstart_code.yaml --set dataset.path=$(QS)/code/test.jsonl \
	    --model $(QS)/code_rl/export --out $(QS)/code_rl/eval
	$(BIN)/agentrl sft configs/quickstart_search_sft.yaml
	$(EVAL) --task tasks/quickstart_search.yaml --set dataset.path=$(QS)/search/test.jsonl --index $(QS)/search/index \
	    --model $(QS)/search_sft/export --out $(QS)/search_sft/eval
	$(BIN)/agentrl train configs/quickstart_search.yaml
	$(EVAL) --task tasks/quickstart_search.yaml --set dataset.path=$(QS)/search/test.jsonl --index $(QS)/search/index \
	    --model $(QS)/search_rl/export --out $(QS)/search_rl/eval
	$(BIN)/agentrl report $(QS)/code_rl $(QS)/search_rl --out $(QS)/report
	$(BIN)/python -m agentrl.quickstart table $(QS)

test: setup
	$(BIN)/python -m pytest -q

# The edit loop's tier: every test but those marked slow (README: Tests). CI runs `make test`, the whole suite.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
