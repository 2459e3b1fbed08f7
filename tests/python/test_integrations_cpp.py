"""Deployment without Python code: the C++ example (examples/cpp) calls the op through the
dispatcher after dlopen-ing the extension, and the TorchScript deployment example runs its
scripted module in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastsafetensors_rs
import fst_testutils as U

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "cpp" / "load.cpp"

# c10's names of the dtypes used below (what `<<` prints for a ScalarType).
C10_NAMES = {
    torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float64: "Double",
    torch.int64: "Long", torch.int32: "Int", torch.uint8: "Byte", torch.bool: "Bool",
    torch.float8_e4m3fn: "Float8_e4m3fn",
}


@pytest.fixture(scope="module")
def fst_load(tmp_path_factory):
    """The example, compiled as `make cpp-example` compiles it (against the torch wheel)."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    torch_dir = Path(torch.__file__).parent
    exe = tmp_path_factory.mktemp("cpp") / "fst_load"
    cmd = [cxx, "-std=c++20", "-O1", f"-I{torch_dir / 'include'}", str(SOURCE), "-o", str(exe),
           f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


def _run(exe, *args, env=None):
    # No PYTHONPATH and no Python: the program needs only libtorch and the extension library.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    clean.update(env or {})
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=clean, timeout=120)


def _byte_sum(t: torch.Tensor) -> int:
    return int(U.as_bytes(t).to(torch.int64).sum())


@pytest.fixture
def checkpoint(tmp_path):
    shards = [
        {"w": U.finite_tensor(torch.bfloat16, (16, 8), 1), "b": U.finite_tensor(torch.float32, (8,), 2),
         "ids": torch.arange(10, dtype=torch.int64), "mask": torch.tensor([True, False, True])},
        {"f8": U.random_tensor(torch.float8_e4m3fn, (4, 4), 3), "h": U.finite_tensor(torch.float16, (3, 5), 4),
         "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros((0, 4), dtype=torch.int32)},
    ]
    paths = [str(U.write_checkpoint(tmp_path / f"m{i}.safetensors", s)) for i, s in enumerate(shards)]
    return paths, {k: v for s in shards for k, v in s.items()}


def _parse(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("reader", [None, "direct", "mmap"])
def test_cpp_program_loads_what_python_loads(fst_load, checkpoint, reader):
    paths, tensors = checkpoint
    env = {"FASTSAFETENSORS_READER": reader} if reader else {}
    proc = _run(fst_load, fastsafetensors_rs.LIBRARY_PATH, *paths, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = _parse(proc.stdout)
    assert [r["name"] for r in rows] == list(fastsafetensors_rs.load(paths))  # same order too
    for r in rows:
        t = tensors[r["name"]]
        assert r["dtype"] == C10_NAMES[t.dtype], r
        assert r["shape"] == list(t.shape), r
        assert r["device"] == "cpu"
        assert r["byte_sum"] == _byte_sum(t), r


def test_cpp_program_casts_with_dtype(fst_load, checkpoint):
    paths, tensors = checkpoint
    proc = _run(fst_load, "--dtype", "float32", fastsafetensors_rs.LIBRARY_PATH, *paths)
    assert proc.returncode == 0, proc.stderr
    for r in _parse(proc.stdout):
        t = tensors[r["name"]]
        want = t.float() if t.dtype in (torch.bfloat16, torch.float16, torch.float64) else t
        assert r["dtype"] == C10_NAMES[want.dtype] and r["byte_sum"] == _byte_sum(want), r


def test_cpp_program_reports_errors(fst_load, checkpoint, tmp_path):
    paths, _ = checkpoint
    missing = tmp_path / "missing.safetensors"
    proc = _run(fst_load, fastsafetensors_rs.LIBRARY_PATH, paths[0], missing)
    assert proc.returncode == 1 and str(missing) in proc.stderr
    proc = _run(fst_load, tmp_path / "no_such_library.so", paths[0])
    assert proc.returncode == 1 and "cannot load" in proc.stderr
    proc = _run(fst_load, fastsafetensors_rs.LIBRARY_PATH)
    assert proc.returncode == 2 and "usage" in proc.stderr
    if not torch.cuda.is_available():
        proc = _run(fst_load, "--device", "cuda", fastsafetensors_rs.LIBRARY_PATH, paths[0])
        assert proc.returncode == 1 and "cuda" in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpp_program_loads_to_cuda(fst_load, checkpoint):
    paths, tensors = checkpoint
    proc = _run(fst_load, "--device", "cuda:0", fastsafetensors_rs.LIBRARY_PATH, *paths)
    assert proc.returncode == 0, proc.stderr
    for r in _parse(proc.stdout):
        assert r["device"] == "cuda:0" and r["byte_sum"] == _byte_sum(tensors[r["name"]]), r


def test_torchscript_deploy_example(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "torchscript_deploy.py"), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, env=U.subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["identical"] is True
    assert "loaded 4 tensors" in proc.stdout
    assert (tmp_path / "deployed.pt").exists() and (tmp_path / "mlp.safetensors").exists()
