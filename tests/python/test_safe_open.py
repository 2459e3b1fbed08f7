"""fastsafetensors_rs.safe_open against safetensors' own safe_open on the same files."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs
from safetensors.torch import save_file
import fst_testutils as U

safe_open = fastsafetensors_rs.safe_open


def test_keys_match(all_dtypes_file):
    path, written = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        keys = f.keys()
        assert isinstance(keys, list)
        assert keys == sorted(ref.keys()) == sorted(written)


def test_metadata_match(all_dtypes_file, tmp_path):
    path, _ = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        assert f.metadata() == ref.metadata() == {"format": "pt", "note": "all dtypes"}
    bare = U.write_checkpoint(tmp_path / "bare.safetensors", {"x": torch.ones(3)})
    with st_safe_open(str(bare), "pt") as ref, safe_open(bare) as f:
        assert ref.metadata() is None
        assert f.metadata() is None


def test_metadata_null_is_none(tmp_path):
    header, data, _ = U.layout([("x", torch.arange(4, dtype=torch.int32))])
    header["__metadata__"] = None
    path = U.write_raw(tmp_path / "null_meta.safetensors", header, data)
    with safe_open(path) as f:
        assert f.metadata() is None
        U.assert_same_tensor(f.get_tensor("x"), torch.arange(4, dtype=torch.int32), "x")


def test_get_tensor_every_dtype(all_dtypes_file):
    path, written = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, safe_open(path, framework="pt", device="cpu") as f:
        for name in ref.keys():
            U.assert_same_tensor(f.get_tensor(name), ref.get_tensor(name), name)
            U.assert_same_tensor(f.get_tensor(name), written[name], name)


def test_get_tensor_again_returns_the_same_tensor(all_dtypes_file):
    """As the README and docs/integrations.md say (safetensors reads a fresh tensor each time)."""
    path, written = all_dtypes_file
    with safe_open(path) as f:
        first = f.get_tensor("float32.matrix")
        assert f.get_tensor("float32.matrix") is first
    with st_safe_open(str(path), "pt") as ref:
        assert ref.get_tensor("float32.matrix") is not ref.get_tensor("float32.matrix")


def test_get_slice_shape_and_dtype(all_dtypes_file):
    path, _ = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        for name in ref.keys():
            want, got = ref.get_slice(name), f.get_slice(name)
            shape = got.get_shape()
            assert isinstance(shape, list) and all(type(d) is int for d in shape), (name, shape)
            assert shape == want.get_shape(), name
            assert got.get_dtype() == want.get_dtype(), name
    # The dtype strings are safetensors' own names.
    with safe_open(path) as f:
        for dt, st_name in U.DTYPES:
            assert f.get_slice(f"{U.dtype_id(dt)}.matrix").get_dtype() == st_name


def test_get_slice_packed_fp4_shape_counts_fp4_values(all_dtypes_file):
    """F4 shapes on disk count 4-bit values: a (5, 7) float4_e2m1fn_x2 tensor is [5, 14]."""
    path, _ = all_dtypes_file
    with safe_open(path) as f:
        sl = f.get_slice("float4_e2m1fn_x2.matrix")
        assert sl.get_shape() == [5, 14]
        assert sl.get_dtype() == "F4"
        t = f.get_tensor("float4_e2m1fn_x2.matrix")
        assert t.dtype == torch.float4_e2m1fn_x2 and tuple(t.shape) == (5, 7)


INDEXES_2D = {
    "rows_0_2": slice(0, 2),
    "cols_1_3": (slice(None), slice(1, 3)),
    "row_1": 1,
    "rows_1_3_col_0": (slice(1, 3), 0),
    "ellipsis": Ellipsis,
    "all": slice(None),
    "last_two_rows": slice(-2, None),
    "last_row": -1,
    "element": (1, 2),
    "empty_range": slice(3, 1),
    "ellipsis_col": (Ellipsis, 1),
    "every_other_col": (slice(None), slice(None, None, 2)),
}
INDEXES_3D = {
    "first": 0,
    "inner_cols": (slice(None), slice(None), slice(1, 3)),
    "plane_0_cols": (0, slice(1, 3)),
    "middle": (slice(None), 1),
    "block": (slice(0, 1), slice(1, 3), slice(0, 2)),
}
SLICE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                torch.int8, torch.uint16, torch.bool, torch.complex64, torch.float8_e4m3fn,
                torch.float8_e8m0fnu]


@pytest.mark.parametrize("dt", SLICE_DTYPES, ids=U.dtype_id)
@pytest.mark.parametrize("index", list(INDEXES_2D), ids=str)
def test_get_slice_matches_safetensors_2d(all_dtypes_file, dt, index):
    path, written = all_dtypes_file
    name = f"{U.dtype_id(dt)}.matrix"
    idx = INDEXES_2D[index]
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        want = ref.get_slice(name)[idx]
        got = f.get_slice(name)[idx]
    U.assert_same_tensor(got, want, f"{name}[{index}]")
    U.assert_same_tensor(got, written[name][idx], f"{name}[{index}]")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.int16, torch.float8_e5m2],
                         ids=U.dtype_id)
@pytest.mark.parametrize("index", list(INDEXES_3D), ids=str)
def test_get_slice_matches_safetensors_3d(all_dtypes_file, dt, index):
    path, written = all_dtypes_file
    name = f"{U.dtype_id(dt)}.cube"
    idx = INDEXES_3D[index]
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        want = ref.get_slice(name)[idx]
        got = f.get_slice(name)[idx]
    U.assert_same_tensor(got, want, f"{name}[{index}]")
    U.assert_same_tensor(got, written[name][idx], f"{name}[{index}]")


def test_get_slice_of_scalar_and_empty(all_dtypes_file):
    path, _ = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        for name in ("float32.scalar", "int64.scalar", "bfloat16.empty", "int32.empty2d"):
            assert f.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
        U.assert_same_tensor(f.get_slice("bfloat16.empty2d")[:, :], ref.get_slice("bfloat16.empty2d")[:, :])
        U.assert_same_tensor(f.get_slice("int32.empty")[0:0], ref.get_slice("int32.empty")[0:0])


def test_slice_bytes_come_from_the_right_tensor(tmp_path):
    """Slices of a tensor in the middle of the data section use that tensor's offset."""
    tensors = {
        "a": torch.arange(10, dtype=torch.int64),
        "b": torch.arange(100, 160, dtype=torch.float32).reshape(6, 10),
        "c": torch.arange(7, dtype=torch.int16),
    }
    path = U.write_checkpoint(tmp_path / "mid.safetensors", tensors)
    with safe_open(path) as f:
        sl = f.get_slice("b")
        assert torch.equal(sl[2:4], tensors["b"][2:4])
        assert torch.equal(sl[:, 7:], tensors["b"][:, 7:])
        assert torch.equal(sl[5], tensors["b"][5])
        assert sl[5, 9].item() == 159.0


def test_context_manager_returns_a_handle(all_dtypes_file):
    path, written = all_dtypes_file
    with safe_open(path) as f:
        assert f is not None
        t = f.get_tensor("float32.matrix")
    U.assert_same_tensor(t, written["float32.matrix"])


def test_pathlike_and_str_paths(all_dtypes_file):
    path, written = all_dtypes_file
    for p in (str(path), Path(path)):
        with safe_open(p, framework="pt", device="cpu") as f:
            U.assert_same_tensor(f.get_tensor("int64.cube"), written["int64.cube"])


def test_tensors_valid_after_close(all_dtypes_file):
    path, written = all_dtypes_file
    f = safe_open(path)
    tensors = {name: f.get_tensor(name) for name in f.keys()}
    sliced = f.get_slice("float32.matrix")[1:3]
    f.close()
    del f
    gc.collect()
    U.assert_same_dict(tensors, written)
    U.assert_same_tensor(sliced, written["float32.matrix"][1:3])
    # Still usable for arithmetic after the handle is gone.
    assert torch.equal(tensors["int64.matrix"] - tensors["int64.matrix"], torch.zeros(5, 7, dtype=torch.int64))


def test_tensors_valid_after_context_exit_and_gc(all_dtypes_file):
    path, written = all_dtypes_file
    with safe_open(path) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        sl = f.get_slice("bfloat16.cube")
        part = sl[:, 1:3]
    del f, sl
    gc.collect()
    U.assert_same_dict(tensors, written)
    U.assert_same_tensor(part, written["bfloat16.cube"][:, 1:3])


@pytest.mark.parametrize("method", ["get_tensor", "get_slice"])
def test_missing_name_raises_naming_it(all_dtypes_file, method):
    path, _ = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref:
        with pytest.raises(Exception, match="no_such_tensor"):
            getattr(ref, method)("no_such_tensor")
    with safe_open(path) as f:
        with pytest.raises((KeyError, RuntimeError)) as info:
            getattr(f, method)("no_such_tensor")
        assert "no_such_tensor" in str(info.value)
        # The handle keeps working after the error.
        assert f.get_tensor("float32.scalar").dim() == 0


def test_empty_checkpoint(tmp_path):
    path = U.write_raw(tmp_path / "empty.safetensors", b"{}")
    with safe_open(path) as f:
        assert f.keys() == []
        assert f.metadata() is None


def test_safe_open_does_not_cast_or_rename(multi_file_model):
    paths, shards = multi_file_model
    for p, shard in zip(paths, shards):
        with safe_open(p) as f:
            assert f.keys() == sorted(shard)
            for name, t in shard.items():
                U.assert_same_tensor(f.get_tensor(name), t, name)
            assert f.metadata()["format"] == "pt"


def test_first_access_from_many_threads_loads_once(tmp_path, monkeypatch):
    import threading

    import fastsafetensors_rs.api as api

    path = tmp_path / "threads.safetensors"
    save_file({f"w{i}": torch.full((64,), float(i)) for i in range(16)}, str(path))
    calls = []
    real_open = api._open_stream
    monkeypatch.setattr(api, "_open_stream", lambda *a, **k: calls.append(1) or real_open(*a, **k))
    handle = fastsafetensors_rs.safe_open(path)
    results = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, handle.get_tensor(n))) for n in handle.keys()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, f"the file was loaded {len(calls)} times"
    assert all(torch.equal(results[f"w{i}"], torch.full((64,), float(i))) for i in range(16))


def test_get_tensor_after_close_raises(tmp_path):
    path = tmp_path / "closed.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    handle = fastsafetensors_rs.safe_open(path)
    kept = handle.get_tensor("w")
    handle.close()
    with pytest.raises(RuntimeError, match="closed"):
        handle.get_tensor("w")
    assert torch.equal(kept, torch.ones(3))


# ------------------------------------------------------------------ the handle keeps its files

READERS = ["auto", "direct", "mmap"]


def _original_and_replacement(tmp_path):
    """A file holding `a`, `b`, and a replacement beside it holding another `a` (another shape)
    and `c`: what a download that replaces the file (os.replace) leaves behind."""
    original = {"a": U.random_tensor(torch.float32, (6, 5), 1), "b": U.random_tensor(torch.bfloat16, (4, 3), 2)}
    replacement = {"a": U.random_tensor(torch.float32, (3, 7), 3), "c": U.random_tensor(torch.int64, (9,), 4)}
    path = U.write_checkpoint(tmp_path / "model.safetensors", original)
    new = U.write_checkpoint(tmp_path / "model.safetensors.incoming", replacement)
    return path, new, original


def _check_reads_original(f, original):
    """Every way of asking a handle answers from the file it opened, bit-exact."""
    assert f.keys() == sorted(original)
    assert f.get_slice("a").get_shape() == list(original["a"].shape)
    U.assert_same_tensor(f.get_slice("a")[0:2], original["a"][0:2], "a[0:2]")
    U.assert_same_tensor(f.get_slice("b")[1:3, 1:], original["b"][1:3, 1:], "b[1:3, 1:]")
    U.assert_same_dict(dict(f.tensors()), original)
    U.assert_same_tensor(f.get_tensor("a"), original["a"], "a")
    U.assert_same_tensor(f.get_tensor("b"), original["b"], "b")


@pytest.mark.parametrize("reader", READERS)
def test_replaced_file_keeps_answering_from_the_opened_file(tmp_path, reader):
    """os.replace over an open file (what the Hub client does) changes nothing for the handle,
    as with safetensors, which keeps reading what it opened."""
    path, new, original = _original_and_replacement(tmp_path)
    with safe_open(path, reader=reader) as f, st_safe_open(str(path), "pt") as ref:
        os.replace(new, path)
        _check_reads_original(f, original)
        U.assert_same_tensor(ref.get_slice("a")[0:2], original["a"][0:2], "safetensors a[0:2]")
    with safe_open(path, reader=reader) as f:
        assert f.keys() == ["a", "c"], "a new handle opens the new file"


@pytest.mark.parametrize("reader", READERS)
def test_replaced_file_among_several_keeps_its_tensors(tmp_path, reader):
    path, new, original = _original_and_replacement(tmp_path)
    other = U.write_checkpoint(tmp_path / "other.safetensors", {"z": torch.arange(6.0)})
    with safe_open([other, path], reader=reader) as f:
        os.replace(new, path)
        assert f.keys() == ["a", "b", "z"]
        U.assert_same_tensor(f.get_slice("a")[2:4], original["a"][2:4], "a[2:4]")
        U.assert_same_tensor(f.get_tensor("b"), original["b"], "b")
        U.assert_same_dict(dict(f.tensors()), {**original, "z": torch.arange(6.0)})


@pytest.mark.parametrize("reader", READERS)
def test_deleted_file_still_reads(tmp_path, reader):
    path, _, original = _original_and_replacement(tmp_path)
    with safe_open(path, reader=reader) as f:
        os.unlink(path)
        _check_reads_original(f, original)


def _truncate(path, replacement):
    os.truncate(path, os.path.getsize(path) - 16)


def _rewrite(path, replacement):
    """Another checkpoint written over the same inode."""
    data = Path(replacement).read_bytes()
    with open(path, "r+b") as out:
        out.write(data)
        out.truncate()


@pytest.mark.parametrize("change", [_truncate, _rewrite], ids=["truncated", "rewritten"])
@pytest.mark.parametrize("reader", READERS)
def test_file_changed_in_place_is_an_error_naming_it(tmp_path, reader, change):
    """Bytes written into the opened file itself (same inode) would mix two versions: every read
    after the change fails with an error in one line naming the file."""
    path, new, _ = _original_and_replacement(tmp_path)
    with safe_open(path, reader=reader) as f:
        inode, size = os.stat(path).st_ino, os.stat(path).st_size
        change(path, new)
        assert os.stat(path).st_ino == inode and os.stat(path).st_size != size
        reads = {
            "get_slice": lambda: f.get_slice("a")[0:2],
            "get_tensor": lambda: f.get_tensor("b"),
            "tensors": lambda: dict(f.tensors()),
        }
        for what, read in reads.items():
            with pytest.raises(RuntimeError) as info:
                read()
            message = str(info.value)
            assert str(path) in message and "/proc/" not in message, (what, message)
            assert "changed" in message or "ended" in message, (what, message)
            assert "\n" not in message.strip(), (what, message)
        assert f.get_slice("a").get_shape() == [6, 5], "what the handle knows stays as opened"


def _fds_on(path) -> int:
    """How many of this process's file descriptors are open on `path`."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == os.path.realpath(path))


def test_handle_holds_its_file_until_closed_or_dropped(tmp_path):
    path, _, _ = _original_and_replacement(tmp_path)
    f = safe_open(path)
    assert _fds_on(path) >= 1, "the handle holds the file it opened"
    f.close()
    assert _fds_on(path) == 0, "close() lets go of it"
    f = safe_open(path)
    del f
    gc.collect()
    assert _fds_on(path) == 0, "so does dropping the handle"
    f = safe_open(path)
    kept = f.get_tensor("a")
    del f
    assert _fds_on(path) == 0, "at once, with no cycle for the garbage collector to find"
    assert kept.shape == (6, 5)
    with safe_open(path) as f:
        part = f.get_slice("a")[0:2]
    assert _fds_on(path) == 0, "and leaving the with block"
    assert part.shape == (2, 5)


# ------------------------------------------------------------------ safetensors 0.8: backend=, get_tensors()

import safetensors  # noqa: E402


@pytest.mark.parametrize("backend, reader", [("mmap", "mmap"), ("pread", "direct")])
def test_backend_takes_safetensors_values_and_reads_with_the_matching_reader(all_dtypes_file, monkeypatch, backend,
                                                                             reader):
    """`backend=` (safetensors 0.8) is accepted by load_file and safe_open, and picks the reader
    that reads the same way."""
    from fastsafetensors_rs import api

    path, written = all_dtypes_file
    readers = []
    real = api._load

    def spy(paths, device, dtype, reader_, *rest):
        readers.append(reader_)
        return real(paths, device, dtype, reader_, *rest)

    monkeypatch.setattr(api, "_load", spy)
    U.assert_same_dict(fastsafetensors_rs.load_file(path, backend=backend), written)
    with safe_open(path, "pt", "cpu", backend=backend) as f:
        assert f._reader == reader
        U.assert_same_dict(f.get_tensors(), written)
    assert readers == [reader, reader]
    # The same reader asked for twice is no conflict.
    assert fastsafetensors_rs.load_file(path, reader=reader, backend=backend).keys() == written.keys()


@pytest.mark.parametrize("backend", ["direct", "auto", "MMAP", ""])
def test_an_unknown_backend_is_refused_as_safetensors_refuses_it(all_dtypes_file, backend):
    path, _ = all_dtypes_file
    with pytest.raises(safetensors.SafetensorError) as theirs:
        st_load_file(str(path), backend=backend)
    for call in (lambda: fastsafetensors_rs.load_file(path, backend=backend),
                 lambda: safe_open(path, backend=backend)):
        with pytest.raises(safetensors.SafetensorError) as ours:
            call()
        assert isinstance(ours.value, ValueError), "an argument refused, as the package's others are"
        assert str(ours.value).startswith(str(theirs.value).rstrip(")")), (str(ours.value), str(theirs.value))


def test_backend_of_another_type_or_disagreeing_with_reader_is_refused(all_dtypes_file):
    path, _ = all_dtypes_file
    with pytest.raises(TypeError, match="backend must be a string"):
        fastsafetensors_rs.load_file(path, backend=1)
    with pytest.raises(ValueError, match=r"reader='mmap' and backend='pread' \(reader='direct'\) disagree"):
        safe_open(path, reader="mmap", backend="pread")


def test_get_tensors_is_every_tensor_in_offset_order(all_dtypes_file):
    path, written = all_dtypes_file
    with st_safe_open(str(path), "pt") as ref, safe_open(path) as f:
        theirs, ours = ref.get_tensors(), f.get_tensors()
        assert isinstance(ours, dict)
        assert list(ours) == f.offset_keys()
        # The same order as safetensors' but among empty tensors (several at one offset, which
        # safetensors orders otherwise).
        assert [k for k in ours if ours[k].numel()] == [k for k in theirs if theirs[k].numel()]
        U.assert_same_dict(ours, theirs)
        again = f.get_tensors()
        assert again["float32.cube"] is not ours["float32.cube"], "each call gives the caller its own tensors"
        assert f.get_tensor("float32.cube") is not ours["float32.cube"], "independent of get_tensor"


def test_get_tensors_of_several_files_and_a_filter(multi_file_model):
    paths, shards = multi_file_model
    with safe_open(paths, tensor_filter="*.weight") as f:
        got = f.get_tensors()
        want = {k: t for shard in shards for k, t in shard.items() if k.endswith(".weight")}
        assert list(got) == f.offset_keys()
        U.assert_same_dict(got, want)


CLOSED_CALLS = {
    "keys": lambda f: f.keys(),
    "offset_keys": lambda f: f.offset_keys(),
    "metadata": lambda f: f.metadata(),
    "get_tensor": lambda f: f.get_tensor("w"),
    "get_tensor_unknown": lambda f: f.get_tensor("no_such_tensor"),
    "get_tensors": lambda f: f.get_tensors(),
    "get_slice": lambda f: f.get_slice("w"),
    "tensors": lambda f: f.tensors(),
}


@pytest.mark.parametrize("how", ["close", "with"])
@pytest.mark.parametrize("call", list(CLOSED_CALLS))
def test_every_method_of_a_closed_handle_raises_one_error(tmp_path, how, call):
    """As safetensors' ("File is closed"): after close() or the with block, nothing answers
    from what the handle knew. The error is a safetensors.SafetensorError too."""
    path = U.write_checkpoint(tmp_path / "w.safetensors", {"w": torch.ones(3)}, metadata={"k": "v"})
    if how == "close":
        f = safe_open(path)
        f.close()
    else:
        with safe_open(path) as f:
            pass
    with pytest.raises(fastsafetensors_rs.SafetensorError) as info:
        CLOSED_CALLS[call](f)
    assert isinstance(info.value, safetensors.SafetensorError) and isinstance(info.value, RuntimeError)
    assert str(info.value) == f"{path}: the safe_open handle is closed"
    f.close()  # closing again is harmless


def test_errors_of_the_safetensors_style_api_are_safetensor_errors(tmp_path):
    """Code that catches safetensors.SafetensorError around a load keeps working."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}xx")
    for call in (lambda: fastsafetensors_rs.load_file(bad), lambda: safe_open(bad),
                 lambda: list(fastsafetensors_rs.stream(bad))):
        with pytest.raises(safetensors.SafetensorError, match=f"{bad}: .*trailing"):
            call()
    path = U.write_checkpoint(tmp_path / "w.safetensors", {"w": torch.ones(3)})
    with safe_open(path) as f, pytest.raises(safetensors.SafetensorError) as info:
        f.get_tensor("missing")
    assert isinstance(info.value, KeyError), "and a KeyError, as before"
    assert str(info.value) == f"{path}: no tensor named 'missing'"
