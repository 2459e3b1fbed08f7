"""What a loaded tensor keeps alive, and what is refused before anything is read.

A file is read into one buffer and its tensors are views of it. Once `dtype=` has cast one of
a file's tensors, the others are copied out, so that the buffer is freed instead of staying
alive beside the cast copies for a few small uncast tensors. The same rule holds on CUDA
(tests/gpu/gpu_check.py checks it there)."""

from __future__ import annotations

import pytest
import torch

import fastsafetensors_rs
import fst_testutils as U

MiB = 1 << 20


@pytest.fixture
def fp32_with_an_integer(tmp_path):
    """64 MiB of float32 and a small int32 tensor that a bfloat16 cast leaves alone."""
    tensors = {"w": U.finite_tensor(torch.float32, (16 * MiB,)), "steps": torch.arange(10, dtype=torch.int32)}
    return U.write_checkpoint(tmp_path / "m.safetensors", tensors), tensors


GROWTH = """
    import gc, sys, psutil, torch, fastsafetensors_rs
    path, reader, cast = sys.argv[1], sys.argv[2], sys.argv[3] == "cast"
    dtype = torch.bfloat16 if cast else None
    process = psutil.Process()
    fastsafetensors_rs.load_file(path, dtype=dtype, reader=reader)  # warms the allocators up
    gc.collect()
    before = process.memory_info().rss
    tensors = fastsafetensors_rs.load_file(path, dtype=dtype, reader=reader)
    gc.collect()
    print((process.memory_info().rss - before) // (1 << 20))
    print(tensors["w"].dtype, tensors["steps"].tolist())
"""


def rss_growth_mib(path, reader: str, cast: bool) -> tuple[int, str]:
    out = U.check_output(U.run_python(GROWTH, path, reader, "cast" if cast else "keep")).split("\n")
    return int(out[0]), out[1]


def test_a_cast_frees_the_files_buffer(fp32_with_an_integer):
    path, _ = fp32_with_an_integer
    growth, seen = rss_growth_mib(path, "direct", cast=True)
    assert seen == "torch.bfloat16 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"
    # 32 MiB of bfloat16; the 64 MiB read buffer must be gone, not kept for "steps".
    assert growth < 48, f"resident memory grew by {growth} MiB for 32 MiB of tensors"


def test_without_a_cast_every_tensor_is_a_view_of_the_one_buffer(fp32_with_an_integer):
    path, _ = fp32_with_an_integer
    growth, seen = rss_growth_mib(path, "direct", cast=False)
    assert seen == "torch.float32 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"
    assert 56 <= growth < 80, f"resident memory grew by {growth} MiB for a 64 MiB file"


@pytest.mark.parametrize("reader", U.READERS)
def test_cast_and_copied_out_tensors_are_exact(fp32_with_an_integer, reader):
    path, written = fp32_with_an_integer
    got = fastsafetensors_rs.load_file(path, dtype=torch.bfloat16, reader=reader)
    U.assert_same_tensor(got["w"], written["w"].to(torch.bfloat16), "w")
    U.assert_same_tensor(got["steps"], written["steps"], "steps")


def test_an_unsupported_dtype_is_refused_before_reading(tmp_path, monkeypatch):
    # F6_E2M3 is valid safetensors that torch has no dtype for. The memory cap would refuse
    # the read: the dtype error must come first, before any memory is allocated or read.
    header = {"x": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}
    path = U.write_raw(tmp_path / "f6.safetensors", header, b"\x01\x02\x03")
    monkeypatch.setenv("FASTSAFETENSORS_MAX_HOST_MEMORY", "1")
    with pytest.raises(RuntimeError, match="dtype F6_E2M3 has no torch equivalent"):
        fastsafetensors_rs.load_file(path, reader="direct")
