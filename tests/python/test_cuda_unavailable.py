"""On machines without a GPU, CUDA targets fail at once with a clear error, never a hang,
panic or abort. Each case runs in a fresh process with a time limit."""

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: see tests/gpu")

CALLS = [
    "fastsafetensors_rs.load_file(path, device='cuda')",
    "fastsafetensors_rs.load([path], device='cuda:0', dtype=torch.float16)",
    "fastsafetensors_rs.load_file(path, device=0, nogds=False)",
    "fastsafetensors_rs.safe_open(path, device='cuda').get_tensor('w')",
    "torch.ops.fastsafetensors.load([path], 'cuda', None, None, True)",
    "fastsafetensors_rs.load([], device='cuda:1')",
    "fastsafetensors_rs.load_file(path, device='cuda', tensor_filter='w')",
    "list(fastsafetensors_rs.stream(path, device='cuda'))",
    "list(fastsafetensors_rs.safe_open([path], device='cuda:0').tensors())",
    "list(fastsafetensors_rs.weights_iterator([path], device='cuda', tensor_filter='w'))",
]


@pytest.mark.parametrize("call", CALLS)
def test_cuda_without_a_driver_is_a_clear_error(tmp_path, call):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    script = textwrap.dedent(f"""
        import time, torch, fastsafetensors_rs
        path = {str(path)!r}
        start = time.monotonic()
        try:
            {call}
        except RuntimeError as e:
            print("ERROR:", e)
            print("SECONDS:", time.monotonic() - start)
        else:
            print("NO ERROR")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "NO ERROR" not in done.stdout
    assert "cannot load to cuda" in done.stdout and "CUDA" in done.stdout, done.stdout
    seconds = float(done.stdout.split("SECONDS:")[1])
    assert seconds < 1.0, f"took {seconds:.2f}s to fail"


def test_unknown_device_is_rejected(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    import fastsafetensors_rs

    with pytest.raises(ValueError, match="only cpu and cuda"):  # an argument error, in one line
        fastsafetensors_rs.load_file(path, device="meta")


def test_releasing_staging_memory_needs_no_driver():
    # Nothing was kept: nothing to free, and the driver is never asked.
    script = "import fastsafetensors_rs; print(fastsafetensors_rs.release_staging_buffers())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
