# kvrouter: two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench fuzz soak clean

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

## soak: the chaos soak, 10 minutes (SOAK_MINUTES); report and plot in bench/out/soak/
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES)

## fuzz: the long fuzz runs (bounded versions run in make test); counts go to fuzz-report.jsonl
FUZZ_HTTP_CASES ?= 6000
fuzz: $(STAMP)
	rm -f fuzz-report.jsonl
	FUZZ_HTTP_CASES=$(FUZZ_HTTP_CASES) FUZZ_REPORT=$(CURDIR)/fuzz-report.jsonl \
	  $(BIN)/python -m pytest -q -p no:cacheprovider -o timeout=7200 tests/test_fuzz_http.py
	$(BIN)/python -c "import json; rows = [json.loads(l) for l in open('fuzz-report.jsonl')]; \
	  print('fuzz cases:', {r['fuzz'].split()[0]: sum(x['cases'] for x in rows if x['fuzz'].split()[0] == r['fuzz'].split()[0]) for r in rows})"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
