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
# llama-cpp-python compiles llama.cpp (9.7 CPU-minutes: ~5 minutes on 2 idle cores). CPU only: it
# quantises GGUF files and verifies exports, it never trains. pip's wheel cache ignores
# CMAKE_ARGS (it could hand back a -march=native wheel built by a plain pip install), so the
# wheel is built without it, once per version and flags, into LLAMA_WHEEL_DIR (keyed by both,
# outside the clone): a fresh clone on this machine, or CI restoring that folder, installs it
# without compiling.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF
LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)
LLAMA_WHEELS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/whetstone/llama-cpp-python
LLAMA_KEY := $(shell printf '%s %s' '$(LLAMA_VERSION)' '$(strip $(LLAMA_CMAKE_ARGS))' \
  | sha256sum | cut -c1-16)
LLAMA_WHEEL_DIR := $(LLAMA_WHEELS)/$(LLAMA_VERSION)-$(LLAMA_KEY)
# The demo model stories260K is seeded from ../shared/data when it is there (no download needed).
ifeq ($(origin WHETSTONE_SEED_DIR), undefined)
  ifneq ($(wildcard ../shared/data/models/stories260K/stories260K.bin),)
    export WHETSTONE_SEED_DIR := $(abspath ../shared/data)
  endif
endif

.PHONY: setup deps llama-wheel assets migrate run web worker test test-setup test-fast clean

setup: deps assets migrate

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

# Reinstall only when pyproject.toml changes.
$(VENV)/.deps-stamp: pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH_INDEX_URL)" ]; then \
	  $(BIN)/pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX_URL); fi
	$(MAKE) --no-print-directory llama-wheel
	$(BIN)/pip install -q --no-deps --force-reinstall $(LLAMA_WHEEL_DIR)/llama_cpp_python-*.whl
	$(BIN)/pip install -q -e ".[worker,test]"
	@touch $@

# The llama-cpp-python wheel for LLAMA_CMAKE_ARGS (built only when LLAMA_WHEEL_DIR has none).
llama-wheel: | $(BIN)/python
	@if ls $(LLAMA_WHEEL_DIR)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	  echo "llama-cpp-python $(LLAMA_VERSION): wheel for these CMAKE_ARGS in $(LLAMA_WHEEL_DIR)"; \
	else \
	  echo "building llama-cpp-python $(LLAMA_VERSION) (CMAKE_ARGS=$(strip $(LLAMA_CMAKE_ARGS)))"; \
	  rm -rf $(LLAMA_WHEEL_DIR).tmp && mkdir -p $(LLAMA_WHEEL_DIR).tmp && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(BIN)/pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
	    -w $(LLAMA_WHEEL_DIR).tmp llama-cpp-python==$(LLAMA_VERSION) && \
	  printf '%s\n' '$(strip $(LLAMA_CMAKE_ARGS))' > $(LLAMA_WHEEL_DIR).tmp/CMAKE_ARGS && \
	  rm -rf $(LLAMA_WHEEL_DIR) && mv $(LLAMA_WHEEL_DIR).tmp $(LLAMA_WHEEL_DIR); \
	fi

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
