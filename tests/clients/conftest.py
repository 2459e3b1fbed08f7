"""The client tests (`make test-vllm`): real vLLM, SGLang and IBM fastsafetensors, with this
project installed into their environment as a user installs it. See harness.py for the
checkpoints and for what the harness changes to run without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (sets VLLM_TARGET_DEVICE before anything imports vLLM)


def pytest_configure(config):
    # The tests are about the installed package, never the checkout's python/ folder.
    spec = importlib.util.find_spec("fastsafetensors_rs")
    assert spec is not None, "fastsafetensors_rs is not installed in this environment"
    origin = Path(spec.origin).resolve()
    assert "site-packages" in origin.parts, f"fastsafetensors_rs imported from {origin}, not installed"


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Path:
    return harness.save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def bert(tmp_path_factory) -> Path:
    return harness.save_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session", params=["llama", "bert"])
def checkpoint(request) -> Path:
    """Each checkpoint in turn: the sharded Llama (index.json) and the single-file BERT."""
    return request.getfixturevalue(request.param)
