"""What the compiled extension records about its build, and which torch may load it.

The library is one of two kinds (setup.py builds the first where it can):

- `stable`: built on LibTorch's stable ABI (only torch's C shims and the dispatcher), with
  its target set to torch MIN_STABLE_TORCH. It loads under that torch and every later one:
  the released wheel. Older torch releases lack what it calls (`torch_from_blob` with a
  deleter is new in 2.11).
- `torch`: compiled against one torch release's C++ API (ATen, torch/library.h), for torch
  2.8 to 2.10 (or when asked for). torch's C++ ABI is stable across the patch releases of
  one minor release and changes between minor releases (2.14 -> 2.15 renames and removes
  symbols), and the libstdc++ dual ABI must match. So it loads under any torch X.Y.* with the
  same `_GLIBCXX_USE_CXX11_ABI`, and under nothing else.

The build writes `record(torch, kind)` to FILE beside the library (setup.py loads this file by
path); the package compares it with the running torch before loading the library, which
under a torch it cannot serve would fail with an undefined symbol that names no version.
"""

from __future__ import annotations

import re

FILE = "_build_info.json"
STABLE = "stable"
PER_TORCH = "torch"
MIN_STABLE_TORCH = (2, 11)
# --no-deps: a forced reinstall would otherwise reinstall (and may upgrade) torch itself;
# --no-cache-dir: pip would otherwise reuse the wheel it built for the previous torch.
REBUILD = ("pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir fastsafetensors-rs "
           "(from a checkout: pip install --no-build-isolation --no-deps --force-reinstall .)")
# A source build for an older torch: what it needs and the command.
SOURCE_BUILD = ("build it from source against the installed torch (torch 2.8 or newer, a Rust toolchain, g++, "
                "setuptools and wheel): pip install --no-build-isolation --no-binary fastsafetensors-rs "
                "fastsafetensors-rs (from a checkout: pip install --no-build-isolation .)")


def describe(torch) -> dict:
    """The facts about the running `torch` that decide whether a library loads under it."""
    return {"torch": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}


def record(torch, kind: str) -> dict:
    """What a build of `kind` against `torch` records beside the library."""
    if kind == STABLE:
        return {"abi": STABLE, "torch": torch.__version__, "min_torch": "%d.%d" % MIN_STABLE_TORCH}
    return dict(describe(torch), abi=PER_TORCH)


def minor_release(version: str) -> tuple:
    """(major, minor) of a torch version string: '2.14.1+cu128' -> (2, 14)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def incompatibility(built: dict, running: dict) -> str | None:
    """Why a library built as `built` cannot load under `running`, or None if it can."""
    if built.get("abi") == STABLE:
        minimum = built["min_torch"]
        if minor_release(running["torch"]) < minor_release(minimum):
            return (f"fastsafetensors_rs needs torch>={minimum}: its library is built on LibTorch's stable ABI "
                    f"as torch {minimum} defines it, and this environment has torch {running['torch']}. "
                    f"Upgrade torch, or {SOURCE_BUILD}")
        return None
    if minor_release(built["torch"]) != minor_release(running["torch"]):
        return (f"fastsafetensors_rs was compiled against torch {built['torch']}, but this "
                f"environment has torch {running['torch']}; torch's C++ ABI differs between "
                f"minor releases. Rebuild it against the installed torch: {REBUILD}")
    if built["cxx11_abi"] != running["cxx11_abi"]:
        return (f"fastsafetensors_rs was compiled against torch {built['torch']} with "
                f"_GLIBCXX_USE_CXX11_ABI={int(built['cxx11_abi'])}, but this environment's torch "
                f"{running['torch']} uses _GLIBCXX_USE_CXX11_ABI={int(running['cxx11_abi'])}. "
                f"Rebuild it against the installed torch: {REBUILD}")
    return None
