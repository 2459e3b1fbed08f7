"""Malformed files are rejected with an error naming the file and the reason, and the
process carries on."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

import fastsafetensors_rs
import fst_testutils as U

ops = torch.ops.fastsafetensors

F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


def u8(n, begin):
    return {"dtype": "U8", "shape": [n], "data_offsets": [begin, begin + n]}


# id -> (file bytes, reason pattern (case-insensitive), tensor name the message must contain)
def _file(header, data=b"", length=None):
    hb = U.header_bytes(header)
    return struct.pack("<Q", len(hb) if length is None else length) + hb + data


BAD_FILES = {
    "empty_file": (b"", r"too small", None),
    "seven_bytes": (b"\x02\x00\x00\x00\x00\x00\x00", r"too small", None),
    "header_past_end": (_file(b"{}", length=1000), r"past the end", None),
    "header_past_end_by_one": (_file(b"{}", length=3), r"past the end", None),
    "header_over_limit": (_file(b"{}", length=100_000_001), r"exceed", None),
    "header_u64_max": (_file(b"{}", length=2**64 - 1), r"exceed", None),
    "header_not_utf8": (_file(b'{"a\xff\xfe":{}}'), r"utf-?8", None),
    "not_json": (_file(b"{not json"), r"json", None),
    "empty_header": (_file(b""), r"json", None),
    "json_array": (_file(b"[]"), r"json", None),
    "json_number": (_file(b"3"), r"json", None),
    "json_null": (_file(b"null"), r"json", None),
    "tensor_entry_not_object": (_file({"w": 1}, b""), r"json", "w"),
    "missing_data_offsets": (_file({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), r"data_offsets", "w"),
    "negative_dim": (_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
                     r"json", "w"),
    "metadata_int_value": (_file({"__metadata__": {"a": 1}}), r"metadata", None),
    "metadata_nested": (_file({"__metadata__": {"a": {"b": "c"}}}), r"metadata", None),
    "metadata_list": (_file({"__metadata__": ["a"]}), r"metadata", None),
    "unknown_dtype": (_file({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
                      r"unknown dtype", "w"),
    "dtype_lowercase": (_file({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
                        r"unknown dtype", "w"),
    "shape_length_mismatch": (_file({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}},
                                    b"\0" * 12), r"mismatch|needs|expected", "w"),
    "shape_overflow": (_file({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}},
                             b"\0" * 4), r"overflow", "w"),
    "byte_count_overflow": (_file({"w": {"dtype": "F64", "shape": [2**62], "data_offsets": [0, 8]}},
                                  b"\0" * 8), r"overflow", "w"),
    "partial_fp4_byte": (_file({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0" * 2),
                         r"whole|partial", "w"),
    "reversed_offsets": (_file({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4),
                         r"before|reversed", "w"),
    "gap_between_tensors": (_file({"a": u8(2, 0), "b": u8(2, 3)}, b"\0" * 5), r"gap", "b"),
    "gap_at_start": (_file({"a": u8(2, 1)}, b"\0" * 3), r"gap", "a"),
    "overlap": (_file({"a": u8(4, 0), "b": u8(2, 2)}, b"\0" * 4), r"overlap", "b"),
    "same_range_twice": (_file({"a": u8(4, 0), "b": u8(4, 0)}, b"\0" * 4), r"overlap", None),
    "out_of_bounds": (_file({"a": u8(8, 0)}, b"\0" * 4), r"past the end|bounds", "a"),
    "offsets_u64_max": (_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [2**64 - 1, 2**64 - 1]}},
                              b"\0" * 4), r"past the end|bounds", "a"),
    "trailing_bytes": (_file({"a": u8(2, 0)}, b"\0" * 5), r"trailing", None),
    "trailing_after_empty_header": (_file(b"{}", b"\0"), r"trailing", None),
    "duplicate_name": (_file(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                             b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
                       r"duplicate", "a"),
    "duplicate_metadata": (_file(b'{"__metadata__":{},"__metadata__":{}}'), r"duplicate", None),
}

# Every way into the loader. The torch ops raise RuntimeError; the Python layer may map errors
# to ValueError/OSError, which is accepted there as long as the message is the same.
OP_ERRORS = (RuntimeError,)
PY_ERRORS = (RuntimeError, ValueError, OSError)


def _safe_open_everything(path):
    with fastsafetensors_rs.safe_open(path) as f:
        for name in f.keys():
            f.get_tensor(name)


def _compat_open_everything(path):
    with fastsafetensors_rs.fastsafe_open(path) as f:
        for name in f.keys():
            f.get_tensor(name)


def _compat_loader(path):
    loader = fastsafetensors_rs.SafeTensorsFileLoader(fastsafetensors_rs.SingleGroup(), "cpu")
    try:
        loader.add_filenames({0: [path]})
        loader.copy_files_to_device().close()
    finally:
        loader.close()


def _cli_verify(path):
    """The CLI reports on stdout/stderr and exits non-zero: turned into an exception here."""
    import contextlib
    import io

    from fastsafetensors_rs import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["verify", path])
    if rc != 0:
        raise RuntimeError(out.getvalue())


ENTRY_POINTS = {
    "load_auto": (lambda p: ops.load([p], "cpu", None, "auto"), OP_ERRORS),
    "load_direct": (lambda p: ops.load([p], "cpu", None, "direct"), OP_ERRORS),
    "load_mmap": (lambda p: ops.load([p], "cpu", None, "mmap"), OP_ERRORS),
    "load_with_report": (lambda p: ops.load_with_report([p]), OP_ERRORS),
    "keys": (lambda p: ops.keys(p), OP_ERRORS),
    "metadata": (lambda p: ops.metadata(p), OP_ERRORS),
    "load_file": (lambda p: fastsafetensors_rs.load_file(p), PY_ERRORS),
    "load_cast": (lambda p: fastsafetensors_rs.load([p], dtype=torch.float32), PY_ERRORS),
    "safe_open": (_safe_open_everything, PY_ERRORS),
    "fastsafe_open": (_compat_open_everything, PY_ERRORS),
    "SafeTensorsFileLoader": (_compat_loader, PY_ERRORS),
    "cli_verify": (_cli_verify, PY_ERRORS),
}


def check_error(excinfo, path, reason, name=None):
    msg = str(excinfo.value)
    assert str(path) in msg, f"path missing from error: {msg!r}"
    assert re.search(reason, msg, re.IGNORECASE), f"reason /{reason}/ missing from error: {msg!r}"
    if name is not None:
        assert name in msg, f"tensor name {name!r} missing from error: {msg!r}"


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    for case, (content, _, _) in BAD_FILES.items():
        (d / f"{case}.safetensors").write_bytes(content)
    return d


def test_bad_files_are_really_bad(bad_dir):
    """safetensors itself rejects these files (guards the test data)."""
    from safetensors import safe_open as st_safe_open

    accepted = []
    for case in BAD_FILES:
        try:
            with st_safe_open(str(bad_dir / f"{case}.safetensors"), "pt") as f:
                for k in f.keys():
                    f.get_tensor(k)
            accepted.append(case)
        except Exception:
            pass
    # safetensors keeps the last of two duplicate JSON keys; an ambiguous header is rejected
    # here all the same.
    assert set(accepted) <= {"duplicate_name"}, accepted


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_malformed_file(bad_dir, case, entry):
    _, reason, name = BAD_FILES[case]
    path = str(bad_dir / f"{case}.safetensors")
    call, errors = ENTRY_POINTS[entry]
    with pytest.raises(errors) as info:
        call(path)
    check_error(info, path, reason, name)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_missing_file(tmp_path, entry):
    path = str(tmp_path / "does_not_exist.safetensors")
    call, errors = ENTRY_POINTS[entry]
    with pytest.raises(errors) as info:
        call(path)
    check_error(info, path, r"no such file|not found|does not exist")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_directory_instead_of_file(tmp_path, entry):
    path = tmp_path / "a_directory.safetensors"
    path.mkdir()
    call, errors = ENTRY_POINTS[entry]
    with pytest.raises(errors) as info:
        call(str(path))
    check_error(info, str(path), r"directory|not a (regular )?file")


@pytest.mark.parametrize("reader", U.READERS)
def test_duplicate_name_across_files(tmp_path, reader):
    a = U.write_checkpoint(tmp_path / "a.safetensors", {"shared.weight": torch.ones(2), "a": torch.ones(1)})
    b = U.write_checkpoint(tmp_path / "b.safetensors", {"b": torch.ones(1), "shared.weight": torch.zeros(2)})
    with pytest.raises(RuntimeError) as info:
        ops.load([str(a), str(b)], "cpu", None, reader)
    msg = str(info.value)
    assert "shared.weight" in msg and str(a) in msg and str(b) in msg, msg
    assert re.search("duplicate", msg, re.IGNORECASE), msg
    with pytest.raises(PY_ERRORS) as info:
        fastsafetensors_rs.load([str(a), str(b)], reader=reader)
    msg = str(info.value)
    assert "shared.weight" in msg and str(a) in msg and str(b) in msg, msg


def test_same_file_twice_is_a_duplicate(tmp_path):
    a = U.write_checkpoint(tmp_path / "a.safetensors", {"w": torch.ones(2)})
    with pytest.raises(RuntimeError) as info:
        ops.load([str(a), str(a)])
    assert "w" in str(info.value) and str(a) in str(info.value)


@pytest.mark.parametrize("reader", U.READERS)
def test_error_names_the_bad_file_of_several(tmp_path, bad_dir, reader):
    good = U.write_checkpoint(tmp_path / "good.safetensors", {"g": torch.ones(3)})
    bad = str(bad_dir / "gap_between_tensors.safetensors")
    with pytest.raises(RuntimeError) as info:
        ops.load([str(good), bad], "cpu", None, reader)
    check_error(info, bad, r"gap", "b")
    with pytest.raises(RuntimeError) as info:
        ops.load([bad, str(good)], "cpu", None, reader)
    check_error(info, bad, r"gap", "b")


def test_loading_works_after_errors(tmp_path, bad_dir):
    for case in BAD_FILES:
        with pytest.raises(RuntimeError):
            ops.load([str(bad_dir / f"{case}.safetensors")])
    tensors = {"x": U.random_tensor(torch.bfloat16, (40, 40), 1)}
    good = U.write_checkpoint(tmp_path / "good.safetensors", tensors)
    for reader in U.READERS:
        U.assert_same_dict(ops.load([str(good)], "cpu", None, reader), tensors)


# ---------------------------------------------------------------- valid edge cases


@pytest.mark.parametrize("reader", U.READERS)
def test_empty_object_file_loads_empty(tmp_path, reader):
    path = U.write_raw(tmp_path / "empty.safetensors", b"{}")
    assert path.stat().st_size == 10
    assert ops.load([str(path)], "cpu", None, reader) == {}
    tensors, paths = ops.load_with_report([str(path)], "cpu", None, reader)
    assert tensors == {} and paths == ["none"], "a file without tensors has nothing to read"
    assert ops.keys(str(path)) == []
    assert ops.metadata(str(path)) is None
    assert fastsafetensors_rs.load_file(path, reader=reader) == {}


@pytest.mark.parametrize("reader", U.READERS)
def test_hand_written_zero_sized_tensors(tmp_path, reader):
    header = {
        "a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
        "c": {"dtype": "F16", "shape": [4, 0], "data_offsets": [2, 2]},
        "s": {"dtype": "I64", "shape": [], "data_offsets": [2, 10]},
    }
    data = bytes([7, 9]) + struct.pack("<q", -42)
    path = U.write_raw(tmp_path / "zeros.safetensors", header, data)
    got = ops.load([str(path)], "cpu", None, reader)
    assert sorted(got) == ["a", "b", "c", "s"]
    assert got["a"].shape == (0, 3) and got["a"].dtype == torch.float32
    assert got["c"].shape == (4, 0) and got["c"].dtype == torch.float16
    assert got["b"].tolist() == [7, 9]
    assert got["s"].shape == () and got["s"].item() == -42


@pytest.mark.parametrize("reader", U.READERS)
def test_whitespace_padded_header_is_valid(tmp_path, reader):
    header, data, _ = U.layout([("x", torch.arange(6, dtype=torch.int16))])
    path = U.write_raw(tmp_path / "padded.safetensors", U.header_bytes(header) + b"   \n\t ", data)
    U.assert_same_dict(ops.load([str(path)], "cpu", None, reader), {"x": torch.arange(6, dtype=torch.int16)})


def test_header_of_exactly_the_file(tmp_path):
    """A header that ends exactly at the end of the file, with no tensors, is valid."""
    path = U.write_raw(tmp_path / "meta_only.safetensors", {"__metadata__": {"k": "v"}})
    assert ops.load([str(path)]) == {}
    assert ops.metadata(str(path)) == {"k": "v"}


# ---------------------------------------------------------------- the process survives


def test_every_error_in_one_process(bad_dir, tmp_path):
    """Runs every malformed file through every entry point in a fresh interpreter, which
    must report each error as an exception and exit normally."""
    good = U.write_checkpoint(tmp_path / "good.safetensors", {"w": torch.arange(12.0).reshape(3, 4)})
    missing = tmp_path / "missing.safetensors"
    directory = tmp_path / "dir.safetensors"
    directory.mkdir()
    files = [str(bad_dir / f"{case}.safetensors") for case in BAD_FILES] + [str(missing), str(directory)]
    proc = U.run_python(
        """
        import json, sys, torch, fastsafetensors_rs
        ops = torch.ops.fastsafetensors
        files, good = json.loads(sys.argv[1]), sys.argv[2]

        def safe_open_all(p):
            with fastsafetensors_rs.safe_open(p) as f:
                for k in f.keys():
                    f.get_tensor(k)

        calls = [
            lambda p: ops.load([p], "cpu", None, "auto"),
            lambda p: ops.load([p], "cpu", None, "direct"),
            lambda p: ops.load([p], "cpu", None, "mmap"),
            lambda p: ops.load_with_report([p]),
            lambda p: ops.keys(p),
            lambda p: ops.metadata(p),
            lambda p: fastsafetensors_rs.load_file(p),
            safe_open_all,
        ]
        raised = 0
        for p in files:
            for call in calls:
                try:
                    call(p)
                except (RuntimeError, ValueError, OSError) as e:
                    assert p in str(e), (p, str(e))
                    raised += 1
                else:
                    raise SystemExit(f"no error for {p}")
        out = ops.load([good])
        assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
        print("raised", raised)
        """,
        json.dumps(files), good,
    )
    out = U.check_output(proc)
    assert f"raised {len(files) * 8}" in out
