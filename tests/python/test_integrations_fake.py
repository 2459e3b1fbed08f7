"""The fake kernel of `fastsafetensors::load`: FakeTensorMode and torch.compile can trace code
that calls the op (without it, tracing fails outright). make_fx and torch.export cannot: the
op returns its names as `str[]` (the stable ABI has no Dict return) and FX keeps no str
outputs (docs/integrations.md)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import fastsafetensors_rs
import fst_testutils as U

ops = torch.ops.fastsafetensors


@pytest.fixture
def finite_model(tmp_path):
    """Two files of finite values (random bytes would make NaNs, which never compare equal)."""
    shards = [
        {"model.norm.weight": U.finite_tensor(torch.float32, (32,), 1),
         "model.layers.0.input_layernorm.weight": U.finite_tensor(torch.bfloat16, (32,), 2)},
        {"model.layers.1.mlp.gate_proj.bias": U.finite_tensor(torch.float16, (48,), 3),
         "model.ids": torch.arange(5)},
    ]
    return [str(U.write_checkpoint(tmp_path / f"m{i}.safetensors", s)) for i, s in enumerate(shards)]


def _assert_like(fake: dict, real: dict, device: str = "cpu") -> None:
    assert list(fake) == list(real)  # same names, same order
    for name, t in real.items():
        f = fake[name]
        assert isinstance(f, FakeTensor), name
        assert f.dtype == t.dtype, name
        assert f.shape == t.shape, name
        assert f.device == torch.device(device), name


def test_fake_mode_matches_the_real_op_for_every_dtype(all_dtypes_file):
    path, _ = all_dtypes_file
    real = U.op_load([str(path)])
    with FakeTensorMode():
        fake = U.op_load([str(path)])
    _assert_like(fake, real)
    assert any(t.dtype == torch.float4_e2m1fn_x2 for t in real.values())  # the halved last dim


def test_fake_mode_applies_the_dtype_cast_rule(all_dtypes_file, multi_file_model):
    path, _ = all_dtypes_file
    paths = [str(p) for p in multi_file_model[0]]
    for files in ([str(path)], paths):
        real = U.op_load(files, "cpu", torch.float16)
        with FakeTensorMode():
            fake = U.op_load(files, "cpu", torch.float16)
        _assert_like(fake, real)


def test_fake_mode_on_a_cuda_target_needs_no_gpu(multi_file_model):
    paths = [str(p) for p in multi_file_model[0]]
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = U.op_load(paths, "cuda:1", torch.bfloat16)
    real = U.op_load(paths, "cpu", torch.bfloat16)
    _assert_like(fake, real, device="cuda:1")


def test_fake_mode_errors_name_the_file(tmp_path, multi_file_model):
    paths = [str(p) for p in multi_file_model[0]]
    bad = U.write_raw(tmp_path / "bad.safetensors", b"[]")
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match="both"):
            U.op_load([paths[0], paths[0]])
        with pytest.raises(RuntimeError, match=str(bad)):
            U.op_load([str(bad)])
        with pytest.raises(RuntimeError, match="only cpu and cuda"):
            U.op_load(paths, "meta")


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_torch_compile(finite_model, backend):
    paths = finite_model

    def f(x):
        t = U.op_load(paths)
        return (t["model.norm.weight"] * x).sum() + t["model.layers.1.mlp.gate_proj.bias"].float().sum()

    torch._dynamo.reset()
    x = torch.randn(32)
    compiled = torch.compile(f, backend=backend)
    for arg in (x, x * 2):
        if backend == "inductor":  # generated kernels may sum in another order
            torch.testing.assert_close(compiled(arg), f(arg))
        else:
            assert torch.equal(compiled(arg), f(arg))


def test_non_tensor_ops_run_under_fake_mode(multi_file_model):
    path = str(multi_file_model[0][0])
    with FakeTensorMode():
        names, dtypes, shapes, meta_keys, meta_values = ops.describe(path)
        keys = ops.keys(path)
        md = U.op_metadata(path)
    assert keys == sorted(names) and len(dtypes) == len(shapes) == len(names)
    assert md == (None if meta_keys is None else dict(zip(meta_keys, meta_values)))
    assert fastsafetensors_rs.load_file(path).keys() == set(keys)
