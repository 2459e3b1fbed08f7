"""Builds the torch extension with AddressSanitizer into a directory of its own.

    python tests/sanitize/build_extension.py STATICLIB CXXBRIDGE_DIR OUT_DIR

STATICLIB is the Rust staticlib built with `-Zsanitizer=address` and CXXBRIDGE_DIR the
headers cxx generated beside it (`make sanitize-cpp` builds both). OUT_DIR receives a copy
of the Python package whose `_C` extension is csrc/ops.cpp compiled with
`-fsanitize=address` and linked against STATICLIB; put OUT_DIR first on PYTHONPATH and
preload gcc's libasan to run it. The in-place build (python/fastsafetensors_rs/_C*.so) is
left alone.
"""

import json
import os
import shutil
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer"]


def main(staticlib: str, cxxbridge: str, out: str) -> None:
    package = os.path.join(out, "fastsafetensors_rs")
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(
        os.path.join(ROOT, "python", "fastsafetensors_rs"),
        package,
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    os.chdir(ROOT)
    extension = CppExtension(
        name="fastsafetensors_rs._C",
        sources=["csrc/ops.cpp"],  # relative to ROOT, the working directory
        include_dirs=[os.path.abspath(cxxbridge)],
        extra_compile_args=["-O1", "-g", "-fvisibility=hidden"] + ASAN_FLAGS,
        extra_objects=[os.path.abspath(staticlib)],
        extra_link_args=ASAN_FLAGS + ["-Wl,--exclude-libs,ALL", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl"],
    )
    setup(
        name="fastsafetensors-rs-asan",
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension},
        script_args=[
            "build_ext",
            "--build-lib", os.path.abspath(out),
            "--build-temp", os.path.join(os.path.abspath(out), "build"),
        ],
    )
    # The package loads only an extension whose build record matches the running torch.
    sys.path.insert(0, package)
    import _build_info
    import torch

    with open(os.path.join(package, _build_info.FILE), "w", encoding="utf-8") as f:
        json.dump(_build_info.describe(torch), f)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
