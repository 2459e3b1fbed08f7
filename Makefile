# Everything needed from a fresh machine: `make demo`, `make test`, `make bench`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEPS   := $(VENV)/.deps
# What the wheel is made of: a change to any of these rebuilds and reinstalls it.
SOURCES := $(shell find rust csrc python/fastsafetensors_rs build_backend \
                -name '*.rs' -o -name '*.cpp' -o -name '*.h' -o -name '*.py') \
           Cargo.toml Cargo.lock setup.py pyproject.toml MANIFEST.in README.md LICENSE

.PHONY: all venv build wheel dev demo test test-rust test-python test-install bench gpu-check clean tf4 cpp-example
.PHONY: garage test-remote bench-remote
.PHONY: fuzz sanitize sanitize-rust sanitize-cpp test-vllm

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# Downloads go to a wheelhouse in build/ that later steps install from (tests/install makes
# more venvs with the same torch): pip's own HTTP cache stores nothing from this registry.
# A fresh clone starts with an empty one.
WHEELHOUSE := build/wheelhouse
export FASTSAFETENSORS_WHEELHOUSE := $(abspath $(WHEELHOUSE))

$(DEPS): requirements-dev.txt | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) download -d $(WHEELHOUSE) -r requirements-dev.txt
	$(PIP) install --no-index --find-links $(WHEELHOUSE) -r requirements-dev.txt
	touch $@

venv: $(DEPS)

# ---------------------------------------------------------------- build and install
# `make build` builds a wheel against .venv's torch and installs it into .venv the way a user
# installs the project (not editable), so everything that runs from .venv (tests, demo,
# bench) imports the installed package, never python/. cargo builds the staticlib, setup.py
# compiles csrc/ and links it; see README, "Installing".
WHEEL_DIR := dist/wheel
INSTALLED := $(VENV)/.installed-wheel
EDITABLE  := $(VENV)/.installed-editable

$(INSTALLED): $(DEPS) $(SOURCES)
	@command -v cargo >/dev/null || { echo "cargo is required: install Rust (https://rustup.rs)"; exit 1; }
	rm -rf $(WHEEL_DIR)
	$(PIP) wheel --no-build-isolation --no-deps -w $(WHEEL_DIR) .
	$(PIP) install --no-deps --force-reinstall $(WHEEL_DIR)/fastsafetensors_rs-*.whl
	rm -f $(EDITABLE)
	touch $@

build: $(INSTALLED)

# ---------------------------------------------------------------- the released wheel
# `make wheel`: the wheel users `pip install` with no compiler, into any environment with torch
# 2.11 or newer. It is the wheel `make build` makes (against .venv's torch, which is >= 2.11: the
# library is the stable-ABI one, which the recipe checks), tagged manylinux by auditwheel.
# libtorch and the CUDA libraries are the user's torch's: never vendored (--exclude). The
# platform is the oldest manylinux policy the library's symbols satisfy (manylinux_2_34 when
# built on glibc 2.36; WHEEL_PLAT=... to ask for one). .github/workflows/release.yml runs this.
RELEASE_DIR := dist/release
WHEEL_PLAT  ?= auto
WHEEL_KEEP_OUT := 'libtorch*.so' 'libc10*.so' 'libcu*.so*' 'libnv*.so*'

wheel: $(INSTALLED)
	$(PY) -c 'import glob, json, sys, zipfile; \
	    w = glob.glob("$(WHEEL_DIR)/fastsafetensors_rs-*.whl")[0]; \
	    info = json.loads(zipfile.ZipFile(w).read("fastsafetensors_rs/_build_info.json")); \
	    sys.exit(None if info.get("abi") == "stable" else f"{w}: not the stable-ABI library: {info}")'
	rm -rf $(RELEASE_DIR)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair --plat $(WHEEL_PLAT) \
		$(addprefix --exclude ,$(WHEEL_KEEP_OUT)) \
		-w $(RELEASE_DIR) $(WHEEL_DIR)/fastsafetensors_rs-*.whl
	@ls $(RELEASE_DIR)/*.whl

# The quick loop while editing: an editable install, python/ used in place (run `make dev`
# again after a Rust or C++ change). `make build` and `make test` put the wheel back.
dev: $(DEPS)
	@command -v cargo >/dev/null || { echo "cargo is required: install Rust (https://rustup.rs)"; exit 1; }
	$(PIP) install --no-build-isolation --no-deps -e .
	rm -f $(INSTALLED)
	touch $(EDITABLE)

demo: build
	$(PY) examples/demo.py

# Each stage in turn, with its wall time (CI reports them). A block that adds a stage appends
# it to TEST_STAGES.
TEST_STAGES := test-rust test-python test-install

test:
	@for stage in $(TEST_STAGES); do \
		start=$$(date +%s); \
		$(MAKE) --no-print-directory $$stage || exit 1; \
		echo "make $$stage: $$(( $$(date +%s) - start )) s"; \
	done

test-rust:
	cargo test --locked

# The suite imports the installed wheel: conftest.py refuses a package imported from python/.
# tests/python/test_remote.py runs against Garage (below), built first if missing.
test-python: build tf4 garage
	FST_GARAGE=$(abspath $(GARAGE)) FASTSAFETENSORS_TEST_INSTALLED=1 $(PY) -m pytest tests/python -q

# Only the remote-source tests (S3 through Garage, HTTP ranges, faults).
test-remote: build garage
	FST_GARAGE=$(abspath $(GARAGE)) FASTSAFETENSORS_TEST_INSTALLED=1 $(PY) -m pytest tests/python/test_remote.py tests/python/test_remote_redirects.py tests/python/test_remote_rtt.py tests/python/test_remote_receive.py -q

# Garage, the S3 server the remote-source tests start on 127.0.0.1: a test dependency built
# from crates.io into build/garage (about 7 minutes on 2 cores, once), never linked or shipped.
GARAGE_VERSION := 2.5.0
GARAGE := build/garage/bin/garage
$(GARAGE):
	@command -v cargo >/dev/null || { echo "cargo is required: install Rust (https://rustup.rs)"; exit 1; }
	cargo install garage@$(GARAGE_VERSION) --locked --no-default-features --features bundled-libs,sqlite \
		--root build/garage

garage: $(GARAGE)

# ---------------------------------------------------------------- install paths, torch range
# The project installed as users install it, each checked from outside the source tree
# (tests/install): the released wheel (`make wheel`) in fresh venvs with torch 2.11, 2.14
# (beside IBM's fastsafetensors) and 2.15 and no compiler on PATH, running the core tests
# there, and its clear error under torch 2.10; default build isolation (stops at once), the
# sdist alone, the wheel built from it in a fresh venv with the source gone, and `pip install
# --no-build-isolation .` in fresh venvs with each torch of FASTSAFETENSORS_TORCH_RANGE
# (default 2.8.0: the per-torch library). Needs the registry (torch, ~3 GB per release, into
# pip's temporary space) and ~6 GB of scratch space in $TMPDIR at a time, freed as it goes.
INSTALL_TEST_ARGS ?=

test-install: wheel
	$(PY) -m pytest tests/install -v -s --durations=0 -p no:cacheprovider $(INSTALL_TEST_ARGS)

# transformers 4.57 beside the 5.x in .venv, for the second run of the transformers tests.
TF4 := .tf4/.installed
$(TF4): tests/requirements-transformers4.txt | $(DEPS)
	rm -rf .tf4
	$(PIP) install --target .tf4 --no-deps -r tests/requirements-transformers4.txt
	touch $@

tf4: $(TF4)

# The C++ example: calls the op through the dispatcher, built against the torch wheel's libtorch.
CPP_EXAMPLE := build/cpp-example/fst_load
$(CPP_EXAMPLE): examples/cpp/load.cpp | $(INSTALLED)
	mkdir -p $(@D)
	TORCH_DIR=$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
	$(CXX) -std=c++20 -O2 -I$$TORCH_DIR/include $< -o $@ \
	    -L$$TORCH_DIR/lib -Wl,-rpath,$$TORCH_DIR/lib -lc10 -ltorch_cpu -ldl
	@echo "run: $@ $$($(PY) -c 'import fastsafetensors_rs; print(fastsafetensors_rs.LIBRARY_PATH)') FILE.safetensors..."

cpp-example: $(CPP_EXAMPLE)

# Local files (bench/bench.py), verified loads (bench/verify.py), durable sharded saves
# (bench/save.py: beside safetensors, IBM's fastsafetensors 0.5, torch.save and dd; IBM's
# package goes into build/bench-peers/ on first use, never into .venv), then the same kind of
# checkpoint from a local S3 server (bench/remote.py: Garage on 127.0.0.1, beside curl's
# ranged GETs, boto3 and Run:ai). bench/keep.py: what a restart costs with keep=True (attach
# against cold, warm and verified loads; the first, filling load; 4 processes' PSS of one entry).
bench: build garage
	$(PY) bench/bench.py $(BENCH_ARGS)
	$(PY) bench/verify.py $(BENCH_VERIFY_ARGS)
	$(PY) bench/save.py $(BENCH_SAVE_ARGS)
	$(PY) bench/keep.py $(BENCH_KEEP_ARGS)
	$(MAKE) --no-print-directory bench-remote

# The same server and clients on loopback, then through the delaying proxy at 20 and 80 ms of
# round-trip time (tests/python/remote_servers.py DelayProxy: this kernel has no netem).
bench-remote: build garage
	FST_GARAGE=$(abspath $(GARAGE)) $(PY) bench/remote.py --rtt-ms 0,20,80 $(BENCH_REMOTE_ARGS)

# On a machine with a GPU: every CUDA check in one table (tests/gpu/gpu_check.py lists them),
# then throughput; under 10 minutes on one GPU. It needs only torch, safetensors and the built
# package: where there is no cargo, build a wheel elsewhere against the same torch release
# (`pip wheel --no-build-isolation .`), `pip install` it and run `python tests/gpu/gpu_check.py`
# (or copy its _C.abi3.so and _build_info.json into python/fastsafetensors_rs/ and run
# `PYTHONPATH=python python tests/gpu/gpu_check.py`).
gpu-check: build
	$(PY) tests/gpu/gpu_check.py $(GPU_CHECK_ARGS)

# Real clients, unmodified: vLLM 0.33 (and older vLLM releases' loaders, SGLang 0.5) with
# this project installed into their environment as a user installs it. The environment,
# .venv-vllm, is made once: vLLM's wheel without its dependencies, then its requirements with
# certifi pinned (vLLM 0.33 asks for certifi>=2026.10.19, newer than the registry serves);
# they bring torch 2.14.0 and IBM's fastsafetensors 0.5.0. SGLang goes into
# .venv-vllm/sglang (tests/clients/requirements-sglang.txt), the Python code of older vLLM
# releases into .venv-vllm/vllm-X for the plugin's tests. Each run installs a clean copy of
# this checkout (its files as git lists them: what a fresh clone has; only cargo's target/
# is kept between runs) with `pip install --no-build-isolation`, runs tests/clients, then
# uninstalls it and checks that IBM's package is whole and still works. See tests/clients/harness.py for what the
# harness changes to run without a GPU.
VLLM_VERSION := 0.33.0
VLLM_OLDER   := 0.22.0 0.31.0
VLLM_PINS    := certifi==2026.10.18
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_READY   := $(VLLM_VENV)/.ready
CLIENT_COPY  := $(VLLM_VENV)/checkout

$(VLLM_READY): tests/clients/requirements-sglang.txt tests/clients/requirements_of.py
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip packaging
	$(VLLM_PY) -m pip install --no-deps vllm==$(VLLM_VERSION)
	$(VLLM_PY) tests/clients/requirements_of.py vllm $(addprefix --override ,$(VLLM_PINS)) > $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install -r $(VLLM_VENV)/requirements.txt pytest wheel
	$(VLLM_PY) -m pip install --no-deps --target $(VLLM_VENV)/sglang -r tests/clients/requirements-sglang.txt
	for v in $(VLLM_OLDER); do \
		$(VLLM_PY) -m pip install --no-deps --target $(VLLM_VENV)/vllm-$$v vllm==$$v gguf==0.19.0 || exit 1; \
	done
	touch $@

test-vllm: $(VLLM_READY)
	@command -v cargo >/dev/null || { echo "cargo is required: install Rust (https://rustup.rs)"; exit 1; }
	mkdir -p $(CLIENT_COPY) && find $(CLIENT_COPY) -mindepth 1 -maxdepth 1 ! -name target -exec rm -rf {} +
	git ls-files -z --cached --others --exclude-standard | \
		tar --null --files-from=- --ignore-failed-read -cf - | tar -xf - -C $(CLIENT_COPY)
	$(VLLM_PY) -m pip uninstall -y fastsafetensors-rs
	$(VLLM_PY) -m pip install --no-build-isolation $(CLIENT_COPY)
	FST_SGLANG_PATH=$(abspath $(VLLM_VENV)/sglang) $(VLLM_PY) -m pytest -p no:cacheprovider tests/clients -q
	for v in $(VLLM_OLDER); do \
		PYTHONPATH=$(abspath $(VLLM_VENV)/vllm-$$v) $(VLLM_PY) -m pytest -p no:cacheprovider -q -rs \
			tests/clients/test_vllm_plugin.py || exit 1; \
	done
	$(VLLM_PY) -m pip uninstall -y fastsafetensors-rs
	$(VLLM_PY) tests/clients/ibm_after_uninstall.py

clean:
	rm -rf target build dist python/*.egg-info python/fastsafetensors_rs/_C*.so \
		python/fastsafetensors_rs/_build_info.json $(INSTALLED) $(EDITABLE) .tf4 \
		$(CLIENT_COPY)

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
