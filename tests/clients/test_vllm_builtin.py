"""vLLM 0.33's own `--load-format fastsafetensors` (its `fastsafetensors_weights_iterator` and
`DefaultModelLoader`), unmodified, on this package through `install_as_fastsafetensors()`,
with IBM's fastsafetensors 0.5 installed beside it. Each case runs in a fresh interpreter
(scenarios.py): which package vLLM binds depends on the order of imports."""

from __future__ import annotations

import pytest

import harness


@pytest.fixture(scope="module")
def iterations():
    """The iterator checks a scenario reports: one per VLLM_FASTSAFETENSORS_QUEUE_SIZE (0, 2,
    -1) where vLLM's iterator uses ParallelLoader (0.24+), else one."""
    from vllm.model_executor.model_loader import weight_utils

    if harness.iterator_uses_parallel_loader(weight_utils):
        return ["weights_iterator-queue0", "weights_iterator-queue2", "weights_iterator-queue-1"]
    return ["weights_iterator"]


def test_opt_in_before_vllm(checkpoint, iterations):
    """The opt-in first: vLLM binds this package only, IBM's is never imported; vLLM's
    iterator and its DefaultModelLoader give every tensor; then (where this vLLM can build
    models on the CPU) vLLM builds the model itself and loads it through the fastsafetensors
    format, equal to its safetensors load."""
    build = harness.can_build_models_on_cpu()
    lines = harness.run_scenario("vllm-builtin", str(checkpoint), "--order", "install-first",
                                 *(["--load-model"] if build else []))
    names = [line.split()[1] for line in lines]
    assert names == [*iterations, "ibm-never-imported", "get_all_weights",
                     *(["load_model-vs-safetensors"] if build else [])], lines


def test_opt_in_after_vllm(llama, iterations):
    """vLLM imported first (it binds IBM's SingleGroup at import): the opt-in warns about that
    name, and vLLM's iterator still runs on this package."""
    lines = harness.run_scenario("vllm-builtin", str(llama), "--order", "client-first")
    names = [line.split()[1] for line in lines]
    assert names == ["warning-names-bound-before", *iterations, "get_all_weights"], lines


def test_opt_in_through_the_plugin_environment(llama):
    """FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS=1: vLLM's own plugin loading installs it in
    every vLLM process, before vLLM's loader modules are imported."""
    lines = harness.run_scenario("vllm-plugin-env", str(llama),
                                 env={"FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS": "1"})
    assert [line.split()[1] for line in lines] == ["plugin-env-weights_iterator", "ibm-never-imported"], lines


def test_two_gloo_ranks(llama):
    """Tensor parallelism over 2 gloo ranks: the 3 shards spread over the ranks (vLLM passes
    the WORLD group and nogds=True), every rank gets every tensor bit-exactly."""
    lines = harness.run_ranks("vllm", llama, world=2)
    assert sorted(line.split()[1] for line in lines) == ["vllm-rank0-of-2", "vllm-rank1-of-2"], lines
