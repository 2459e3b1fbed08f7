"""Bit-exact loading of every dtype, read-path selection, dtype casting and alignment."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs
import fst_testutils as U

ops = torch.ops.fastsafetensors


def load_report(files, reader=None, dtype=None):
    tensors, paths = U.op_load_with_report([str(f) for f in files], "cpu", dtype, reader)
    assert isinstance(paths, list) and len(paths) == len(files), paths
    assert set(paths) <= U.READ_PATHS, paths
    return tensors, paths


# ---------------------------------------------------------------- every dtype


def test_reference_fixture_is_what_was_written(all_dtypes_file):
    """The all-dtypes fixture round-trips through safetensors itself (guards the fixture)."""
    path, written = all_dtypes_file
    U.assert_same_dict(st_load_file(str(path)), written)
    assert {t.dtype for t in written.values()} == {dt for dt, _ in U.DTYPES}


@pytest.mark.parametrize("reader", U.READERS)
def test_all_dtypes_bit_exact(all_dtypes_file, reader):
    path, written = all_dtypes_file
    expected = st_load_file(str(path))
    got = U.op_load([str(path)], "cpu", None, reader)
    U.assert_same_dict(got, expected)
    U.assert_same_dict(got, written)


@pytest.mark.parametrize("reader", U.READERS)
def test_load_with_report_returns_same_tensors(all_dtypes_file, reader):
    path, written = all_dtypes_file
    got, paths = load_report([path], reader)
    U.assert_same_dict(got, written)


@pytest.mark.parametrize("reader", U.READERS)
@pytest.mark.parametrize("dt", [dt for dt, _ in U.DTYPES], ids=U.dtype_id)
def test_each_dtype_alone(tmp_path, dt, reader):
    """A file holding a single dtype, so each dtype also starts the data section."""
    tensors = {"x": U.random_tensor(dt, (3, 5), 7), "y": U.random_tensor(dt, (1,), 8)}
    path = U.write_checkpoint(tmp_path / "one.safetensors", tensors)
    got = fastsafetensors_rs.load_file(str(path), reader=reader)
    U.assert_same_dict(got, st_load_file(str(path)))


@pytest.mark.parametrize("reader", U.READERS)
def test_load_file_accepts_str_and_pathlike(all_dtypes_file, reader):
    path, written = all_dtypes_file
    U.assert_same_dict(fastsafetensors_rs.load_file(str(path), reader=reader), written)
    U.assert_same_dict(fastsafetensors_rs.load_file(Path(path), device="cpu", reader=reader), written)


def test_load_file_defaults(all_dtypes_file):
    path, written = all_dtypes_file
    U.assert_same_dict(fastsafetensors_rs.load_file(path), written)
    U.assert_same_dict(U.op_load([str(path)]), written)


@pytest.mark.parametrize("reader", U.READERS)
def test_readers_agree_on_a_larger_file(medium_file, reader):
    path, written = medium_file
    U.assert_same_dict(fastsafetensors_rs.load_file(path, reader=reader), written)


# ---------------------------------------------------------------- zero-sized and scalar


@pytest.mark.parametrize("reader", U.READERS)
def test_zero_sized_and_scalar_tensors(tmp_path, reader):
    tensors = {
        "f32.empty": torch.empty(0, dtype=torch.float32),
        "bf16.empty2d": torch.empty(3, 0, dtype=torch.bfloat16),
        "i64.empty3d": torch.empty(0, 4, 2, dtype=torch.int64),
        "f64.scalar": torch.tensor(-2.5, dtype=torch.float64),
        "i8.scalar": torch.tensor(-7, dtype=torch.int8),
        "bool.scalar": torch.tensor(True),
        "u16.scalar": torch.tensor(65535, dtype=torch.uint16),
        "f8.scalar": torch.tensor(0.5).to(torch.float8_e4m3fn),
        "c64.scalar": torch.tensor(1 + 2j, dtype=torch.complex64),
        "f32.vector": torch.arange(5, dtype=torch.float32),
    }
    path = U.write_checkpoint(tmp_path / "edge.safetensors", tensors)
    got = U.op_load([str(path)], "cpu", None, reader)
    U.assert_same_dict(got, st_load_file(str(path)))
    U.assert_same_dict(got, tensors)
    assert got["f32.empty"].shape == (0,)
    assert got["bf16.empty2d"].shape == (3, 0)
    assert got["f64.scalar"].dim() == 0 and got["f64.scalar"].item() == -2.5
    assert got["u16.scalar"].item() == 65535
    assert got["c64.scalar"].item() == 1 + 2j


@pytest.mark.parametrize("reader", U.READERS)
def test_file_with_only_zero_sized_tensors(tmp_path, reader):
    """The data section is empty: nothing to map or read."""
    tensors = {"a": torch.empty(0, dtype=torch.float32), "b": torch.empty(2, 0, dtype=torch.int32)}
    path = U.write_checkpoint(tmp_path / "empty_data.safetensors", tensors)
    got, paths = load_report([path], reader)
    U.assert_same_dict(got, tensors)


# ---------------------------------------------------------------- several files


@pytest.mark.parametrize("reader", U.READERS)
def test_multi_file_load(multi_file_model, reader):
    paths, shards = multi_file_model
    expected = {}
    for p, shard in zip(paths, shards):
        ref = st_load_file(str(p))
        U.assert_same_dict(ref, shard)
        expected.update(ref)
    got = U.op_load([str(p) for p in paths], "cpu", None, reader)
    U.assert_same_dict(got, expected)
    got = fastsafetensors_rs.load([str(p) for p in paths], reader=reader)
    U.assert_same_dict(got, expected)
    got, report = load_report(paths, reader)
    U.assert_same_dict(got, expected)
    assert len(report) == 3


def test_multi_file_python_load_accepts_pathlike_and_str(multi_file_model):
    paths, shards = multi_file_model
    expected = {k: v for shard in shards for k, v in shard.items()}
    U.assert_same_dict(fastsafetensors_rs.load([paths[0], str(paths[1]), paths[2]]), expected)


def test_load_of_no_files_is_empty():
    assert U.op_load([]) == {}
    tensors, paths = U.op_load_with_report([])
    assert tensors == {} and paths == []


def test_same_tensor_names_in_subsets(multi_file_model):
    """Loading a subset of shards returns exactly that subset."""
    paths, shards = multi_file_model
    got = fastsafetensors_rs.load([paths[2], paths[0]])
    U.assert_same_dict(got, {**shards[2], **shards[0]})


# ---------------------------------------------------------------- keys and metadata


def test_keys_are_sorted(all_dtypes_file):
    path, written = all_dtypes_file
    keys = ops.keys(str(path))
    assert keys == sorted(written)
    with st_safe_open(str(path), "pt") as f:
        assert keys == sorted(f.keys())


def test_metadata_present(all_dtypes_file):
    path, _ = all_dtypes_file
    assert U.op_metadata(str(path)) == {"format": "pt", "note": "all dtypes"}
    with fastsafetensors_rs.safe_open(path) as f:
        assert f.metadata() == {"format": "pt", "note": "all dtypes"}


def test_metadata_absent(tmp_path):
    path = U.write_checkpoint(tmp_path / "nometa.safetensors", {"a": torch.ones(2)})
    with st_safe_open(str(path), "pt") as f:
        assert f.metadata() is None
    assert U.op_metadata(str(path)) is None
    with fastsafetensors_rs.safe_open(path) as f:
        assert f.metadata() is None


def test_metadata_unicode_and_many_entries(tmp_path):
    meta = {f"key{i}": f"välue {i} ✓" for i in range(50)}
    meta["json"] = json.dumps({"nested": [1, 2, 3]})
    path = U.write_checkpoint(tmp_path / "meta.safetensors", {"a": torch.ones(2)}, metadata=meta)
    assert U.op_metadata(str(path)) == meta
    with fastsafetensors_rs.safe_open(path) as f:
        assert f.metadata() == meta


def test_unicode_tensor_names(tmp_path):
    tensors = {"ünïcødé.weight": torch.arange(3.0), "层.bias": torch.arange(2.0), "a b/c": torch.ones(1)}
    path = U.write_checkpoint(tmp_path / "names.safetensors", tensors)
    U.assert_same_dict(fastsafetensors_rs.load_file(path), tensors)
    assert ops.keys(str(path)) == sorted(tensors)


# ---------------------------------------------------------------- read paths


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_reader_mmap_reports_mmap(medium_file, warm):
    path, written = medium_file
    U.make_warm(path) if warm else U.make_cold(path)
    got, paths = load_report([path], "mmap")
    assert paths == ["mmap"]
    U.assert_same_dict(got, written)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_reader_direct_reports_direct(medium_file, tmp_path, warm):
    path, written = medium_file
    expected = U.expected_direct_path(tmp_path)  # "direct" on ext4, xfs, btrfs...
    U.make_warm(path) if warm else U.make_cold(path)
    got, paths = load_report([path], "direct")
    assert paths == [expected]
    U.assert_same_dict(got, written)


def test_auto_uses_mmap_for_a_warm_file(medium_file):
    path, written = medium_file
    U.make_warm(path)
    got, paths = load_report([path], "auto")
    assert paths == ["mmap"]
    U.assert_same_dict(got, written)


def test_auto_uses_direct_for_a_cold_file(medium_file, tmp_path):
    path, written = medium_file
    U.make_cold(path)
    got, paths = load_report([path], "auto")
    assert paths == [U.expected_direct_path(tmp_path)] == ["direct"]
    U.assert_same_dict(got, written)


def test_auto_is_the_default(medium_file):
    path, written = medium_file
    U.make_cold(path)
    _, paths = load_report([path], None)
    assert paths == ["direct"]
    U.make_warm(path)
    got, paths = load_report([path], None)
    assert paths == ["mmap"]
    U.assert_same_dict(got, written)


def test_auto_decides_per_file(tmp_path):
    warm_t = {"w": U.random_tensor(torch.float32, (512, 512), 1)}
    cold_t = {"c": U.random_tensor(torch.bfloat16, (1024, 1024), 2)}
    warm = U.write_checkpoint(tmp_path / "warm.safetensors", warm_t)
    cold = U.write_checkpoint(tmp_path / "cold.safetensors", cold_t)
    U.make_warm(warm)
    U.make_cold(cold)
    got, paths = load_report([warm, cold], "auto")
    assert paths == ["mmap", "direct"]
    U.assert_same_dict(got, {**warm_t, **cold_t})
    del got  # mapped pages cannot be evicted
    U.make_cold(warm)
    U.make_warm(cold)
    got, paths = load_report([warm, cold], "auto")
    assert paths == ["direct", "mmap"]
    U.assert_same_dict(got, {**warm_t, **cold_t})


def test_direct_reader_on_tmpfs():
    """/dev/shm is tmpfs: O_DIRECT works there on Linux >= 6.6, otherwise reads fall back to
    buffered ones. Either way the data is exact and the report says which path ran."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        tensors = {"a": U.random_tensor(torch.bfloat16, (300, 301), 3),
                   "b": U.random_tensor(torch.int64, (77,), 4)}
        path = U.write_checkpoint(Path(d) / "shm.safetensors", tensors)
        got, paths = load_report([path], "direct")
        assert paths == [U.expected_direct_path(d)]
        U.assert_same_dict(got, tensors)
        got, paths = load_report([path], "mmap")
        assert paths == ["mmap"]
        U.assert_same_dict(got, tensors)
        # tmpfs pages always live in memory, so auto maps them.
        got, paths = load_report([path], "auto")
        assert paths == ["mmap"]
        U.assert_same_dict(got, tensors)
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


@pytest.mark.parametrize("reader", ["direct", "auto"])
def test_buffered_fallback_when_o_direct_is_refused(medium_file, no_o_direct_preload, reader):
    """When the file system refuses O_DIRECT, direct reads fall back to buffered ones."""
    path, _ = medium_file
    U.make_cold(path)
    proc = U.run_python(
        """
        import json, sys, torch, fastsafetensors_rs
        from safetensors.torch import load_file
        import fst_testutils as U
        path, reader = sys.argv[1], sys.argv[2]
        tensors, paths = U.op_load_with_report([path], "cpu", None, reader)
        U.assert_same_dict(tensors, load_file(path))
        print(json.dumps(paths))
        """,
        path, reader,
        env={"LD_PRELOAD": str(no_o_direct_preload)},
    )
    out = U.check_output(proc)
    assert json.loads(out.strip().splitlines()[-1]) == ["buffered"]


@pytest.mark.parametrize("bad", ["mmapp", "buffered", "o_direct", "none"])
def test_invalid_reader_name(all_dtypes_file, bad):
    path, _ = all_dtypes_file
    with pytest.raises(RuntimeError):
        U.op_load([str(path)], "cpu", None, bad)
    with pytest.raises(RuntimeError):
        U.op_load_with_report([str(path)], "cpu", None, bad)
    with pytest.raises((RuntimeError, ValueError)):
        fastsafetensors_rs.load_file(path, reader=bad)


# ---------------------------------------------------------------- FASTSAFETENSORS_READER


def test_env_reader_mmap_overrides_auto(medium_file, monkeypatch):
    path, written = medium_file
    U.make_cold(path)  # auto would read it directly
    monkeypatch.setenv(U.ENV_READER, "mmap")
    got, paths = load_report([path], None)
    assert paths == ["mmap"]
    U.assert_same_dict(got, written)
    U.assert_same_dict(fastsafetensors_rs.load_file(path), written)


def test_env_reader_direct_overrides_auto(medium_file, monkeypatch):
    path, written = medium_file
    U.make_warm(path)  # auto would map it
    monkeypatch.setenv(U.ENV_READER, "direct")
    got, paths = load_report([path], None)
    assert paths == ["direct"]
    U.assert_same_dict(got, written)


def test_env_reader_is_read_at_call_time(medium_file, monkeypatch):
    path, _ = medium_file
    U.make_warm(path)
    monkeypatch.setenv(U.ENV_READER, "direct")
    assert load_report([path], None)[1] == ["direct"]
    monkeypatch.setenv(U.ENV_READER, "mmap")
    assert load_report([path], None)[1] == ["mmap"]
    monkeypatch.setenv(U.ENV_READER, "auto")
    U.make_warm(path)
    assert load_report([path], None)[1] == ["mmap"]
    monkeypatch.delenv(U.ENV_READER)
    U.make_cold(path)
    assert load_report([path], None)[1] == ["direct"]


def test_explicit_reader_beats_env(medium_file, monkeypatch):
    path, _ = medium_file
    U.make_warm(path)
    monkeypatch.setenv(U.ENV_READER, "direct")
    assert load_report([path], "mmap")[1] == ["mmap"]
    assert load_report([path], "auto")[1] == ["mmap"]
    monkeypatch.setenv(U.ENV_READER, "mmap")
    assert load_report([path], "direct")[1] == ["direct"]


@pytest.mark.parametrize("value, expected", [("mmap", "mmap"), ("direct", "direct")])
def test_env_reader_in_fresh_process(medium_file, value, expected):
    path, written = medium_file
    U.make_cold(path) if value == "mmap" else U.make_warm(path)
    proc = U.run_python(
        """
        import json, sys, torch, fastsafetensors_rs
        from safetensors.torch import load_file
        import fst_testutils as U
        tensors, paths = U.op_load_with_report([sys.argv[1]])
        U.assert_same_dict(tensors, load_file(sys.argv[1]))
        U.assert_same_dict(fastsafetensors_rs.load_file(sys.argv[1]), load_file(sys.argv[1]))
        print(json.dumps(paths))
        """,
        path,
        env={U.ENV_READER: value},
    )
    assert json.loads(U.check_output(proc).strip().splitlines()[-1]) == [expected]


# ---------------------------------------------------------------- dtype casting


def _cast_source():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 10, generator=g) * 3
    return {
        "bf16": x.to(torch.bfloat16),
        "f16": x.to(torch.float16),
        "f32": x.clone(),
        "f64": x.double() / 7,
        "f32.scalar": torch.tensor(1.25),
        "f16.empty": torch.empty(0, 3, dtype=torch.float16),
        "i64": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (5,), generator=g, dtype=torch.int32),
        "i8": torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        "u32": torch.tensor([0, 1, 1000003, 2**31, 2**32 - 1], dtype=torch.uint32),
        "bool": torch.tensor([True, False, True]),
    }


FLOATING = {"bf16", "f16", "f32", "f64", "f32.scalar", "f16.empty"}


@pytest.mark.parametrize("reader", U.READERS)
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=U.dtype_id)
def test_dtype_cast(tmp_path, reader, target):
    src = _cast_source()
    path = U.write_checkpoint(tmp_path / "cast.safetensors", src)
    got = U.op_load([str(path)], "cpu", target, reader)
    assert sorted(got) == sorted(src)
    for name, t in src.items():
        if name in FLOATING:
            U.assert_same_tensor(got[name], t.to(target), name)
        else:
            U.assert_same_tensor(got[name], t, name)


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu]


@pytest.mark.parametrize("reader", ["direct", "mmap"])
@pytest.mark.parametrize("src_dtype", FLOAT8, ids=U.dtype_id)
def test_dtype_cast_keeps_float8(tmp_path, reader, src_dtype):
    """float8 tensors are quantised payloads (paired with scales): `dtype=` leaves them, and
    integers, as they are, while the full-precision floats beside them are cast."""
    x = (torch.randn(8, 8, generator=torch.Generator().manual_seed(9)) * 3).abs().to(src_dtype)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    path = U.write_checkpoint(tmp_path / "f8.safetensors", {"x": x, "w": w, "i": torch.arange(3)})
    got = U.op_load([str(path)], "cpu", torch.float32, reader)
    U.assert_same_tensor(got["x"], x, "x")
    U.assert_same_tensor(got["w"], w.float(), "w")
    U.assert_same_tensor(got["i"], torch.arange(3), "i")


def test_dtype_cast_bf16_to_float32_matches_reference(tmp_path):
    src = {"w": U.random_tensor(torch.float32, (64, 64), 3).nan_to_num(0.0, 1.0, -1.0).to(torch.bfloat16)}
    path = U.write_checkpoint(tmp_path / "bf16.safetensors", src)
    ref = st_load_file(str(path))["w"].float()
    got = fastsafetensors_rs.load_file(path, dtype=torch.float32)["w"]
    assert got.dtype == torch.float32
    assert torch.equal(got, ref)
    got = fastsafetensors_rs.load([path], dtype=torch.float32)["w"]
    assert torch.equal(got, ref)
    with fastsafetensors_rs.safe_open(path) as f:  # safe_open never casts
        assert f.get_tensor("w").dtype == torch.bfloat16


def test_dtype_cast_across_files(multi_file_model):
    paths, shards = multi_file_model
    got = U.op_load([str(p) for p in paths], "cpu", torch.float32, None)
    assert sorted(got) == sorted(k for shard in shards for k in shard)
    checked = 0
    for shard in shards:
        for name, t in shard.items():
            if t.dtype in (torch.bfloat16, torch.float16, torch.float32):
                U.assert_same_tensor(got[name], t.float(), name)
                checked += 1
            elif not t.is_floating_point():
                U.assert_same_tensor(got[name], t, name)
                checked += 1
    assert checked == 9  # float8 casting is covered by test_dtype_cast_float8


# ---------------------------------------------------------------- alignment


def _misaligned_file(tmp_path):
    """A file whose data section starts at 7 mod 8, with no header padding, so wide tensors
    sit at unaligned file offsets. Returns (path, tensors, absolute offsets)."""
    entries = [
        ("a.f32", U.finite_tensor(torch.float32, (3, 5), 1)),     # abs 7 mod 8
        ("b.u8", U.random_tensor(torch.uint8, (3,), 2)),
        ("c.f64", U.finite_tensor(torch.float64, (4, 3), 3)),     # abs 2 mod 8
        ("d.i64", U.random_tensor(torch.int64, (7,), 4)),
        ("e.i16", U.random_tensor(torch.int16, (5,), 5)),
        ("f.bf16", U.finite_tensor(torch.bfloat16, (2, 3), 6)),
        ("g.u8", U.random_tensor(torch.uint8, (1,), 7)),
        ("h.i32", U.random_tensor(torch.int32, (9,), 8)),
        ("i.f16", U.finite_tensor(torch.float16, (3,), 9)),
        ("j.u64", U.random_tensor(torch.uint64, (2,), 10)),
        ("k.f32.scalar", U.finite_tensor(torch.float32, (), 11)),
    ]
    tensors = dict(entries)
    header, data, offsets = U.layout(entries)
    # Grow a metadata string until the header length is 7 mod 8: no whitespace padding.
    for pad in range(8):
        full = dict(header)
        full["__metadata__"] = {"pad": "x" * pad}
        hb = U.header_bytes(full)
        if len(hb) % 8 == 7:
            break
    path = U.write_raw(tmp_path / "misaligned.safetensors", hb, data)
    data_start = 8 + len(hb)
    assert data_start % 8 == 7
    absolute = {name: data_start + off for name, off in offsets.items()}
    return path, tensors, absolute


@pytest.mark.parametrize("reader", U.READERS)
def test_misaligned_tensors_load_exactly_and_aligned(tmp_path, reader):
    path, tensors, absolute = _misaligned_file(tmp_path)
    misaligned = [n for n, t in tensors.items() if absolute[n] % t.element_size()]
    assert len(misaligned) >= 6, "the file should really misalign most tensors"
    got, paths = load_report([path], reader)
    U.assert_same_dict(got, tensors)
    for name, t in got.items():
        assert t.data_ptr() % t.element_size() == 0, (
            f"{name} ({t.dtype}) at {t.data_ptr():#x} is not aligned to {t.element_size()}"
        )
        assert t.is_contiguous()
        # Vectorised arithmetic on the tensor works and gives the reference values.
        if t.is_floating_point() or t.dtype in (torch.int16, torch.int32, torch.int64):
            assert torch.equal(U.as_bytes(t * 1), U.as_bytes(tensors[name] * 1)), name
    if reader == "mmap":
        assert paths == ["mmap"]
    if reader == "direct":
        assert paths == [U.expected_direct_path(tmp_path)]
    with fastsafetensors_rs.safe_open(path) as f:
        for name, t in tensors.items():
            u = f.get_tensor(name)
            U.assert_same_tensor(u, t, name)
            assert u.data_ptr() % u.element_size() == 0, name


@pytest.mark.parametrize("reader", U.READERS)
def test_complex64_aligned_to_its_element_size(tmp_path, reader):
    """complex64 is c10::complex<float>, alignas(8): a C64 tensor at a file offset that is
    4 mod 8 must still come back 8-byte aligned."""
    entries = [
        ("a.u8", U.random_tensor(torch.uint8, (5,), 1)),
        ("b.c64", U.finite_tensor(torch.complex64, (6,), 2)),
        ("c.u8", U.random_tensor(torch.uint8, (4,), 3)),
        ("d.c64", U.finite_tensor(torch.complex64, (2, 3), 4)),
    ]
    tensors = dict(entries)
    header, data, offsets = U.layout(entries)
    for pad in range(8):
        full = dict(header)
        full["__metadata__"] = {"pad": "y" * pad}
        hb = U.header_bytes(full)
        if (8 + len(hb) + offsets["b.c64"]) % 8 == 4:
            break
    path = U.write_raw(tmp_path / "c64.safetensors", hb, data)
    data_start = 8 + len(hb)
    assert (data_start + offsets["b.c64"]) % 8 == 4
    got = U.op_load([str(path)], "cpu", None, reader)
    U.assert_same_dict(got, tensors)
    for name in ("b.c64", "d.c64"):
        t = got[name]
        assert t.data_ptr() % 8 == 0, f"{name} at {t.data_ptr():#x} is not 8-byte aligned"
        assert torch.equal(t * 1, tensors[name] * 1)


@pytest.mark.parametrize("reader", U.READERS)
def test_aligned_tensors_from_safetensors_files(all_dtypes_file, reader):
    path, _ = all_dtypes_file
    for name, t in U.op_load([str(path)], "cpu", None, reader).items():
        assert t.data_ptr() % t.element_size() == 0, name


# ---------------------------------------------------------------- writable tensors


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.parametrize("reader", U.READERS)
def test_tensors_are_writable_and_independent(medium_file, reader):
    path, written = medium_file
    before = _sha(path)
    got = U.op_load([str(path)], "cpu", None, reader)
    w = got["b.weight"]
    w.add_(1.0)
    assert torch.equal(w, written["b.weight"] + 1.0)
    got["a.weight"].zero_()
    assert not got["a.weight"].any()
    got["c.ids"][0] = 123
    assert got["c.ids"][0].item() == 123
    # Neighbouring tensors are untouched by writes to another one.
    U.assert_same_tensor(got["b.bias"], written["b.bias"], "b.bias")
    U.assert_same_tensor(got["d.scalar"], written["d.scalar"], "d.scalar")
    # The file and fresh loads never see the writes.
    assert _sha(path) == before
    for r in U.READERS:
        U.assert_same_dict(U.op_load([str(path)], "cpu", None, r), written)


def test_mmap_writes_do_not_reach_the_file(medium_file):
    path, written = medium_file
    U.make_warm(path)
    before = _sha(path)
    got, paths = load_report([path], "mmap")
    assert paths == ["mmap"]
    for t in got.values():
        t.reshape(-1).view(torch.uint8).fill_(0xA5)  # a view: t is contiguous
    assert all(bool((U.as_bytes(t) == 0xA5).all()) for t in got.values())
    del got
    assert _sha(path) == before
    U.make_cold(path)  # re-read from disk, not from pages that might have been shared
    assert _sha(path) == before
    U.assert_same_dict(st_load_file(str(path)), written)


def test_two_mmap_loads_are_independent(medium_file):
    path, written = medium_file
    U.make_warm(path)
    a, pa = load_report([path], "mmap")
    b, pb = load_report([path], "mmap")
    assert pa == pb == ["mmap"]
    a["a.weight"].view(torch.uint8).fill_(0)
    U.assert_same_tensor(b["a.weight"], written["a.weight"], "a.weight")


def test_resident_fraction_op_follows_the_page_cache(tmp_path):
    path = U.write_checkpoint(tmp_path / "res.safetensors", {"w": torch.ones(1 << 18)})
    U.make_warm(path)
    assert ops.resident_fraction(str(path)) >= 0.99
    U.make_cold(path)
    assert ops.resident_fraction(str(path)) < 0.01
    with pytest.raises(RuntimeError, match="missing.safetensors"):
        ops.resident_fraction(str(tmp_path / "missing.safetensors"))
