"""What the compiled extension records about its build, and which torch may load it.

torch's C++ ABI is stable across the patch releases of one minor release and changes between
minor releases (2.14 -> 2.15 renames and removes symbols the extension links against), and
the libstdc++ dual ABI must match. So an extension built against torch X.Y.* loads under any
torch X.Y.* with the same `_GLIBCXX_USE_CXX11_ABI`, and under nothing else. The build writes
`describe(torch)` to FILE beside the library (setup.py loads this file by path); the package
compares it with the running torch before loading the library, which under a mismatched torch
would fail with an undefined symbol that names neither version.
"""

from __future__ import annotations

import re

FILE = "_build_info.json"
# --no-deps: a forced reinstall would otherwise reinstall (and may upgrade) torch itself;
# --no-cache-dir: pip would otherwise reuse the wheel it built for the previous torch.
REBUILD = ("pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir fastsafetensors-rs "
           "(from a checkout: pip install --no-build-isolation --no-deps --force-reinstall .)")


def describe(torch) -> dict:
    """The facts about `torch` that decide whether an extension built against it loads."""
    return {"torch": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}


def minor_release(version: str) -> tuple:
    """(major, minor) of a torch version string: '2.14.1+cu128' -> (2, 14)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def incompatibility(built: dict, running: dict) -> str | None:
    """Why an extension built as `built` cannot load under `running`, or None if it can."""
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
