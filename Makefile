# kvrouter: two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

## demo: a simulated fleet of mock vLLM engines behind the real router, once per policy
demo: $(STAMP)
	$(BIN)/kvrouter demo $(DEMO_ARGS)

## test: ruff, mypy, then pytest
test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check index router sim tests bench
	$(BIN)/ruff format --check index router sim tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

## bench: micro-benchmarks of the index, router overhead and routing quality (see BENCHMARKS.md)
bench: $(STAMP)
	$(BIN)/python bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
