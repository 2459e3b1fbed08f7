"""Arguments and settings a load refuses, each in one line: a `dtype=` that is no
floating-point cast, a device that is not "cpu" or "cuda[:N]", and every malformed
FASTSAFETENSORS_* variable."""

from __future__ import annotations

import re

import pytest
import torch

import fastsafetensors_rs
import fst_testutils as U
from fastsafetensors_rs import cli

ops = torch.ops.fastsafetensors

WEIGHTS = {
    "w.f32": U.finite_tensor(torch.float32, (16, 8), 1),
    "w.bf16": U.finite_tensor(torch.bfloat16, (8,), 2),
    "ids": torch.arange(6),
    "scale.f8": U.random_tensor(torch.float8_e4m3fn, (4,), 3),
}


@pytest.fixture
def model(tmp_path):
    return U.write_checkpoint(tmp_path / "model.safetensors", WEIGHTS)


def one_line_error(errors, call, *args, **kwargs) -> str:
    with pytest.raises(errors) as info:
        call(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and "Declaration" not in msg, msg
    return msg


# ---------------------------------------------------------------- dtype=


def refused_cast(name: str) -> str:
    return (f"dtype={name} is not supported: dtype= casts floating-point tensors (F16, BF16, F32, F64) to "
            "torch.float16, torch.bfloat16, torch.float32 or torch.float64 and leaves the others as stored; "
            f"convert to {name} yourself (tensor.to({name})) if that is what you want")


NOT_CASTS = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn,
             torch.float8_e5m2, torch.complex64]


@pytest.mark.parametrize("dtype", NOT_CASTS, ids=str)
def test_a_cast_to_a_non_float_dtype_is_refused(model, dtype):
    msg = refused_cast(str(dtype))
    assert one_line_error(ValueError, fastsafetensors_rs.load_file, model, dtype=dtype) == msg
    assert one_line_error(ValueError, fastsafetensors_rs.load, [model], dtype=str(dtype)) == msg
    assert one_line_error(ValueError, lambda: list(fastsafetensors_rs.weights_iterator([model], dtype=dtype))) == msg
    # The op, as TorchScript and C++ call it.
    assert one_line_error(RuntimeError, ops.load, [str(model)], "cpu", dtype) == "fastsafetensors: " + msg


def test_the_int8_cast_that_used_to_return_zeros(tmp_path):
    """The cast used to run: weights of a usual scale (std 0.02) became all zeros."""
    torch.manual_seed(0)
    weights = {"q_proj.weight": torch.randn(64, 64, dtype=torch.bfloat16) * 0.02}
    path = U.write_checkpoint(tmp_path / "small_weights.safetensors", weights)
    assert weights["q_proj.weight"].to(torch.int8).count_nonzero() == 0
    with pytest.raises(ValueError, match=re.escape(refused_cast("torch.int8"))):
        fastsafetensors_rs.load_file(path, dtype=torch.int8)


def test_the_compatible_api_refuses_the_same_casts(model):
    for dtype in (fastsafetensors_rs.DType.I8, torch.int8, "I8", "int8", fastsafetensors_rs.DType.F8_E4M3):
        loader = fastsafetensors_rs.SafeTensorsFileLoader(fastsafetensors_rs.SingleGroup(), "cpu")
        loader.add_filenames({0: [str(model)]})
        msg = one_line_error(ValueError, loader.copy_files_to_device, dtype=dtype)
        assert msg.startswith("dtype=torch.") and "is not supported: dtype= casts floating-point" in msg, msg
    # Its per-tensor conversion stays explicit and unrestricted, as in fastsafetensors 0.5.
    loader = fastsafetensors_rs.SafeTensorsFileLoader(fastsafetensors_rs.SingleGroup(), "cpu")
    loader.add_filenames({0: [str(model)]})
    fb = loader.copy_files_to_device(dtype="bfloat16")
    assert fb.get_tensor("w.f32").dtype == torch.bfloat16
    assert torch.equal(fb.get_tensor("ids", dtype=torch.int32), WEIGHTS["ids"].to(torch.int32))


def test_the_fake_kernel_refuses_them_too(model):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        msg = one_line_error(RuntimeError, ops.load, [str(model)], "cpu", torch.int8)
    assert msg == "fastsafetensors: " + refused_cast("torch.int8")


@pytest.mark.parametrize("name, dtype", [
    ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
    ("bf16", torch.bfloat16), ("float16", torch.float16), ("half", torch.float16), ("F32", torch.float32),
    ("float", torch.float32), ("torch.float64", torch.float64), (torch.float16, torch.float16),
])
def test_dtype_by_name(model, name, dtype):
    got = fastsafetensors_rs.load_file(model, dtype=name)
    assert torch.equal(got["w.f32"], WEIGHTS["w.f32"].to(dtype))
    assert torch.equal(got["w.bf16"], WEIGHTS["w.bf16"].to(dtype))
    # Integers and quantised payloads keep their dtype.
    assert got["ids"].dtype == torch.int64 and got["scale.f8"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["bf", "float128", "torch.tensor", ""])
def test_a_name_that_is_no_dtype(model, name):
    assert one_line_error(ValueError, fastsafetensors_rs.load_file, model, dtype=name) == (
        f"dtype={name!r} names no dtype: use a torch.dtype or a name such as 'bfloat16' "
        "(dtype= takes torch.float16, torch.bfloat16, torch.float32 or torch.float64)")
    assert one_line_error(TypeError, fastsafetensors_rs.load_file, model, dtype=16) == (
        "dtype must be a torch.dtype or its name, not int")


# ---------------------------------------------------------------- device=


BAD_DEVICES = {
    "cpu:1": "fastsafetensors: cannot load to device 'cpu:1': there is one CPU device, 'cpu'",
    "cuda:x": "fastsafetensors: cannot load to device 'cuda:x': not a device name (use 'cpu', 'cuda' or 'cuda:N')",
    "cuda:-1": "fastsafetensors: cannot load to device 'cuda:-1': not a device name (use 'cpu', 'cuda' or 'cuda:N')",
    "gpu": "fastsafetensors: cannot load to device 'gpu': not a device name (use 'cpu', 'cuda' or 'cuda:N')",
    "meta": "fastsafetensors: cannot load to device 'meta' (only cpu and cuda)",
    "mps": "fastsafetensors: cannot load to device 'mps' (only cpu and cuda)",
}


@pytest.mark.parametrize("device", list(BAD_DEVICES))
def test_a_device_that_is_not_cpu_or_cuda_is_refused(model, device):
    msg = BAD_DEVICES[device]
    assert one_line_error(ValueError, fastsafetensors_rs.load_file, model, device=device) == msg
    assert one_line_error(ValueError, fastsafetensors_rs.safe_open, model, device=device) == msg  # at open
    assert one_line_error(ValueError, lambda: list(fastsafetensors_rs.weights_iterator([model], device=device))) == msg
    assert one_line_error(RuntimeError, ops.load, [str(model)], device) == msg


def test_odd_device_objects(model):
    assert one_line_error(ValueError, fastsafetensors_rs.load_file, model, device=torch.device("cpu", 1)) == (
        BAD_DEVICES["cpu:1"])
    assert one_line_error(ValueError, fastsafetensors_rs.load_file, model, device=-1) == (
        "device=-1: a CUDA device index is 0 or more")
    assert one_line_error(TypeError, fastsafetensors_rs.load_file, model, device=True) == (
        "device must be a string, an index or a torch.device, not bool")
    assert one_line_error(ValueError, fastsafetensors_rs.SafeTensorsFileLoader, None, "cpu:1") == BAD_DEVICES["cpu:1"]
    # "cpu:0" is the CPU, as in torch.
    U.assert_same_dict(fastsafetensors_rs.load_file(model, device="cpu:0"), WEIGHTS)


# ---------------------------------------------------------------- FASTSAFETENSORS_* settings

CORE_SETTINGS = {
    ("FASTSAFETENSORS_THREADS", "abc"): "a whole number of threads from 1 to 1024",
    ("FASTSAFETENSORS_THREADS", "0"): "a whole number of threads from 1 to 1024",
    ("FASTSAFETENSORS_THREADS", "-4"): "a whole number of threads from 1 to 1024",
    ("FASTSAFETENSORS_THREADS", "100000"): "a whole number of threads from 1 to 1024",
    ("FASTSAFETENSORS_READER", "fast"): "auto, direct or mmap",
    ("FASTSAFETENSORS_MAX_HOST_MEMORY", "lots"): "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'",
    ("FASTSAFETENSORS_MAX_HOST_MEMORY", "-1"): "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'",
    ("FASTSAFETENSORS_MAX_MEMORY", "256 megs"): "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'",
    ("FASTSAFETENSORS_REMOTE_PART_SIZE", "tiny"): "a size from 64K to 1G (e.g. 8M)",
    ("FASTSAFETENSORS_REMOTE_PART_SIZE", "4K"): "a size from 64K to 1G (e.g. 8M)",
    ("FASTSAFETENSORS_REMOTE_CONCURRENCY", "0"): "a whole number from 1 to 1024",
    ("FASTSAFETENSORS_REMOTE_TIMEOUT", "forever"): "a whole number of seconds from 1 to 3600",
    ("FASTSAFETENSORS_REMOTE_RETRIES", "-1"): "a whole number from 0 to 100",
    ("FASTSAFETENSORS_CACHE_DIR", "/dev/null/cache"): "a directory that exists or can be created",
    ("FASTSAFETENSORS_MAX_MEMORY", "1.5G"): "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'",
    ("FASTSAFETENSORS_CUFILE", "/no/such/libcufile.so.0"): "the path of an existing cuFile library (libcufile.so.0)",
}
PY_SETTINGS = {
    ("FASTSAFETENSORS_PROGRESS", "maybe"): "1, true, yes, on or 0, false, no, off",
    ("FASTSAFETENSORS_LOG", "chatty"): "one of critical, debug, error, info, warn, warning",
}


def setting_error(var, value, expected) -> str:
    default = "no logging" if var == "FASTSAFETENSORS_LOG" else "the default"
    return f"{var}='{value}' is not valid: expected {expected} (or unset it for {default})"


@pytest.mark.parametrize("var, value", list(CORE_SETTINGS))
@pytest.mark.parametrize("reader", ["mmap", "direct"])
def test_a_malformed_core_setting_fails_every_load(model, monkeypatch, var, value, reader):
    """Whatever the load would read: a warm mmap load that starts no I/O thread fails on a
    bad thread count too, and an explicit reader does not hide a bad $FASTSAFETENSORS_READER."""
    monkeypatch.setenv(var, value)
    msg = setting_error(var, value, CORE_SETTINGS[(var, value)])
    assert one_line_error(RuntimeError, fastsafetensors_rs.load_file, model, reader=reader) == msg
    assert one_line_error(RuntimeError, ops.load, [str(model)], "cpu", None, reader) == msg


@pytest.mark.parametrize("var, value", list(PY_SETTINGS))
def test_a_malformed_python_setting_fails_every_load(model, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    msg = setting_error(var, value, PY_SETTINGS[(var, value)])
    assert one_line_error(ValueError, fastsafetensors_rs.load_file, model) == msg
    assert one_line_error(ValueError, lambda: list(fastsafetensors_rs.weights_iterator([model]))) == msg


@pytest.mark.parametrize("var, value", [("FASTSAFETENSORS_THREADS", " 4 "), ("FASTSAFETENSORS_THREADS", ""),
                                        ("FASTSAFETENSORS_READER", "direct"),
                                        ("FASTSAFETENSORS_MAX_HOST_MEMORY", "64G"),
                                        ("FASTSAFETENSORS_MAX_HOST_MEMORY", "unlimited"),
                                        ("FASTSAFETENSORS_MAX_MEMORY", "256MiB"),
                                        ("FASTSAFETENSORS_PROGRESS", "off"), ("FASTSAFETENSORS_LOG", "warning"),
                                        ("FASTSAFETENSORS_CUFILE", "libcufile.so.0")])
def test_well_formed_settings_load(model, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    U.assert_same_dict(fastsafetensors_rs.load_file(model), WEIGHTS)


def test_a_malformed_log_level_does_not_break_the_import(model):
    proc = U.run_python(
        """
        import sys, fastsafetensors_rs
        try:
            fastsafetensors_rs.load_file(sys.argv[1])
        except ValueError as e:
            print("refused:", e)
        """, model, env={"FASTSAFETENSORS_LOG": "chatty"})
    out = U.check_output(proc)
    assert out.strip() == "refused: " + setting_error("FASTSAFETENSORS_LOG", "chatty", PY_SETTINGS[
        ("FASTSAFETENSORS_LOG", "chatty")])


@pytest.mark.parametrize("var, value", list(CORE_SETTINGS)[:1] + list(CORE_SETTINGS)[4:] + list(PY_SETTINGS))
def test_the_cli_names_a_malformed_setting(model, monkeypatch, capsys, var, value):
    monkeypatch.setenv(var, value)
    expected = {**CORE_SETTINGS, **PY_SETTINGS}[(var, value)]
    for command in ("inspect", "verify"):
        assert cli.main([command, str(model)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == f"python -m fastsafetensors_rs {command}: {setting_error(var, value, expected)}\n"


# ---------------------------------------------------------------- the loaders' own arguments


def _compat_loader(path, **kwargs):
    loader = fastsafetensors_rs.SafeTensorsFileLoader(fastsafetensors_rs.SingleGroup(), "cpu", **kwargs)
    loader.add_filenames({0: [path]})
    return loader.copy_files_to_device()


# Every public way to load, called with `kwargs` added; each returns once its loading started.
ENTRY_POINTS = {
    "load_file": lambda p, **kw: fastsafetensors_rs.load_file(p, **kw),
    "load": lambda p, **kw: fastsafetensors_rs.load([p], **kw),
    "stream": lambda p, **kw: fastsafetensors_rs.stream(p, **kw),
    "weights_iterator": lambda p, **kw: fastsafetensors_rs.weights_iterator([p], **kw),
    "safe_open": lambda p, **kw: fastsafetensors_rs.safe_open(p, **kw),
    "SafeTensorsFileLoader": lambda p, **kw: fastsafetensors_rs.SafeTensorsFileLoader(
        fastsafetensors_rs.SingleGroup(), "cpu", **kw),
    "ParallelLoader": lambda p, **kw: fastsafetensors_rs.ParallelLoader(fastsafetensors_rs.SingleGroup(), [p], **kw),
}
TAKES_NOGDS = {"load_file", "load", "weights_iterator", "safe_open"}
TAKES_MAX_MEMORY = {"stream", "weights_iterator", "safe_open"}

READER_EXPECTED = "expected 'auto', 'direct' or 'mmap' (or None: $FASTSAFETENSORS_READER, else 'auto')"
BAD_ARGUMENTS = {
    "reader='fast'": ({"reader": "fast"}, ValueError, "reader='fast' is not valid: " + READER_EXPECTED),
    "reader=''": ({"reader": ""}, ValueError, "reader='' is not valid: " + READER_EXPECTED),
    "reader=5": ({"reader": 5}, TypeError, "reader must be a string or None, not int"),
    "nogds='x'": ({"nogds": "x"}, TypeError, "nogds must be True, False or None, not str"),
    "max_memory='abc'": ({"max_memory": "abc"}, ValueError,
                         "max_memory='abc' is not valid: expected bytes with an optional K/M/G/T suffix (e.g. 64G), "
                         "or 'unlimited'"),
    "max_memory=''": ({"max_memory": ""}, ValueError,
                      "max_memory='' is not valid: expected bytes with an optional K/M/G/T suffix (e.g. 64G), "
                      "or 'unlimited' (or None for the default)"),
    "max_memory=' '": ({"max_memory": " "}, ValueError,
                       "max_memory=' ' is not valid: expected bytes with an optional K/M/G/T suffix (e.g. 64G), "
                       "or 'unlimited' (or None for the default)"),
    "max_memory=2**70": ({"max_memory": 2**70}, ValueError,
                         f"max_memory={2**70} is not valid: at most {2**64 - 1} bytes (or 'unlimited')"),
}


def _takes(entry, kwargs) -> bool:
    return (("nogds" not in kwargs or entry in TAKES_NOGDS)
            and ("max_memory" not in kwargs or entry in TAKES_MAX_MEMORY))


@pytest.mark.parametrize("entry, case", [(e, c) for e in ENTRY_POINTS for c, (kwargs, _, _) in BAD_ARGUMENTS.items()
                                         if _takes(e, kwargs)])
def test_a_malformed_argument_is_refused_at_the_call(model, entry, case):
    """A ValueError or TypeError in one line when the function is called, before anything is
    read: never a RuntimeError, a schema dump, or an error deferred to the first read."""
    kwargs, error, msg = BAD_ARGUMENTS[case]
    assert one_line_error(error, ENTRY_POINTS[entry], str(model), **kwargs) == msg


def test_patching_transformers_checks_its_options_at_once():
    pytest.importorskip("transformers")
    from fastsafetensors_rs import transformers_patch as tp

    for call in (fastsafetensors_rs.patch_transformers, lambda **kw: fastsafetensors_rs.patched_transformers(**kw)
                 .__enter__()):
        assert one_line_error(ValueError, call, reader="fast") == "reader='fast' is not valid: " + READER_EXPECTED
        assert one_line_error(TypeError, call, nogds="x") == "nogds must be True, False or None, not str"
        assert not tp.is_transformers_patched()


def test_prefetch_must_be_a_whole_number(model):
    assert one_line_error(TypeError, fastsafetensors_rs.weights_iterator, [model], prefetch="a") == (
        "prefetch must be a whole number of files (int), not str")
    assert one_line_error(ValueError, fastsafetensors_rs.weights_iterator, [model], prefetch=-1) == (
        "prefetch must be >= 0, got -1")


def test_a_bad_pattern_is_a_value_error(model):
    refused = re.escape("tensor_filter pattern 'w\\.(' is not valid")
    with pytest.raises(ValueError, match="^" + refused):
        fastsafetensors_rs.load_file(model, tensor_filter=r"w\.(", tensor_name_match_mode="regex")
    with pytest.raises(ValueError, match="^" + refused):
        fastsafetensors_rs.safe_open(model, tensor_filter=r"w\.(", tensor_name_match_mode="regex")
    with pytest.raises(ValueError, match="^" + refused):
        fastsafetensors_rs.stream(model, tensor_filter=[r"w\.("], tensor_name_match_mode="regex")
    # The op, as TorchScript and C++ call it, raises what every op raises.
    with pytest.raises(RuntimeError, match="^invalid argument: " + refused):
        U.op_load([str(model)], tensor_filter=[r"w\.("], tensor_name_match_mode="regex")


SIZES = ["1", "0", "256M", "256 M", " 256mb ", "256MiB", "2g", "2GIB", "1T", "7b", "B", "unlimited", "UNLIMITED ",
         "1.5G", "-1", "+1", "1e9", "lots", "256 megs", "M", "1 KiBB", "16777216T", "16777215T", "18446744073709551615",
         "18446744073709551616", "0x10", "１２", "1\n"]


@pytest.mark.parametrize("size", SIZES)
def test_max_memory_strings_are_checked_by_the_loaders_own_rule(size):
    """The Python check, made when `max_memory=` is given, takes exactly the sizes the op takes."""
    from fastsafetensors_rs import api

    try:
        ops.close_stream(ops.open_stream([], "cpu", None, "auto", None, "glob", size))
        op_takes = True
    except RuntimeError as e:
        assert str(e) == f"invalid argument: max_memory={size!r} is not valid: expected {api.SIZE}"
        op_takes = False
    if op_takes:
        assert api._max_memory(size) == size
    else:
        with pytest.raises(ValueError, match=f"^max_memory={re.escape(repr(size))} is not valid"):
            api._max_memory(size)


def test_good_arguments_still_load(model):
    U.assert_same_dict(fastsafetensors_rs.load_file(model, reader="mmap", nogds=True), WEIGHTS)
    U.assert_same_dict(dict(fastsafetensors_rs.stream(model, max_memory=2**64 - 1)), WEIGHTS)
    U.assert_same_dict(dict(fastsafetensors_rs.stream(model, max_memory=" 1M ")), WEIGHTS)
    U.assert_same_dict(dict(fastsafetensors_rs.weights_iterator(model, reader="direct", prefetch=0)), WEIGHTS)


# ---------------------------------------------------------------- every load checks every setting


def _parallel_loader(path):
    pl = fastsafetensors_rs.ParallelLoader(fastsafetensors_rs.SingleGroup(), [path], use_tqdm_on_load=False)
    try:
        return dict(pl.iterate_weights())
    finally:
        pl.close()


LOADS = {
    "load_file": lambda p: fastsafetensors_rs.load_file(p),
    "stream": lambda p: dict(fastsafetensors_rs.stream(p)),
    "weights_iterator": lambda p: dict(fastsafetensors_rs.weights_iterator(p)),
    "safe_open.get_tensor": lambda p: fastsafetensors_rs.safe_open(p).get_tensor("ids"),
    "safe_open.get_slice": lambda p: fastsafetensors_rs.safe_open(p).get_slice("w.f32")[2:4],
    "safe_open.tensors": lambda p: dict(fastsafetensors_rs.safe_open(p).tensors()),
    "SafeTensorsFileLoader": lambda p: _compat_loader(p).get_tensor("ids"),
    "ParallelLoader": _parallel_loader,
}


@pytest.mark.parametrize("var, value", list(CORE_SETTINGS)[:1] + list(CORE_SETTINGS)[4:] + list(PY_SETTINGS))
@pytest.mark.parametrize("load", list(LOADS))
def test_every_load_checks_every_setting(model, monkeypatch, load, var, value):
    expected = {**CORE_SETTINGS, **PY_SETTINGS}[(var, value)]
    monkeypatch.setenv(var, value)
    error = ValueError if (var, value) in PY_SETTINGS else RuntimeError
    assert one_line_error(error, LOADS[load], str(model)) == setting_error(var, value, expected)
    monkeypatch.delenv(var)
    assert LOADS[load](str(model)) is not None
