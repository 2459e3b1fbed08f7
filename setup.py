"""Builds the Rust staticlib with cargo, then the torch extension `fastsafetensors_rs._C`,
against the torch installed in this environment.

Metadata lives here rather than in pyproject.toml's [project] table so that any setuptools
from 64 on can build it with `--no-build-isolation` (the SPDX `license` string of [project]
needs setuptools 77). torch is imported only when the extension is built: a source
distribution needs no torch.

Which library: with torch 2.11 or newer, one built on LibTorch's stable ABI (csrc/torch_api_stable.h),
which then loads under every torch from 2.11 on (the released wheel is this one); with torch 2.8
to 2.10, one compiled for that torch release alone (csrc/torch_api_aten.h). Both register the same
ops with the same schemas.

Environment:
  DEBUG=1                          keep debug info in the extension (release builds strip it)
  FASTSAFETENSORS_CARGO_PROFILE    cargo profile of the staticlib (default: release)
  FASTSAFETENSORS_ABI              `stable` or `torch`: which of the two libraries (default:
                                   stable where the torch building it is 2.11 or newer)

cargo always builds in target/ beside this file, whatever CARGO_TARGET_DIR says: a target
directory shared by two source trees hands the library of whichever built first to the other
(cargo leaves target/<profile>/libfastsafetensors.a alone when it finds the crate fresh).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "fastsafetensors_rs"
PACKAGE_DIR = os.path.join(ROOT, "python", PACKAGE)
MIN_TORCH = (2, 8)  # csrc uses kFloat4_e2m1fn_x2 and kFloat8_e8m0fnu, new in torch 2.8
# The extension uses only libtorch (ops are registered with the dispatcher and loaded with
# torch.ops.load_library), never the Python C API: one wheel serves every CPython >= this.
LIMITED_API = "cp310"
# The keeper of kept weights: a program of the crate, installed beside the library.
KEEPER = "fastsafetensors-keeper"


def _debug() -> bool:
    return os.environ.get("DEBUG", "").lower() not in ("", "0", "false", "no")


def _version() -> str:
    with open(os.path.join(PACKAGE_DIR, "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _build_info_module():
    """`fastsafetensors_rs/_build_info.py`, loaded by path: the one definition of what the
    extension records about its build and of which torch may load it."""
    spec = importlib.util.spec_from_file_location("_fastsafetensors_build_info",
                                                  os.path.join(PACKAGE_DIR, "_build_info.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CleanBuild(build):
    """Starts every out-of-place build from an empty build/lib: setuptools would otherwise
    package whatever an earlier build left there (modules since deleted or renamed, an
    extension compiled against another torch)."""

    def run(self):
        build_lib = os.path.abspath(self.build_lib)
        if build_lib.startswith(os.path.join(ROOT, "build") + os.sep) and os.path.isdir(build_lib):
            shutil.rmtree(build_lib)
        super().run()


class TorchMissing(build_ext):
    """Stands in for the torch build command where torch cannot be imported."""

    def run(self):
        raise SystemExit(
            "fastsafetensors-rs: building the extension needs torch>=2.8 installed in this "
            "environment; install torch, then `pip install --no-build-isolation .`"
        )


def _torch_build_ext():
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    release = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if release < MIN_TORCH:
        raise SystemExit(
            f"fastsafetensors-rs needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} to build; this "
            f"environment has torch {torch.__version__}"
        )
    build_info = _build_info_module()
    abi = _abi(release, build_info)
    profile = os.environ.get("FASTSAFETENSORS_CARGO_PROFILE", "release")
    target = os.path.join(ROOT, "target")
    cargo_out = os.path.join(target, "debug" if profile == "dev" else profile)
    staticlib = os.path.join(cargo_out, "libfastsafetensors.a")
    cxxbridge = os.path.join(target, "cxxbridge")
    info = dict(build_info.record(torch, abi), profile=profile, debug=_debug())

    class BuildWithCargo(BuildExtension):
        """Runs `cargo build` first (the extension links the staticlib and includes the
        headers cxx generates under target/cxxbridge), then compiles csrc/ against this
        environment's torch and records which torch that was beside the library."""

        def finalize_options(self):
            super().finalize_options()
            # Object files of one torch (or library kind) are never reused for another.
            self.build_temp = os.path.join(self.build_temp, f"torch-{torch.__version__}-{abi}-{profile}")

        def build_extensions(self):
            if shutil.which("cargo") is None:
                raise SystemExit("fastsafetensors-rs: building needs cargo (a Rust toolchain: https://rustup.rs)")
            _cargo_build(profile, target)
            for ext in self.extensions:
                self._configure(ext)
                info_path = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), build_info.FILE)
                if _read_json(info_path) != info:
                    self.force = True  # built for another torch or with other options
            super().build_extensions()
            for ext in self.extensions:
                library = self.get_ext_fullpath(ext.name)
                _remove_other_builds(library)
                _install_keeper(cargo_out, os.path.dirname(library), info["debug"])
                with open(os.path.join(os.path.dirname(library), build_info.FILE), "w", encoding="utf-8") as f:
                    json.dump(info, f, indent=1, sort_keys=True)
                    f.write("\n")

        def copy_extensions_to_source(self):
            """Editable installs: the library is built out of place, then copied beside the
            sources; its build record goes with it and other builds there go."""
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace_library, built_library = self._get_inplace_equivalent(build_py, ext)
                _remove_other_builds(inplace_library)
                self.copy_file(os.path.join(os.path.dirname(built_library), build_info.FILE),
                               os.path.join(os.path.dirname(inplace_library), build_info.FILE))
                self.copy_file(os.path.join(os.path.dirname(built_library), KEEPER),
                               os.path.join(os.path.dirname(inplace_library), KEEPER))

        def _configure(self, ext):
            torch_ext = CppExtension(ext.name, ext.sources, py_limited_api=True)
            ext.include_dirs = torch_ext.include_dirs + [cxxbridge]
            ext.library_dirs = torch_ext.library_dirs
            ext.language = torch_ext.language
            if abi == build_info.STABLE:
                # The stable headers only (torch/library.h and ATen refuse to compile with
                # TORCH_TARGET_VERSION set), targeting the oldest torch the library supports;
                # the C shims they call are in libtorch_cpu.
                major, minor = build_info.MIN_STABLE_TORCH
                ext.define_macros = [("FASTSAFETENSORS_STABLE_ABI", None),
                                     ("TORCH_TARGET_VERSION", f"0x{major:02x}{minor:02x}000000000000")]
                ext.libraries = ["torch_cpu"]
            else:
                ext.libraries = torch_ext.libraries
            ext.py_limited_api = True
            ext.extra_objects = [staticlib]
            # A Rust change reaches the extension through the staticlib's timestamp.
            ext.depends = [staticlib, os.path.join(cxxbridge, "rust", "cxx.h"),
                           *(os.path.join(ROOT, "csrc", h) for h in os.listdir(os.path.join(ROOT, "csrc"))
                             if h.endswith(".h"))]
            ext.extra_compile_args = ["-O2", "-fvisibility=hidden"] + (["-g"] if info["debug"] else [])
            ext.extra_link_args = (
                # Keep the Rust runtime's symbols private to this library.
                ["-Wl,--exclude-libs,ALL", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl"]
                # Release builds drop the DWARF of the staticlib (cargo's release profile keeps
                # it for sanitizers and profilers) and of csrc: ~19 MB of a ~23 MB library.
                + ([] if info["debug"] else ["-Wl,--strip-debug"])
            )

    return BuildWithCargo


def _cargo_build(profile, target):
    """`cargo build` of the staticlib. cargo's messages stream through as it runs; on failure
    its error lines are repeated last, with the free disk space, because pip's and CI's logs
    often keep only the tail (a traceback) of a failed build."""
    cmd = ["cargo", "build", "--locked", "--lib", "--bin", KEEPER, "--profile", profile, "--target-dir", target]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, errors="replace")
    errors = []
    for line in proc.stderr:
        sys.stderr.write(line)
        if line.lstrip().startswith(("error", "warning: build failed", "Caused by")):
            errors.append(line.rstrip())
        elif errors and len(errors) < 60:
            errors.append(line.rstrip())  # the lines that explain the error
    if proc.wait() != 0:
        free = shutil.disk_usage(target if os.path.isdir(target) else ROOT).free
        raise SystemExit(
            f"fastsafetensors-rs: `{' '.join(cmd)}` failed (exit {proc.returncode}), "
            f"{free / 2**30:.1f} GiB free under {target}:\n" + "\n".join(errors[-60:]))


def _install_keeper(cargo_out, package_dir, debug):
    """The keeper program (rust/bin/keeper.rs: the process `keep=` loads start) beside the
    library, where the library looks for it; without its DWARF but in debug builds."""
    dst = os.path.join(package_dir, KEEPER)
    shutil.copy2(os.path.join(cargo_out, KEEPER), dst)
    strip = shutil.which("strip")
    if strip and not debug:
        subprocess.run([strip, "--strip-debug", dst], check=True)


def _abi(release, build_info) -> str:
    """Which library to build for torch `release`: FASTSAFETENSORS_ABI, else the stable-ABI one
    where this torch has what it needs."""
    stable = release >= build_info.MIN_STABLE_TORCH
    chosen = os.environ.get("FASTSAFETENSORS_ABI") or (build_info.STABLE if stable else build_info.PER_TORCH)
    if chosen not in (build_info.STABLE, build_info.PER_TORCH):
        raise SystemExit(f"fastsafetensors-rs: FASTSAFETENSORS_ABI={chosen!r}: expected "
                         f"{build_info.STABLE!r} or {build_info.PER_TORCH!r}")
    if chosen == build_info.STABLE and not stable:
        raise SystemExit(f"fastsafetensors-rs: the stable-ABI library needs torch>="
                         f"{'.'.join(map(str, build_info.MIN_STABLE_TORCH))} to build against; this "
                         f"environment has torch {'.'.join(map(str, release))}")
    return chosen


def _remove_other_builds(library):
    """Deletes `_C.<other suffix>.so` beside `library` (an in-place build of another Python
    or an older layout): the package loads the first `_C` it finds."""
    directory, name = os.path.split(library)
    stem = name.split(".", 1)[0]
    for other in os.listdir(directory):
        if other != name and other.startswith(stem + ".") and other.endswith(".so"):
            os.remove(os.path.join(directory, other))


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _cmdclass():
    build_ext_class = _torch_build_ext() if importlib.util.find_spec("torch") else TorchMissing
    return {"build": CleanBuild, "build_ext": build_ext_class}


with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    README = f.read()

setup(
    name="fastsafetensors-rs",
    version=_version(),
    description="Fast .safetensors loading into CPU or GPU memory: a Rust core behind native torch ops",
    long_description=README,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    keywords=["safetensors", "pytorch", "model loading", "gpudirect storage", "vllm"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Environment :: GPU :: NVIDIA CUDA",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Rust",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(where="python", include=[PACKAGE, PACKAGE + ".*"]),
    package_dir={"": "python"},
    include_package_data=True,
    ext_modules=[Extension(PACKAGE + "._C", sources=["csrc/ops.cpp"], py_limited_api=True)],
    cmdclass=_cmdclass(),
    options={"bdist_wheel": {"py_limited_api": LIMITED_API}},
    python_requires=">=3.10",
    install_requires=["torch>=2.8"],
    entry_points={
        "console_scripts": ["fastsafetensors-rs = fastsafetensors_rs.cli:main"],
        # vLLM loads general plugins from this group: it adds the load format `fastsafetensors_rs`.
        "vllm.general_plugins": ["fastsafetensors_rs = fastsafetensors_rs.vllm_plugin:register"],
    },
    zip_safe=False,
)
