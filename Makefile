# Everything needed from a fresh machine: `make demo`, `make test`, `make bench`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEPS   := $(VENV)/.deps
BUILT  := $(VENV)/.built
SOURCES := $(shell find rust csrc python -name '*.rs' -o -name '*.cpp' -o -name '*.h' -o -name '*.py') \
           Cargo.toml Cargo.lock setup.py

.PHONY: all venv build demo test test-rust test-python bench gpu-check clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements-dev.txt | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements-dev.txt
	touch $@

venv: $(DEPS)

# The extension is built in place (editable install): cargo builds the staticlib, then
# setuptools compiles csrc/ and links it into python/fastsafetensors/_C*.so.
$(BUILT): $(DEPS) $(SOURCES)
	@command -v cargo >/dev/null || { echo "cargo is required: install Rust (https://rustup.rs)"; exit 1; }
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

build: $(BUILT)

demo: build
	$(PY) examples/demo.py

test: test-rust test-python

test-rust:
	cargo test --locked

test-python: build
	$(PY) -m pytest tests/python -q

bench: build
	$(PY) bench/bench.py $(BENCH_ARGS)

# On a machine with a GPU: bit-exactness, memory accounting and throughput of the CUDA paths.
gpu-check: build
	$(PY) tests/gpu/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf target build python/fastsafetensors/_C*.so $(BUILT)
