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
    "load_auto": (lambda p: U.op_load([p], "cpu", None, "auto"), OP_ERRORS),
    "load_direct": (lambda p: U.op_load([p], "cpu", None, "direct"), OP_ERRORS),
    "load_mmap": (lambda p: U.op_load([p], "cpu", None, "mmap"), OP_ERRORS),
    "load_with_report": (lambda p: U.op_load_with_report([p]), OP_ERRORS),
    "keys": (lambda p: ops.keys(p), OP_ERRORS),
    "metadata": (lambda p: U.op_metadata(p), OP_ERRORS),
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


# Entry points that read one file; the others load checkpoint directories (test_checkpoints.py).
SINGLE_FILE = {"keys", "metadata", "safe_open", "fastsafe_open", "SafeTensorsFileLoader"}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_directory_instead_of_file(tmp_path, entry):
    path = tmp_path / "a_directory.safetensors"
    path.mkdir()
    call, errors = ENTRY_POINTS[entry]
    with pytest.raises(errors) as info:
        call(str(path))
    if entry in SINGLE_FILE:
        check_error(info, str(path), r"is a directory, but safe_open, keys\(\) and metadata\(\) read one "
                    r"\.safetensors file: pass one of its files, or load the whole checkpoint with load\(\)/load_file\(\)")
    else:  # a load takes the directory, which holds nothing to load
        check_error(info, str(path), r"no \*\.safetensors files and no \*\.safetensors\.index\.json in this directory")


# ---------------------------------------------------------------- files of other formats

CONVERT = r"load it with torch\.load, or convert it to \.safetensors \(safetensors\.torch\.save_file\)"
JSON_HINT = (r"it is JSON text\. A checkpoint index \(\*\.safetensors\.index\.json\) loads with load\(\)/load_file\(\) "
             r"\(pass the index or its directory\); safe_open opens one of the shards it lists")


def _torch_zip(path):
    torch.save({"w": torch.ones(3)}, path)


def _torch_pickle(path):
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)


def _writer(data: bytes):
    return lambda path: path.write_bytes(data)


# id -> (file name, writer, what the message must say after "not a safetensors file: ")
FOREIGN = {
    "torch_zip_bin": ("pytorch_model.bin", _torch_zip,
                      r"it looks like a PyTorch zip checkpoint \(torch\.save\); " + CONVERT),
    "torch_zip_pt": ("model.pt", _torch_zip, r"it looks like a PyTorch zip checkpoint \(torch\.save\); " + CONVERT),
    "torch_pickle": ("legacy.pt", _torch_pickle,
                     r"it looks like a PyTorch pickle checkpoint \(torch\.save, legacy format\); " + CONVERT),
    "text": ("README.safetensors", _writer(b"These are not the weights you are looking for.\n"), r"it is text(\n|$)"),
    "json": ("weights.safetensors", _writer(b'{"weight_map": {"w": "model.safetensors"}}'), JSON_HINT),
    "git_lfs_pointer": ("model.safetensors", _writer(
        b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daa"
        b"a5e2ca24d17e2393\nsize 548105171\n"),
        r"it is a Git LFS pointer, not the data: fetch the file itself \(git lfs pull\)"),
}


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("foreign")
    for case, (name, write, _) in FOREIGN.items():
        (d / case).mkdir()
        write(d / case / name)
    return d


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(FOREIGN))
def test_file_of_another_format(foreign_dir, case, entry):
    name, _, hint = FOREIGN[case]
    path = str(foreign_dir / case / name)
    call, errors = ENTRY_POINTS[entry]
    with pytest.raises(errors) as info:
        call(path)
    check_error(info, path, re.escape(f"{path}: not a safetensors file: ") + hint)
    assert "header length" not in str(info.value)


def test_torch_checkpoint_message_in_full(foreign_dir):
    path = foreign_dir / "torch_zip_bin" / "pytorch_model.bin"
    with pytest.raises(RuntimeError) as info:
        fastsafetensors_rs.load_file(path)
    assert str(info.value) == (
        f"{path}: not a safetensors file: it looks like a PyTorch zip checkpoint (torch.save); load it with "
        "torch.load, or convert it to .safetensors (safetensors.torch.save_file)")
    # What safetensors itself says, for comparison: it too refuses the file.
    from safetensors.torch import load_file as st_load_file

    with pytest.raises(Exception):
        st_load_file(str(path))


def test_index_given_to_single_file_readers(tmp_path):
    """An index is a checkpoint to load, and a JSON file to safe_open: the message says so."""
    U.write_checkpoint(tmp_path / "model.safetensors", {"w": torch.ones(2)})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model.safetensors"}}))
    for call in (lambda p: fastsafetensors_rs.safe_open(p), ops.keys, ops.metadata):
        with pytest.raises(RuntimeError) as info:
            call(str(index))
        check_error(info, str(index), re.escape(f"{index}: not a safetensors file: ") + JSON_HINT)
    assert torch.equal(fastsafetensors_rs.load_file(index)["w"], torch.ones(2))


def test_a_valid_file_is_never_taken_for_another_format(tmp_path):
    """A header of 640 bytes: its length opens with 80 02, as a pickle does. It loads."""
    raw = U.header_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    path = U.write_raw(tmp_path / "pickle_like.safetensors", raw + b" " * (640 - len(raw)), struct.pack("<2f", 1.5, -2))
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert fastsafetensors_rs.load_file(path)["w"].tolist() == [1.5, -2.0]


# ---------------------------------------------------------------- paths that are not UTF-8


def _not_utf8_entry_points():
    return {
        "load_file": fastsafetensors_rs.load_file,
        "load": lambda p: fastsafetensors_rs.load([p]),
        "stream": fastsafetensors_rs.stream,
        "weights_iterator": fastsafetensors_rs.weights_iterator,
        "safe_open": fastsafetensors_rs.safe_open,
        "safe_open_list": lambda p: fastsafetensors_rs.safe_open([p]),
        "fastsafe_open": fastsafetensors_rs.fastsafe_open,
        "SafeTensorsFileLoader": _compat_loader,
        "ParallelLoader": lambda p: fastsafetensors_rs.ParallelLoader(None, p),
    }


@pytest.mark.parametrize("form", ["bytes", "str"])
@pytest.mark.parametrize("entry", list(_not_utf8_entry_points()))
def test_a_path_that_is_not_utf8_is_named_in_one_line(tmp_path, entry, form):
    """The file exists; the loader cannot take its name (the ops take UTF-8 strings). The
    error names the path as a terminal can print it, when the function is called."""
    import os

    raw = os.fsencode(tmp_path) + b"/w\xff.safetensors"
    U.write_checkpoint(raw.decode("utf-8", "surrogateescape"), {"w": torch.ones(2)})
    path = raw if form == "bytes" else os.fsdecode(raw)
    with pytest.raises(ValueError) as info:
        _not_utf8_entry_points()[entry](path)
    shown = raw.decode("utf-8", "backslashreplace")
    assert str(info.value) == (f"{shown}: the path is not UTF-8, and fastsafetensors_rs takes UTF-8 paths only: "
                               "rename the file, or link to it under a UTF-8 name")


def test_a_bytes_path_in_utf8_loads(tmp_path):
    import os

    path = U.write_checkpoint(tmp_path / "wé.safetensors", {"w": torch.ones(2)})
    assert torch.equal(fastsafetensors_rs.load_file(os.fsencode(path))["w"], torch.ones(2))
    assert torch.equal(fastsafetensors_rs.load([os.fsencode(path)])["w"], torch.ones(2))
    assert fastsafetensors_rs.safe_open(os.fsencode(path)).keys() == ["w"]


def test_the_cli_reports_a_path_that_is_not_utf8_as_the_loader_does_and_goes_on(tmp_path, capsys):
    import os

    from fastsafetensors_rs import cli

    good = U.write_checkpoint(tmp_path / "good.safetensors", {"w": torch.ones(2)})
    raw = os.fsencode(tmp_path) + b"/w\xff.safetensors"
    U.write_checkpoint(os.fsdecode(raw), {"w": torch.ones(2)})
    with pytest.raises(ValueError) as info:
        fastsafetensors_rs.load_file(raw)
    for command in ("inspect", "verify"):
        assert cli.main([command, "--no-progress", os.fsdecode(raw), str(good)]) == 1
        out = capsys.readouterr().out
        assert f"problem: {info.value}\n" in out, out
        assert f"{good}\n" in out or f"ok  {good}" in out, out
        assert cli.main([command, "--json", os.fsdecode(raw), str(good)]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["problems"] == [str(info.value)]
        assert [f["path"] for f in doc["files"]] == [str(good)] and doc["files"][0]["valid"]


def test_a_directory_holding_a_shard_not_named_in_utf8_is_refused_alike_by_load_and_the_cli(tmp_path, capsys):
    import os

    from fastsafetensors_rs import cli

    U.write_checkpoint(tmp_path / "a.safetensors", {"a": torch.ones(2)})
    U.write_checkpoint(os.fsdecode(os.fsencode(tmp_path) + b"/b\xff.safetensors"), {"b": torch.ones(2)})
    expected = (f"{tmp_path}/b\\xff.safetensors: the path is not UTF-8, and fastsafetensors_rs takes UTF-8 paths "
                "only: rename the file, or link to it under a UTF-8 name")
    with pytest.raises(RuntimeError) as info:
        fastsafetensors_rs.load_file(tmp_path)
    assert str(info.value) == expected
    for command in ("inspect", "verify"):
        assert cli.main([command, "--no-progress", str(tmp_path)]) == 2
        assert expected in capsys.readouterr().err


# ---------------------------------------------------------------- messages that name what is wrong


def _one_line(error, call, *args, **kwargs) -> str:
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_dtype_torch_lacks_is_refused_naming_the_file(tmp_path):
    path = U.write_raw(tmp_path / "f6.safetensors", {"x": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}},
                       b"\0" * 3)
    assert _one_line(RuntimeError, fastsafetensors_rs.load_file, path) == (
        f"{path}: tensor 'x': dtype F6_E2M3 has no torch equivalent")
    with pytest.raises(RuntimeError, match=re.escape(f"{path}: tensor 'x'")):
        list(fastsafetensors_rs.stream(path))


def test_an_invalid_regex_is_one_line_saying_what_and_where(tmp_path):
    path = U.write_raw(tmp_path / "a.safetensors", {"a": F32_1}, b"\0" * 4)
    assert _one_line(ValueError, fastsafetensors_rs.load_file, path, tensor_filter=r"w\.(",
                     tensor_name_match_mode="regex") == (
        r"tensor_filter pattern 'w\.(' is not valid: unclosed group (at character 4)")


def test_rows_of_a_tensor_in_no_file_name_the_tensor(tmp_path):
    path = U.write_raw(tmp_path / "a.safetensors", {"a": F32_1}, b"\0" * 4)
    assert _one_line(RuntimeError, ops.load_rows, str(path), "nope", 0, 1) == f"{path}: no tensor named 'nope'"


def test_a_file_given_twice_is_said_so(tmp_path):
    path = U.write_raw(tmp_path / "x.safetensors", {"a": F32_1}, b"\0" * 4)
    assert _one_line(RuntimeError, fastsafetensors_rs.load, [path, path]) == (
        f"{path}: given twice: pass each file once")


@pytest.mark.parametrize("offsets", [[0, 8, 9], [0], []])
def test_data_offsets_must_be_a_pair(tmp_path, offsets):
    path = U.write_raw(tmp_path / "x.safetensors", {"x": {"dtype": "U8", "shape": [8], "data_offsets": offsets}},
                       b"\0" * 8)
    message = _one_line(RuntimeError, fastsafetensors_rs.load_file, path)
    assert message.startswith(f"{path}: ") and (
        f"tensor 'x': data_offsets must be [begin, end], not {len(offsets)} numbers" in message), message


# ---------------------------------------------------------------- failed system calls are OSErrors

def _os_error_entry_points():
    """Every Python entry point that opens a file."""
    return {
        "load_file": fastsafetensors_rs.load_file,
        "load": lambda p: fastsafetensors_rs.load([p]),
        "load_cast": lambda p: fastsafetensors_rs.load([p], dtype=torch.float32),
        "stream": lambda p: list(fastsafetensors_rs.stream(p)),
        "safe_open": fastsafetensors_rs.safe_open,
        "weights_iterator": lambda p: list(fastsafetensors_rs.weights_iterator(p)),
        "fastsafe_open": fastsafetensors_rs.fastsafe_open,
        "SafeTensorsFileLoader": _compat_loader,
    }


@pytest.mark.parametrize("entry", list(_os_error_entry_points()))
def test_a_missing_file_is_file_not_found_with_errno_and_filename(tmp_path, entry):
    """As open() and safetensors raise it, so that `except FileNotFoundError` / `except OSError`
    around a load works; the message stays the loader's one line, and it is still the
    RuntimeError it was."""
    import errno

    path = str(tmp_path / "does_not_exist.safetensors")
    with pytest.raises(FileNotFoundError) as info:
        _os_error_entry_points()[entry](path)
    e = info.value
    assert (e.errno, e.filename, e.strerror) == (errno.ENOENT, path, "No such file or directory")
    assert str(e) == f"No such file or directory: {path}", "safetensors' wording"
    assert isinstance(e, RuntimeError)


def test_safetensors_raises_file_not_found_as_well(tmp_path):
    from safetensors.torch import load_file as st_load_file

    with pytest.raises(FileNotFoundError):
        st_load_file(str(tmp_path / "does_not_exist.safetensors"))


@pytest.mark.parametrize("entry", ["load_file", "safe_open", "stream", "fastsafe_open"])
def test_a_path_through_a_file_is_not_a_directory_error(tmp_path, entry):
    import errno

    parent = U.write_checkpoint(tmp_path / "w.safetensors", {"w": torch.ones(2)})
    path = f"{parent}/x.safetensors"
    with pytest.raises(NotADirectoryError) as info:
        _os_error_entry_points()[entry](path)
    assert (info.value.errno, info.value.filename) == (errno.ENOTDIR, path)


@pytest.mark.parametrize("code, error", [(13, PermissionError), (21, IsADirectoryError), (5, OSError),
                                         (24, OSError)])
def test_each_errno_gives_the_oserror_subclass_python_gives(code, error):
    """(The tests run as root here, so a file cannot be made unreadable: the mapping itself.)"""
    import os

    from fastsafetensors_rs._errors import from_op

    strerror = os.strerror(code)
    message = f"/m/a: b.safetensors: read failed: {strerror} (os error {code})"
    e = from_op(message)
    assert type(e).__mro__[1] is error and isinstance(e, RuntimeError)
    assert (e.errno, e.strerror, e.filename, str(e)) == (code, strerror, "/m/a: b.safetensors", message)
    import pickle

    again = pickle.loads(pickle.dumps(e))
    assert (type(again), again.errno, again.filename, str(again)) == (type(e), code, e.filename, message)


@pytest.mark.parametrize("entry", ["safe_open", "fastsafe_open", "SafeTensorsFileLoader"])
def test_a_directory_where_one_file_is_read_is_a_directory_error(tmp_path, entry):
    import errno

    path = tmp_path / "a_directory.safetensors"
    path.mkdir()
    with pytest.raises(IsADirectoryError) as info:
        _os_error_entry_points()[entry](str(path))
    assert (info.value.errno, info.value.filename) == (errno.EISDIR, str(path))
    assert str(info.value).startswith(f"{path}: is a directory, but safe_open")


def test_an_object_url_with_nothing_behind_it_is_file_not_found():
    import errno

    from fastsafetensors_rs._errors import from_op

    message = ("s3://bucket/model.safetensors: no such object (HTTP 404): check the URL, and that the object "
               "was uploaded")
    e = from_op(message)
    assert isinstance(e, FileNotFoundError) and isinstance(e, RuntimeError)
    assert (e.errno, e.filename, str(e)) == (errno.ENOENT, "s3://bucket/model.safetensors", message)


def test_errors_without_an_errno_stay_loader_errors():
    from fastsafetensors_rs._errors import SafetensorError, from_op

    for message in ("a.safetensors: mmap failed: out of memory",  # an io error without errno
                    "a.safetensors: not a safetensors file: it is text",
                    "a.safetensors: open failed: gone (os error 2) (read by rank 1 of the 2 ranks loading together)"):
        e = from_op(message)
        assert type(e) is SafetensorError and str(e) == message
    assert type(from_op("invalid argument: x")) is ValueError


# ---------------------------------------------------------------- bytes, and paths holding a NUL

def test_serialized_bytes_load_as_safetensors_torch_load_does(all_dtypes_file):
    from safetensors.torch import load as st_load

    path, want = all_dtypes_file  # every dtype; safetensors.torch.load lacks some (F4, F8_E8M0)
    data = path.read_bytes()
    common = {k: t for k, t in want.items()
              if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8)}
    U.assert_same_dict(st_load(save_file_bytes(common)), common)
    U.assert_same_dict(fastsafetensors_rs.load(save_file_bytes(common)), common)
    U.assert_same_dict(fastsafetensors_rs.load(data), want)
    U.assert_same_dict(fastsafetensors_rs.load_bytes(data), want)
    U.assert_same_dict(fastsafetensors_rs.load_bytes(bytearray(data)), want)
    U.assert_same_dict(fastsafetensors_rs.load_bytes(memoryview(data)), want)
    cast = fastsafetensors_rs.load(data, dtype=torch.float32, tensor_filter="bfloat16.*")
    assert cast and all(t.dtype == torch.float32 for t in cast.values())


def save_file_bytes(tensors):
    from safetensors.torch import save

    return save(tensors)


def test_tensors_loaded_from_bytes_do_not_depend_on_them(tmp_path):
    from safetensors.torch import save

    data = bytearray(save({"w": torch.arange(8, dtype=torch.int64)}))
    out = fastsafetensors_rs.load_bytes(data)
    data[:] = b"\xff" * len(data)
    del data
    assert torch.equal(out["w"], torch.arange(8, dtype=torch.int64))


def test_malformed_bytes_are_named_bytes():
    with pytest.raises(fastsafetensors_rs.SafetensorError) as info:
        fastsafetensors_rs.load(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert str(info.value).startswith("<bytes>: "), str(info.value)
    with pytest.raises(TypeError, match="load_bytes takes serialized safetensors data"):
        fastsafetensors_rs.load_bytes("model.safetensors")
    with pytest.raises(ValueError, match=r"load\(data\) of serialized bytes takes device, dtype and tensor_filter "
                                         r"only, not reader"):
        fastsafetensors_rs.load(b"\x02\x00\x00\x00\x00\x00\x00\x00{}", reader="direct")


@pytest.mark.parametrize("entry", ["load_file", "load_list", "safe_open", "stream", "fastsafe_open"])
def test_bytes_that_cannot_be_a_path_are_refused_in_one_line(entry):
    data = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
    call = {
        "load_file": fastsafetensors_rs.load_file,
        "load_list": lambda d: fastsafetensors_rs.load([d]),
        "safe_open": fastsafetensors_rs.safe_open,
        "stream": fastsafetensors_rs.stream,
        "fastsafe_open": fastsafetensors_rs.fastsafe_open,
    }[entry]
    with pytest.raises(ValueError) as info:
        call(data)
    assert str(info.value) == ("got 10 bytes holding a NUL byte where a path goes, and no path holds one: serialized "
                               "safetensors data (what safetensors.torch.load takes) loads with "
                               "fastsafetensors_rs.load(data) or load_bytes(data)")


@pytest.mark.parametrize("entry", list(_not_utf8_entry_points()))
def test_a_path_holding_a_nul_is_named_whole(tmp_path, entry):
    path = str(tmp_path / "model.safetensors\0.bak")
    with pytest.raises(ValueError) as info:
        _not_utf8_entry_points()[entry](path)
    assert str(info.value) == (f"{tmp_path}/model.safetensors\\x00.bak: a path cannot hold a NUL character (\\x00), "
                               "and no file is named so")
