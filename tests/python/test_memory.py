"""The memory model: tensors own (or share ownership of) their memory, so they outlive the
dict, handle and file that produced them, and everything is released once they are gone."""

from __future__ import annotations

import gc
import json
import os
import struct
import weakref

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs
import fst_testutils as U

ops = torch.ops.fastsafetensors

MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------- lifetimes


@pytest.mark.parametrize("reader", U.READERS)
def test_tensors_outlive_the_dict(medium_file, reader):
    path, written = medium_file
    got = U.op_load([str(path)], "cpu", None, reader)
    keep = got["b.weight"]
    scalar = got["d.scalar"]
    del got
    gc.collect()
    # Allocate and free to reuse any memory that was wrongly released.
    junk = [torch.full((1 << 18,), 7, dtype=torch.int64) for _ in range(16)]
    del junk
    U.assert_same_tensor(keep, written["b.weight"], "b.weight")
    U.assert_same_tensor(scalar, written["d.scalar"], "d.scalar")
    assert torch.equal(keep.sum(dim=0), written["b.weight"].sum(dim=0))


@pytest.mark.parametrize("reader", U.READERS)
def test_views_outlive_their_base(medium_file, reader):
    path, written = medium_file
    view = U.op_load([str(path)], "cpu", None, reader)["a.weight"][100:200, 5:9]
    gc.collect()
    U.assert_same_tensor(view, written["a.weight"][100:200, 5:9])


def test_safe_open_tensors_outlive_the_handle(medium_file):
    path, written = medium_file
    f = fastsafetensors_rs.safe_open(path)
    ref = weakref.ref(f) if _weakrefable(f) else None
    tensors = {name: f.get_tensor(name) for name in f.keys()}
    part = f.get_slice("a.weight")[3:7]
    f.close()
    del f
    gc.collect()
    if ref is not None:
        assert ref() is None, "the handle should be collectable once closed and deleted"
    U.assert_same_dict(tensors, written)
    U.assert_same_tensor(part, written["a.weight"][3:7])


def _weakrefable(obj) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


@pytest.mark.parametrize("reader", U.READERS)
def test_tensors_outlive_the_file(tmp_path, reader):
    """Deleting (or replacing) the checkpoint after loading does not change the tensors."""
    tensors = {"w": U.random_tensor(torch.float32, (256, 256), 5), "i": U.random_tensor(torch.int32, (99,), 6)}
    path = U.write_checkpoint(tmp_path / "gone.safetensors", tensors)
    U.make_warm(path)
    got = U.op_load([str(path)], "cpu", None, reader)
    os.unlink(path)
    U.write_checkpoint(tmp_path / "gone.safetensors", {"w": torch.zeros(256, 256), "i": torch.zeros(99, dtype=torch.int32)})
    gc.collect()
    U.assert_same_dict(got, tensors)


def test_dict_and_tensors_are_garbage_collected(medium_file):
    """Loaded tensors hold no reference cycle that keeps them alive."""
    path, _ = medium_file
    got = U.op_load([str(path)], "cpu", None, "direct")
    refs = [weakref.ref(t) for t in got.values()]
    del got
    assert all(r() is None for r in refs)


# ---------------------------------------------------------------- RSS over repeated loads

N_LOADS = 20
TENSOR_BYTES = 64 * MiB


def _write_gib_checkpoint(path):
    """Writes a ~1 GiB checkpoint tensor by tensor (no 1 GiB buffer in this process):
    16 large tensors of 64 MiB minus a little (bf16 and f32), and some small ones, each
    filled with its own constant so a load can be checked cheaply."""
    specs = []  # (name, dtype, shape, fill)
    small = [(f"layers.{i}.norm.weight", torch.float32, (4096,), float(i + 1)) for i in range(16)]
    for i in range(16):
        if i % 2:
            specs.append((f"layers.{i}.mlp.weight", torch.float32, (4095, 4096), float(i) + 0.5))
        else:
            specs.append((f"layers.{i}.attn.weight", torch.bfloat16, (8191, 4096), float(i) + 0.25))
        specs.append(small[i])
    header = {}
    pos = 0
    for name, dt, shape, _ in specs:
        n = dt.itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": U.DTYPE_NAME[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    hb = U.header_bytes(header)
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for name, dt, shape, fill in specs:
            t = torch.full(shape, fill, dtype=dt)
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t
    expected = {name: (str(dt), list(shape), fill) for name, dt, shape, fill in specs}
    return pos + 8 + len(hb), expected


@pytest.fixture(scope="session")
def gib_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("gib")
    path = d / "model-1gib.safetensors"
    size, expected = _write_gib_checkpoint(path)
    assert size > GiB - 16 * MiB
    meta = d / "expected.json"
    meta.write_text(json.dumps(expected))
    yield path, size, meta
    path.unlink()  # do not leave 1 GiB behind in the kept pytest temp dirs


RSS_SCRIPT = r"""
import gc, json, sys, torch, psutil, fastsafetensors_rs
path, reader, n, expected_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
expected = json.loads(open(expected_path).read())
ops = torch.ops.fastsafetensors
proc = psutil.Process()
PAGE = 4096

def rss():
    return proc.memory_info().rss

def touch(tensors):
    # Reads one byte of every page, so mapped tensors are faulted in as well.
    total = 0
    for t in tensors.values():
        total += int(t.reshape(-1).view(torch.uint8)[::PAGE].sum())
    return total

def check(tensors):
    assert sorted(tensors) == sorted(expected), sorted(tensors)
    for name, (dtype, shape, fill) in expected.items():
        t = tensors[name]
        assert str(t.dtype) == dtype and list(t.shape) == shape, (name, t.dtype, t.shape)
        flat = t.reshape(-1)
        for i in (0, flat.numel() // 2, flat.numel() - 1):
            assert flat[i].item() == fill, (name, i, flat[i].item(), fill)

# Warm up torch's own kernels and thread pools before taking the baseline.
touch({"w": torch.zeros(1 << 16, dtype=torch.uint8)})
gc.collect()
baseline = rss()
loaded, released, paths = [], [], set()
for _ in range(n):
    names, loaded_tensors, report = ops.load_with_report([path], "cpu", None, reader)
    tensors = dict(zip(names, loaded_tensors))
    del loaded_tensors
    paths.update(report)
    touch(tensors)
    check(tensors)
    loaded.append(rss() - baseline)
    del tensors
    gc.collect()
    released.append(rss() - baseline)
print(json.dumps({"loaded": loaded, "released": released, "paths": sorted(paths)}))
"""


@pytest.mark.parametrize("reader, read_path", [("direct", "direct"), ("mmap", "mmap")])
def test_rss_returns_to_baseline_after_repeated_loads(gib_checkpoint, reader, read_path):
    path, size, expected = gib_checkpoint
    if reader == "mmap":
        U.make_warm(path)
    proc = U.run_python(RSS_SCRIPT, path, reader, N_LOADS, expected, timeout=600)
    out = U.check_output(proc)
    result = json.loads(out.strip().splitlines()[-1])
    loaded, released = result["loaded"], result["released"]
    assert len(loaded) == len(released) == N_LOADS
    assert result["paths"] == [read_path]
    mb = [round(x / MiB) for x in released]
    # While the checkpoint is loaded (and touched) it is resident ...
    assert min(loaded) > 0.8 * size, f"RSS rose by only {[round(x / MiB) for x in loaded]} MiB"
    # ... and once it is dropped the memory goes back, every time.
    assert released[-1] < 150 * MiB, f"RSS above baseline after each release (MiB): {mb}"
    assert max(released) < 150 * MiB, f"RSS above baseline after each release (MiB): {mb}"


def test_gib_checkpoint_is_valid(gib_checkpoint):
    """The generated checkpoint is a valid safetensors file (guards the RSS test)."""
    from safetensors import safe_open

    path, size, expected = gib_checkpoint
    assert path.stat().st_size == size
    want = json.loads(expected.read_text())
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(want)
        t = f.get_tensor("layers.15.norm.weight")
        assert t.dtype == torch.float32 and bool((t == 16.0).all())
