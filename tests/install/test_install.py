"""Installs the project the ways users do and checks each result from outside the source tree.

Run by `make test-install` (part of `make test`) with .venv's interpreter, which builds
(torch 2.15, setuptools, wheel, build). Every check runs with its working directory in a
scratch directory outside the checkout, so `python/` is never importable; the package must
come from where it was installed (each check asserts where it was imported from).

- the released wheel (`make wheel`: the stable-ABI library, tagged manylinux) installs with
  plain `pip install` into fresh venvs with torch 2.11, 2.14 (the one vLLM pins, with IBM's
  fastsafetensors beside it) and 2.15 where no compiler or cargo is on PATH, and works there:
  a checkpoint bit-exact, the op from TorchScript, vLLM's plugin entry point, the core
  tests; under torch 2.10 its import fails naming the minimum and the source build;
- default build isolation stops at once with the `--no-build-isolation` advice;
- the sdist holds everything a build needs and, unpacked away from the checkout, builds a
  wheel; a Rust edit and a deleted module in that tree reach its next non-editable build;
  with the tree deleted, the wheel installs into a fresh venv (pip resolves torch itself)
  and works there: API, CLI, console script, core tests;
- `pip install --no-build-isolation <checkout>` in a fresh venv holding the oldest supported
  torch (the per-torch library), and the clear error the released wheel gives there.

Environment: FASTSAFETENSORS_WHEEL_TORCH (default "2.11.0 2.14.0 2.15.0"),
FASTSAFETENSORS_TORCH_RANGE (default "2.8.0"), FASTSAFETENSORS_KEEP_INSTALL_TESTS=1 keeps the
scratch directory (about 5 GB per venv).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
TORCH_RANGE = os.environ.get("FASTSAFETENSORS_TORCH_RANGE", "2.8.0").split()
# The released wheel's torch releases: its minimum, the one vLLM pins, the newest.
TORCH_WHEEL = os.environ.get("FASTSAFETENSORS_WHEEL_TORCH", "2.11.0 2.14.0 2.15.0").split()
TORCH_TOO_OLD = "2.10.0"  # the newest the released wheel refuses
MIN_STABLE_TORCH = "2.11"
TORCH_VLLM = "2.14.0"  # what vLLM 0.33 pins; IBM's fastsafetensors is installed beside ours there
# What a user without a toolchain lacks: none may be on the PATH the released wheel is tested with.
TOOLCHAIN = ["cc", "c++", "gcc", "g++", "clang", "clang++", "cargo", "rustc", "ld"]
IBM_FASTSAFETENSORS = "fastsafetensors==0.5.0"
# The suites that exercise what depends on torch's version: the op schema and registration,
# every dtype (float8, float4, e8m0) through from_blob, the header-only ops, TorchScript, the
# fake kernel, and the compatible API; less the tests that start fresh interpreters or
# compile with inductor (slow, and no more torch-version-specific). About 30 s on 2 cores.
CORE_TESTS = ["test_roundtrip.py", "test_safe_open.py", "test_errors.py", "test_torchscript.py",
              "test_integrations_fake.py", "test_compat_api.py"]
CORE_TESTS_DESELECT = "not fresh_process and not inductor and not buffered_fallback and not in_one_process"
CORE_TEST_DEPS = ["safetensors==0.8.0", "pytest", "numpy", "psutil"]
MARKER = "not a regular file"  # rust/error.rs's message for /dev/null, edited in a copy below


# ---------------------------------------------------------------- helpers

def run(cmd, *, cwd, env=None, check=True, timeout=1800) -> subprocess.CompletedProcess:
    """Runs `cmd`, prints it with its wall time; with `check`, fails with its output."""
    cmd = [str(c) for c in cmd]
    full_env = dict(os.environ)
    for name in ("PYTHONPATH", "FASTSAFETENSORS_READER", "VIRTUAL_ENV"):
        full_env.pop(name, None)
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    print(f"[{time.monotonic() - start:6.1f} s] {' '.join(cmd)} -> {proc.returncode}", flush=True)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def pip_install(python, *requirements, cwd, env=None) -> None:
    """`pip install`, taking what `make venv` downloaded from the run's wheelhouse
    (FASTSAFETENSORS_WHEELHOUSE) and the rest from the registry. The other torch releases are
    not added to the wheelhouse: at about 3.5 GB each, keeping them would fill a CI disk."""
    wheelhouse = os.environ.get("FASTSAFETENSORS_WHEELHOUSE")
    # pip takes a --find-links file over the registry's copy of the same version.
    find_links = ["--find-links", wheelhouse] if wheelhouse else []
    run([python, "-m", "pip", "install", *find_links, *requirements], cwd=cwd, env=env)


def without_toolchain(venv: Path) -> dict:
    """The environment of a user with no compiler, linker or cargo: PATH holds the venv's
    scripts alone (pip and Python need nothing else to install and run a wheel)."""
    path = str(venv / "bin")
    found = {tool: shutil.which(tool, path=path) for tool in TOOLCHAIN}
    assert not any(found.values()), found
    return {"PATH": path, "CARGO_HOME": str(venv / "no-cargo"), "RUSTUP_HOME": str(venv / "no-rustup")}


def oldest_python() -> str:
    """Python 3.10 (the oldest the package declares) where one is installed, else .venv's."""
    candidates = [shutil.which("python3.10"),
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10.*/bin/python3.10"))]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return BASE_PYTHON


def make_venv(path: Path, python: str = BASE_PYTHON) -> Path:
    run([python, "-m", "venv", path], cwd=path.parent)
    return path / "bin" / "python"


def seed_cargo_target(tree: Path) -> None:
    """Gives a source tree outside the checkout a cargo target directory holding the
    checkout's compiled dependencies, without any artifact of the crate itself: the crate
    is compiled from the tree's own sources, its dependencies are not compiled again (that
    would add minutes and test cargo, not this project)."""
    seed = ROOT / "target" / "release"
    if not seed.is_dir():
        return
    dest = tree / "target" / "release"
    shutil.copytree(seed, dest, symlinks=True,
                    ignore=shutil.ignore_patterns("*fastsafetensors-*", "*fastsafetensors_*", "libfastsafetensors.*"))
    assert not list(dest.rglob("*fastsafetensors*")), "the crate's own artifacts must not be seeded"


def only(paths) -> Path:
    paths = list(paths)
    assert len(paths) == 1, paths
    return paths[0]


# Run inside the environment under test: loads the checkpoint with fastsafetensors_rs and
# compares every tensor, byte for byte, with safetensors.torch.load_file.
CHECK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import load_file
    import fastsafetensors_rs as fst

    checkpoint, expected_home, source_tree = sys.argv[1:4]
    home = Path(fst.__file__).resolve().parent
    assert home.is_relative_to(Path(expected_home).resolve()), f"imported from {home}"
    assert not home.is_relative_to(Path(source_tree).resolve()), f"imported from the source tree: {home}"
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    assert files, checkpoint
    count = 0
    for f in files:
        got, want = fst.load_file(str(f)), load_file(str(f))
        assert got.keys() == want.keys(), f
        for name, t in want.items():
            g = got[name]
            assert (g.dtype, g.shape) == (t.dtype, t.shape), name
            assert torch.equal(g.contiguous().view(-1).view(torch.uint8),
                               t.contiguous().view(-1).view(torch.uint8)), name
            count += 1
    print(json.dumps({"torch": torch.__version__, "package": str(home), "tensors": count,
                      "library_bytes": Path(fst.LIBRARY_PATH).stat().st_size}))
""")


def check_load(python, checkpoint, expected_home, cwd, env=None) -> str:
    proc = run([python, "-c", CHECK, checkpoint, expected_home, ROOT / "python"], cwd=cwd, env=env)
    return proc.stdout


def run_core_tests(python, cwd, env=None):
    proc = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", CORE_TESTS_DESELECT,
         *[ROOT / "tests" / "python" / t for t in CORE_TESTS]],
        cwd=cwd, env={"FASTSAFETENSORS_TEST_INSTALLED": "1", **(env or {})})
    print(proc.stdout.strip().splitlines()[-1])


# Run inside an environment with the released wheel: the library is the stable-ABI one, the
# op runs from TorchScript (scripted as a TorchScript user writes it) bit-exact against
# safetensors, and vLLM finds the plugin's entry point. A file, for TorchScript reads the
# scripted function's source.
WHEEL_CHECK = textwrap.dedent("""
    import importlib.metadata as md, json, sys
    from pathlib import Path
    from typing import Dict, List
    import torch
    from safetensors.torch import load_file
    import fastsafetensors_rs as fst
    from fastsafetensors_rs import _build_info

    checkpoint = sys.argv[1]
    home = Path(fst.__file__).resolve().parent
    info = json.loads((home / _build_info.FILE).read_text())
    assert info["abi"] == "stable" and info["min_torch"] == sys.argv[2], info


    @torch.jit.script
    def scripted_load(files: List[str]) -> Dict[str, torch.Tensor]:
        names, tensors = torch.ops.fastsafetensors.load(files)
        return {name: t for name, t in zip(names, tensors)}


    files = sorted(str(p) for p in Path(checkpoint).glob("*.safetensors"))
    got = scripted_load(files)
    want = {name: t for f in files for name, t in load_file(f).items()}
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (t.dtype, t.shape), name
        assert torch.equal(g.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), name
    plugins = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "fastsafetensors_rs"]
    assert [e.value for e in plugins] == ["fastsafetensors_rs.vllm_plugin:register"], plugins
    registered = plugins[0].load()()  # no vLLM here: the plugin loads and registers nothing
    print(json.dumps({"torch": torch.__version__, "library": Path(fst.LIBRARY_PATH).name, "scripted": len(got),
                      "plugin_registered": registered}))
""")


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def scratch():
    path = Path(tempfile.mkdtemp(prefix="fastsafetensors-rs-install-"))
    assert not path.is_relative_to(ROOT)
    yield path
    if os.environ.get("FASTSAFETENSORS_KEEP_INSTALL_TESTS") != "1":
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint(scratch):
    """A real Hugging Face checkpoint: a small randomly initialised Llama saved by
    transformers in several shards (bf16, with the index file)."""
    out = scratch / "checkpoint"
    code = textwrap.dedent("""
        import sys, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(sys.argv[1], max_shard_size="200KB")
    """)
    run([sys.executable, "-c", code, out], cwd=scratch)
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


@pytest.fixture(scope="session")
def built_wheel():
    """The wheel `make build` made with .venv's torch (2.15)."""
    return only((ROOT / "dist" / "wheel").glob("fastsafetensors_rs-*.whl"))


@pytest.fixture(scope="session")
def release_wheel():
    """The wheel `make wheel` made: `make build`'s, tagged manylinux by auditwheel."""
    return only((ROOT / "dist" / "release").glob("fastsafetensors_rs-*.whl"))


# ---------------------------------------------------------------- the released wheel

def test_release_wheel_is_tagged_and_links_only_torchs_c_functions(release_wheel):
    """One wheel for every CPython >= 3.10 and every torch >= 2.11: abi3, manylinux, nothing
    vendored, and a library that needs of libtorch only the C functions of its stable ABI
    (a C++ symbol of torch, c10 or ATen would tie it to one torch release)."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    assert "-cp310-abi3-manylinux_" in release_wheel.name and release_wheel.name.endswith("_x86_64.whl"), \
        release_wheel.name
    with zipfile.ZipFile(release_wheel) as zf:
        names = zf.namelist()
        library = only(n for n in names if n.startswith("fastsafetensors_rs/_C") and n.endswith(".so"))
        info = json.loads(zf.read("fastsafetensors_rs/_build_info.json"))
        data = zf.read(library)
    assert info["abi"] == "stable" and info["min_torch"] == MIN_STABLE_TORCH, info
    assert not [n for n in names if ".libs/" in n], "auditwheel vendored libraries"
    import io
    elf = ELFFile(io.BytesIO(data))
    needed = sorted(tag.needed for s in elf.iter_sections() if isinstance(s, DynamicSection)
                    for tag in s.iter_tags() if tag.entry.d_tag == "DT_NEEDED")
    assert [n for n in needed if "torch" in n or "c10" in n or "cu" in n] == ["libtorch_cpu.so"], needed
    undefined = sorted(sym.name for sym in elf.get_section_by_name(".dynsym").iter_symbols()
                       if sym["st_shndx"] == "SHN_UNDEF" and sym.name)
    cxx_torch = [s for s in undefined if s.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch", "_ZNK3c10", "_ZNK2at"))]
    assert not cxx_torch, cxx_torch
    shims = [s for s in undefined if s.startswith(("aoti_torch_", "torch_"))]
    assert "torch_from_blob" in shims, shims
    print(f"{release_wheel.name}: {len(data)} byte library, NEEDED {needed}, {len(shims)} torch C functions")


@pytest.mark.parametrize("torch_version", TORCH_WHEEL)
def test_release_wheel_without_a_toolchain(scratch, checkpoint, release_wheel, torch_version):
    """`pip install <wheel>` where there is no compiler, linker or cargo, beside torch
    `torch_version`: no build step, and everything works."""
    venv = scratch / f"wheel-torch-{torch_version}"
    python = make_venv(venv)
    env = without_toolchain(venv)
    extra = [IBM_FASTSAFETENSORS] if torch_version == TORCH_VLLM else []
    pip_install(python, f"torch=={torch_version}", *CORE_TEST_DEPS, *extra, cwd=scratch, env=env)
    pip_install(python, release_wheel, cwd=scratch, env=env)
    run([python, "-m", "pip", "check"], cwd=scratch, env=env)
    print(check_load(python, checkpoint, venv, cwd=scratch, env=env))
    script = scratch / "wheel_check.py"
    script.write_text(WHEEL_CHECK)
    print(run([python, script, checkpoint, MIN_STABLE_TORCH], cwd=scratch, env=env).stdout.strip())
    run([venv / "bin" / "fastsafetensors-rs", "verify", checkpoint], cwd=scratch, env=env)
    run_core_tests(python, cwd=scratch, env=env)
    if extra:
        check_beside_ibm(python, scratch, env)
    if torch_version == TORCH_WHEEL[0]:
        check_compiles_against(python, scratch)
    shutil.rmtree(venv)


def check_compiles_against(python, scratch) -> None:
    """The stable-ABI sources compile against this torch's own headers (the oldest the wheel
    serves, whose headers lack what later ones add): a source build there works too. With
    the checkout's compiler, outside the toolchain-free environment."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        print(f"not checked: no C++ compiler ({cxx}) to compile the sources against this torch's headers")
        return
    include = run([python, "-c", "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))"],
                  cwd=scratch).stdout.strip()
    major, minor = map(int, MIN_STABLE_TORCH.split("."))
    run([cxx, "-std=c++17", "-fsyntax-only", f"-I{include}", f"-I{ROOT / 'target' / 'cxxbridge'}",
         "-DFASTSAFETENSORS_STABLE_ABI", f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000",
         ROOT / "csrc" / "ops.cpp"], cwd=scratch)


def test_release_wheel_names_the_minimum_under_an_older_torch(scratch, release_wheel):
    """Under torch 2.10 the wheel installs (torch>=2.8 covers source builds too), and its import
    fails at once with an ImportError naming the minimum torch and the source build."""
    venv = scratch / f"wheel-torch-{TORCH_TOO_OLD}"
    python = make_venv(venv)
    env = without_toolchain(venv)
    pip_install(python, f"torch=={TORCH_TOO_OLD}", cwd=scratch, env=env)
    pip_install(python, release_wheel, cwd=scratch, env=env)
    proc = run([python, "-c", "import fastsafetensors_rs"], cwd=scratch, env=env, check=False)
    assert proc.returncode == 1 and "ImportError" in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert f"needs torch>={MIN_STABLE_TORCH}" in error, error
    assert f"this environment has torch {TORCH_TOO_OLD}" in error, error
    assert "pip install --no-build-isolation" in error and "from source" in error, error
    print(error)
    shutil.rmtree(venv)


# ---------------------------------------------------------------- the install paths

def test_build_isolation_stops_at_once(scratch):
    """pip's default (isolated) build cannot see the installed torch: it must stop before
    downloading or compiling anything and say how to build."""
    start = time.monotonic()
    proc = run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", scratch / "isolated", ROOT],
               cwd=scratch, check=False)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "pip install --no-build-isolation" in output, output
    assert "torch" not in "".join(line for line in output.splitlines() if "Collecting" in line), output
    assert not list((scratch / "isolated").rglob("_C*.so"))
    assert elapsed < 120, f"took {elapsed:.0f} s"


def test_sdist_builds_a_wheel_that_works_in_a_fresh_venv(scratch, checkpoint):
    """The sdist holds everything a build needs; unpacked away from the checkout it builds a
    wheel; a Rust edit and a deleted module in that tree reach its next build; with the tree
    deleted, the first wheel installs into a fresh venv (pip resolves torch) and works."""
    out = scratch / "sdist"
    run([sys.executable, "-m", "build", "--sdist", "--outdir", out, ROOT], cwd=scratch)
    sdist = only(out.glob("fastsafetensors_rs-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/PKG-INFO"))).read().decode()
        tar.extractall(scratch / "src", filter="data")
    for required in ["Cargo.toml", "Cargo.lock", "rust/lib.rs", "rust/build.rs", "rust/bridge.rs",
                     "csrc/ops.cpp", "csrc/torch_api.h", "csrc/torch_api_stable.h",
                     "csrc/torch_api_aten.h", "setup.py", "pyproject.toml", "README.md", "LICENSE",
                     "build_backend/fastsafetensors_build.py",
                     "python/fastsafetensors_rs/__init__.py", "python/fastsafetensors_rs/compat/__init__.py"]:
        assert required in names, f"{required} missing from {sdist.name}"
    assert not [n for n in names if n.endswith(".so") or n.startswith(("target/", "build/"))
                or n.endswith("_build_info.json")], names
    for field in ["Name: fastsafetensors-rs", "Requires-Dist: torch>=2.8", "Requires-Python: >=3.10",
                  "License: Apache-2.0", "License-File: LICENSE", "Description-Content-Type: text/markdown"]:
        assert field in pkg_info, f"{field!r} not in PKG-INFO:\n{pkg_info}"

    tree = only((scratch / "src").iterdir())
    seed_cargo_target(tree)
    wheels = scratch / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", wheels / "a", tree],
        cwd=scratch)
    wheel = only((wheels / "a").glob("*.whl"))
    assert wheel.name.endswith("-cp310-abi3-linux_x86_64.whl"), wheel.name
    print(f"{wheel.name}: {wheel.stat().st_size} bytes; sdist {sdist.stat().st_size} bytes")
    with zipfile.ZipFile(wheel) as zf:
        entry_points = zf.read(only(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "fastsafetensors-rs = fastsafetensors_rs.cli:main" in entry_points, entry_points
    assert "fastsafetensors_rs = fastsafetensors_rs.vllm_plugin:register" in entry_points, entry_points

    # A Rust edit and a deleted module in the same tree must both reach the next
    # non-editable build (no stale library or module reused from its build/ directory).
    errors = tree / "rust" / "error.rs"
    text = errors.read_text()
    assert MARKER in text, f"the message {MARKER!r} is gone from rust/error.rs: pick another"
    errors.write_text(text.replace(MARKER, MARKER + " (edited)"))
    (tree / "python" / "fastsafetensors_rs" / "parallel_loader.py").unlink()
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", wheels / "b", tree],
        cwd=scratch)
    edited = only((wheels / "b").glob("*.whl"))
    assert "fastsafetensors_rs/parallel_loader.py" not in zipfile.ZipFile(edited).namelist()
    site = scratch / "edited-site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, edited], cwd=scratch)
    proc = run([sys.executable, "-c", "import fastsafetensors_rs as f; f.load_file('/dev/null')"],
               cwd=scratch, env={"PYTHONPATH": str(site)}, check=False)
    assert MARKER + " (edited)" in proc.stderr, proc.stderr

    shutil.rmtree(scratch / "src")
    venv = scratch / "fresh"
    python = make_venv(venv)
    pip_install(python, wheel, *CORE_TEST_DEPS, cwd=scratch)
    run([python, "-m", "pip", "check"], cwd=scratch)
    print(check_load(python, checkpoint, venv, cwd=scratch))
    inspect = run([venv / "bin" / "fastsafetensors-rs", "inspect", "--summary", "--json", checkpoint], cwd=scratch)
    totals = json.loads(inspect.stdout)["totals"]
    assert totals["files"] == len(list(checkpoint.glob("*.safetensors"))) and totals["tensors"] > 0, totals
    run([python, "-m", "fastsafetensors_rs", "verify", checkpoint], cwd=scratch)
    bad = scratch / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    proc = run([venv / "bin" / "fastsafetensors-rs", "verify", bad], cwd=scratch, check=False)
    assert proc.returncode == 1 and str(bad) in proc.stdout + proc.stderr, proc
    run_core_tests(python, cwd=scratch)
    shutil.rmtree(venv)


@pytest.mark.parametrize("torch_version", TORCH_RANGE)
def test_no_build_isolation_install_per_torch(scratch, checkpoint, built_wheel, torch_version):
    """`pip install --no-build-isolation <checkout>` into an environment that has only torch
    (and, for vLLM's torch, IBM's fastsafetensors): the user's command, verbatim. Below torch
    2.11 it builds the per-torch library."""
    venv = scratch / f"torch-{torch_version}"
    # The oldest torch runs on the oldest Python available.
    python = make_venv(venv, oldest_python() if torch_version == TORCH_RANGE[0] else BASE_PYTHON)
    print(run([python, "--version"], cwd=scratch).stdout)
    extra = [IBM_FASTSAFETENSORS] if torch_version == TORCH_VLLM else []
    pip_install(python, f"torch=={torch_version}", *CORE_TEST_DEPS, *extra, cwd=scratch)
    setuptools = run([python, "-c", "import setuptools; print(setuptools.__version__)"], cwd=scratch).stdout.strip()
    if torch_version == TORCH_RANGE[0] and tuple(map(int, setuptools.split(".")[:2])) < (70, 1):
        # A fresh venv's setuptools (65.5 from ensurepip) without `wheel`: the build stops
        # with what to install instead of setuptools' "invalid command 'bdist_wheel'".
        proc = run([python, "-m", "pip", "install", "--no-build-isolation", ROOT], cwd=scratch, check=False)
        assert proc.returncode != 0 and "`pip install wheel`" in proc.stdout + proc.stderr, proc
    pip_install(python, "setuptools", "wheel", cwd=scratch)
    run([python, "-m", "pip", "install", "--no-build-isolation", ROOT], cwd=scratch)
    run([python, "-m", "pip", "check"], cwd=scratch)
    print(check_load(python, checkpoint, venv, cwd=scratch))
    kind = run([python, "-c", "import json, fastsafetensors_rs as f, pathlib; print(json.loads("
                "(pathlib.Path(f.__file__).parent / '_build_info.json').read_text())['abi'])"], cwd=scratch)
    stable = tuple(map(int, torch_version.split(".")[:2])) >= tuple(map(int, MIN_STABLE_TORCH.split(".")))
    assert kind.stdout.strip() == ("stable" if stable else "torch"), kind.stdout
    run_core_tests(python, cwd=scratch)
    if extra:
        check_beside_ibm(python, scratch)

    # The wheel built against .venv's torch: under a torch older than its minimum it refuses
    # to load, naming both; under a newer one it loads.
    site = scratch / f"other-torch-{torch_version}"
    run([python, "-m", "pip", "install", "--no-deps", "--target", site, built_wheel], cwd=scratch)
    proc = run([python, "-c", "import fastsafetensors_rs"], cwd=scratch, env={"PYTHONPATH": str(site)}, check=False)
    if stable:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1 and "ImportError" in proc.stderr, proc.stderr
        assert f"needs torch>={MIN_STABLE_TORCH}" in proc.stderr, proc.stderr
        assert f"this environment has torch {torch_version}" in proc.stderr, proc.stderr
        assert "--no-build-isolation" in proc.stderr, proc.stderr
    shutil.rmtree(venv)


def check_beside_ibm(python, scratch, env=None) -> None:
    """IBM's fastsafetensors, installed beside this package, is untouched and still what
    `import fastsafetensors` gives, until the opt-in."""
    proc = run([python, "-c", textwrap.dedent("""
        import importlib.metadata as md, fastsafetensors, fastsafetensors_rs
        assert md.version("fastsafetensors") == "0.5.0", md.version("fastsafetensors")
        assert "fastsafetensors_rs" not in fastsafetensors.__file__, fastsafetensors.__file__
        assert hasattr(fastsafetensors, "SafeTensorsFileLoader")
        print(fastsafetensors.__file__)
    """)], cwd=scratch, env=env)
    assert "site-packages/fastsafetensors/" in proc.stdout, proc.stdout
    print("import fastsafetensors ->", proc.stdout.strip())
    # After the opt-in, the same import gives this package's compatible API.
    proc = run([python, "-c", textwrap.dedent("""
        import fastsafetensors_rs
        fastsafetensors_rs.install_as_fastsafetensors()
        import fastsafetensors
        from fastsafetensors.parallel_loader import ParallelLoader
        assert fastsafetensors.SafeTensorsFileLoader is fastsafetensors_rs.SafeTensorsFileLoader
        assert ParallelLoader is fastsafetensors_rs.ParallelLoader
        print("opted in")
    """)], cwd=scratch, env=env)
    assert proc.stdout.split() == ["opted", "in"], proc.stdout
    run([python, "-m", "pip", "check"], cwd=scratch, env=env)
