# Whetstone: `make run` starts the studio on the embedded defaults, `make test` runs the tests.
# Both set everything up first (idempotent): venv, Python deps, npm assets, database migration.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Leave empty to let pip choose (a CPU wheel is used where pip's find-links provides one);
# on a CPU-only box elsewhere: make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_VERSION := 2.13.0
# llama-cpp-python compiles llama.cpp (a few minutes, once; pip caches the wheel). CPU only:
# it quantises GGUF files and verifies exports, it never trains.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF
# The demo model stories260K is seeded from ../shared/data when it is there (no download needed).
ifeq ($(origin WHETSTONE_SEED_DIR), undefined)
  ifneq ($(wildcard ../shared/data/models/stories260K/stories260K.bin),)
    export WHETSTONE_SEED_DIR := $(abspath ../shared/data)
  endif
endif

.PHONY: setup deps assets migrate run web worker test test-setup test-fast clean

setup: deps assets migrate

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

# Reinstall only when pyproject.toml changes.
$(VENV)/.deps-stamp: pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH_INDEX_URL)" ]; then \
	  $(BIN)/pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX_URL); fi
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(BIN)/pip install -q -e ".[worker,test]"
	@touch $@

deps: $(VENV)/.deps-stamp

# Third-party JS (htmx, its SSE extension, the chart library) comes from npm at build time.
# (npm's postinstall runs static/copy-vendor.mjs, which copies them into static/vendor/.)
static/vendor/.stamp: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	node static/copy-vendor.mjs >/dev/null
	@touch $@

assets: static/vendor/.stamp

migrate: deps
	$(BIN)/python -m app.store.migrate

run: setup
	bash docker/start.sh

web: setup
	$(BIN)/python -m app.web.main

worker: setup
	$(BIN)/python -m worker --supervise

# Test-only system packages: Chromium for the browser journey (Debian's package), and
# bubblewrap, the sandbox of custom reward functions (the worker image installs it too).
test-setup: setup
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@command -v bwrap >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }

# The queue tests also run against a throwaway local PostgreSQL (tests/pg_server.sh).
test: test-setup
	@url=$$(bash tests/pg_server.sh start); \
	WHETSTONE_TEST_POSTGRES_URL="$$url" $(BIN)/python -m pytest -q -p no:cacheprovider tests; \
	rc=$$?; bash tests/pg_server.sh stop; exit $$rc

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not browser" tests

clean:
	rm -rf $(VENV) node_modules static/vendor
