# Everything needed from a fresh machine: `make demo`, `make test`, `make bench`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEPS   := $(VENV)/.deps
BUILT  := $(VENV)/.built
# What the compiled extension is made of (Python files are used in place: no rebuild).
SOURCES := $(shell find rust csrc -name '*.rs' -o -name '*.cpp' -o -name '*.h') Cargo.toml Cargo.lock setup.py

.PHONY: all venv build demo test test-rust test-python bench gpu-check clean tf4 cpp-example
.PHONY: fuzz sanitize sanitize-rust sanitize-cpp

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements-dev.txt | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements-dev.txt
	touch $@

venv: $(DEPS)

# The extension is built in place (editable install): cargo builds the staticlib, then
# setuptools compiles csrc/ and links it into python/fastsafetensors_rs/_C*.so.
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

test-python: build tf4
	$(PY) -m pytest tests/python -q

# transformers 4.57 beside the 5.x in .venv, for the second run of the transformers tests.
TF4 := .tf4/.installed
$(TF4): tests/requirements-transformers4.txt | $(DEPS)
	rm -rf .tf4
	$(PIP) install --target .tf4 --no-deps -r tests/requirements-transformers4.txt
	touch $@

tf4: $(TF4)

# The C++ example: calls the op through the dispatcher, built against the torch wheel's libtorch.
CPP_EXAMPLE := build/cpp-example/fst_load
$(CPP_EXAMPLE): examples/cpp/load.cpp | $(BUILT)
	mkdir -p $(@D)
	TORCH_DIR=$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
	$(CXX) -std=c++20 -O2 -I$$TORCH_DIR/include $< -o $@ \
	    -L$$TORCH_DIR/lib -Wl,-rpath,$$TORCH_DIR/lib -lc10 -ltorch_cpu -ldl
	@echo "run: $@ $$($(PY) -c 'import fastsafetensors_rs; print(fastsafetensors_rs.LIBRARY_PATH)') FILE.safetensors..."

cpp-example: $(CPP_EXAMPLE)

bench: build
	$(PY) bench/bench.py $(BENCH_ARGS)

# On a machine with a GPU: every CUDA check in one table (tests/gpu/gpu_check.py lists them),
# then throughput; under 10 minutes on one GPU. It needs only torch, safetensors and the built
# package: where there is no cargo, build the extension elsewhere and run
# `PYTHONPATH=python python tests/gpu/gpu_check.py`.
gpu-check: build
	$(PY) tests/gpu/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf target build python/fastsafetensors_rs/_C*.so $(BUILT) .tf4

# Fuzzing: `make fuzz FUZZ_SECONDS=60` runs each fuzz target for that many seconds, starting
# from its seeds in fuzz/corpus/<target>/ (fuzz/make_seeds.py writes them). cargo-fuzz is
# installed on first use; RUSTC_BOOTSTRAP=1 lets the stable toolchain take the nightly-only
# sanitizer flags it passes. New inputs go to fuzz/target/corpus/<target>/ (not committed),
# crashes to fuzz/artifacts/<target>/. `make test` replays the committed corpus through the
# same checks (tests/fuzz_corpus.rs).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= parse place read_blocks load differential
FUZZ_ARGS    ?=

fuzz:
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	cd fuzz && for t in $(FUZZ_TARGETS); do \
		mkdir -p target/corpus/$$t && \
		RUSTC_BOOTSTRAP=1 cargo fuzz run $$t target/corpus/$$t corpus/$$t -- \
			-max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 $(FUZZ_ARGS) || exit 1; \
	done

# Sanitizers (not part of `make test`: a few minutes from scratch). Stable toolchain, with
# RUSTC_BOOTSTRAP=1 for the nightly-only -Zsanitizer flag; builds go to target/asan*.
# sanitize-rust: every Rust test under AddressSanitizer + LeakSanitizer (the Rust code and
#   the cxx bridge's C++ instrumented), then every test binary under valgrind memcheck.
# sanitize-cpp: the torch extension (csrc/ops.cpp and the Rust staticlib, both instrumented)
#   built into target/asan-ext/ and driven from Python with gcc's libasan preloaded.
ASAN_TARGET := x86_64-unknown-linux-gnu
ASAN_DIR    := target/asan
ASAN_ENV    := RUSTC_BOOTSTRAP=1 RUSTFLAGS=-Zsanitizer=address \
               CXXFLAGS_x86_64_unknown_linux_gnu="-fsanitize=address -fno-omit-frame-pointer"
VALGRIND    := valgrind -q --error-exitcode=1 --leak-check=full --show-leak-kinds=definite \
               --errors-for-leak-kinds=definite

sanitize: sanitize-rust sanitize-cpp

sanitize-rust:
	$(ASAN_ENV) cargo test --locked --tests --target $(ASAN_TARGET) --target-dir $(ASAN_DIR)
	CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$(VALGRIND)" cargo test --locked --tests

sanitize-cpp: $(DEPS)
	$(ASAN_ENV) cargo build --locked --lib --release --target $(ASAN_TARGET) --target-dir $(ASAN_DIR)
	$(PY) tests/sanitize/build_extension.py $(ASAN_DIR)/$(ASAN_TARGET)/release/libfastsafetensors.a \
		$(ASAN_DIR)/$(ASAN_TARGET)/cxxbridge target/asan-ext
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
		ASAN_OPTIONS=detect_leaks=0 PYTHONPATH=target/asan-ext \
		$(PY) tests/sanitize/exercise_extension.py
