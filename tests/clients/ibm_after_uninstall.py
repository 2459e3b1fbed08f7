"""Run by `make test-vllm` after `pip uninstall -y fastsafetensors-rs`: IBM's fastsafetensors
is whole and works on its own, also under vLLM's built-in `--load-format fastsafetensors`.
Prints one `CHECKED` line per check; any failure is a traceback and exit 1."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import tempfile
from pathlib import Path

import harness


def main() -> int:
    assert importlib.util.find_spec("fastsafetensors_rs") is None, "fastsafetensors_rs is still installed"
    plugins = [e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
    assert "fastsafetensors_rs" not in plugins, plugins
    assert harness.ibm_files_changed() == [], harness.ibm_files_changed()
    print("CHECKED ibm-files-as-installed 1")

    import fastsafetensors
    from fastsafetensors import SingleGroup, fastsafe_open

    assert fastsafetensors.__version__ == importlib.metadata.version("fastsafetensors") == "0.5.0"
    model = harness.save_bert(Path(tempfile.mkdtemp(prefix="bert-")))
    files = harness.checkpoint_files(model)
    expected = harness.reference(files)
    with fastsafe_open(files, device="cpu", nogds=True) as f:
        harness.assert_bit_exact({k: f.get_tensor(k).clone() for k in f.keys()}, expected)
    print(f"CHECKED ibm-fastsafe_open {len(expected)}")

    # vLLM's own iterator, on IBM's package (the harness's device patch, as in the tests).
    from vllm.model_executor.model_loader import weight_utils

    assert weight_utils.SingleGroup is SingleGroup
    with harness.cuda_device_as_cpu(weight_utils):
        got = harness.collect((k, t.clone()) for k, t in weight_utils.fastsafetensors_weights_iterator(files, False))
    harness.assert_bit_exact(got, expected)
    print(f"CHECKED vllm-on-ibm {len(got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
