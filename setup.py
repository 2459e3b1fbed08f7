"""Builds the Rust staticlib with cargo, then the torch extension `fastsafetensors_rs._C`."""

import os
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(ROOT, "target")
PROFILE = os.environ.get("FASTSAFETENSORS_CARGO_PROFILE", "release")
STATICLIB = os.path.join(TARGET, PROFILE, "libfastsafetensors.a")


class BuildWithCargo(BuildExtension):
    """Runs `cargo build` first: the extension links the staticlib and includes the
    cxx-generated headers under target/cxxbridge."""

    def build_extensions(self):
        subprocess.check_call(
            ["cargo", "build", "--locked", "--lib", "--profile", PROFILE], cwd=ROOT
        )
        super().build_extensions()


extension = CppExtension(
    name="fastsafetensors_rs._C",
    sources=["csrc/ops.cpp"],
    include_dirs=[os.path.join(TARGET, "cxxbridge")],
    extra_compile_args=["-O2", "-fvisibility=hidden"],
    extra_objects=[STATICLIB],
    # Keep the Rust runtime's symbols private to this library.
    extra_link_args=["-Wl,--exclude-libs,ALL", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl"],
)

setup(
    name="fastsafetensors-rs",
    version="0.1.0",
    description="Fast .safetensors loading into CPU or GPU memory (Rust core, torch ops)",
    packages=["fastsafetensors_rs"],
    package_dir={"": "python"},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildWithCargo},
    python_requires=">=3.9",
    install_requires=["torch>=2.5"],
    # vLLM loads general plugins from this group: it adds the load format `fastsafetensors_rs`.
    entry_points={"vllm.general_plugins": ["fastsafetensors_rs = fastsafetensors_rs.vllm_plugin:register"]},
)
