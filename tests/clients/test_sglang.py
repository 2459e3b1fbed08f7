"""SGLang 0.5's own `--load-format fastsafetensors` (its `fastsafetensors_weights_iterator`
and `DefaultModelLoader`), unmodified, on this package through `install_as_fastsafetensors()`.

SGLang's wheel is installed without its dependencies into a separate folder (`make
test-vllm` puts it in `$FST_SGLANG_PATH`) on top of vLLM's environment, with the few
packages its loader modules import that vLLM's environment lacks and the transformers it
pins; torch is vLLM's 2.14.0 where SGLang pins 2.14.1. See the Makefile."""

from __future__ import annotations

import os

import pytest

import harness


@pytest.fixture(scope="module")
def sglang_env():
    path = os.environ.get("FST_SGLANG_PATH")
    assert path and os.path.isdir(os.path.join(path, "sglang")), (
        "FST_SGLANG_PATH must name the folder SGLang was installed into (make test-vllm does)"
    )
    return {"PYTHONPATH": os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)}


def test_opt_in_before_sglang(checkpoint, sglang_env):
    """The opt-in first: SGLang binds this package's SafeTensorsFileLoader and SingleGroup;
    its iterator (with and without GDS requested) and its DefaultModelLoader load every
    tensor bit-exactly, and IBM's package is never imported."""
    lines = harness.run_scenario("sglang-builtin", str(checkpoint), "--order", "install-first", env=sglang_env)
    assert [line.split()[1] for line in lines] == [
        "sglang-weights_iterator-gdsTrue", "sglang-weights_iterator-gdsFalse",
        "sglang-DefaultModelLoader", "ibm-never-imported"], lines


def test_opt_in_after_sglang(llama, sglang_env):
    """SGLang imported first binds IBM's classes: the opt-in names them in a warning, and
    those IBM objects keep working (SGLang then loads with IBM's package, as documented)."""
    lines = harness.run_scenario("sglang-builtin", str(llama), "--order", "client-first", env=sglang_env)
    assert [line.split()[1] for line in lines] == [
        "warning-names-bound-before", "sglang-weights_iterator-gdsFalse"], lines


def test_two_gloo_ranks(llama, sglang_env):
    lines = harness.run_ranks("sglang", llama, world=2, env=sglang_env)
    assert sorted(line.split()[1] for line in lines) == ["sglang-rank0-of-2", "sglang-rank1-of-2"], lines
