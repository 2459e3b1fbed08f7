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
