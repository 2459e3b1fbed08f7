"""transformers' from_pretrained through fastsafetensors: small random Llama, GPT-2 and BERT
models saved with save_pretrained (sharded and not) load bit-identically to stock loading.

This file runs under the transformers installed in the environment (5.x) and, through
`test_transformers_4_in_a_subprocess`, once more under transformers 4.57 from `.tf4/`
(installed by `make tf4`, part of `make test`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastsafetensors_rs  # noqa: E402
import fastsafetensors_rs.api as fst_api  # noqa: E402
import fst_testutils as U  # noqa: E402
from fastsafetensors_rs import transformers_patch as tp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TF4_DIR = ROOT / ".tf4"
ENV_EXPECT = "FASTSAFETENSORS_TEST_TRANSFORMERS"  # set for the 4.57 run
MAJOR = int(transformers.__version__.split(".")[0])


# ------------------------------------------------------------------------ fixtures


def _config_and_class(arch: str):
    common = dict(vocab_size=96, max_position_embeddings=64)
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, **common)
        return cfg, transformers.LlamaForCausalLM, torch.bfloat16
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64)
        return cfg, transformers.GPT2LMHeadModel, torch.float32
    if arch == "bert":
        cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, **common)
        return cfg, transformers.BertModel, torch.float16
    raise ValueError(arch)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """{(arch, sharded): (directory, model class)}: random models saved once per module."""
    out = {}
    root = tmp_path_factory.mktemp("hf")
    for i, arch in enumerate(("llama", "gpt2", "bert")):
        cfg, cls, dtype = _config_and_class(arch)
        torch.manual_seed(100 + i)
        model = cls(cfg).to(dtype)
        for sharded in (False, True):
            d = root / f"{arch}-{'sharded' if sharded else 'single'}"
            kwargs = {"max_shard_size": "20KB"} if sharded else {}
            model.save_pretrained(str(d), **kwargs)
            out[(arch, sharded)] = (d, cls)
    return out


@pytest.fixture
def load_calls(monkeypatch):
    """Records every read of files the loader starts (the files of each call): bulk loads,
    and the streams a handle reads its tensors with on the CPU."""
    calls: list[list[str]] = []
    real_load, real_stream = fst_api.load, fst_api._open_stream

    def spy(files, *args, **kwargs):
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        calls.append([os.fspath(f) for f in files])
        return real_load(files, *args, **kwargs)

    def stream_spy(paths, *args):
        calls.append(list(paths))
        return real_stream(paths, *args)

    monkeypatch.setattr(fst_api, "load", spy)
    monkeypatch.setattr(fst_api, "_open_stream", stream_spy)
    return calls


@pytest.fixture(autouse=True)
def _always_unpatched():
    fastsafetensors_rs.unpatch_transformers()
    yield
    fastsafetensors_rs.unpatch_transformers()


def _inputs(arch):
    ids = torch.arange(12).reshape(1, 12) % 90 + 3
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _assert_identical(stock, ours, arch):
    sd_stock, sd_ours = stock.state_dict(), ours.state_dict()
    assert sorted(sd_stock) == sorted(sd_ours)
    for name, t in sd_stock.items():
        got = sd_ours[name]
        assert got.device == t.device, name
        U.assert_same_tensor(got, t, name)
    with torch.no_grad():
        out_stock = stock(**_inputs(arch))
        out_ours = ours(**_inputs(arch))
    key = "logits" if hasattr(out_stock, "logits") else "last_hidden_state"
    assert torch.equal(getattr(out_ours, key), getattr(out_stock, key))


def _shards(directory):
    return sorted(str(p) for p in Path(directory).glob("*.safetensors"))


# ------------------------------------------------------------------------ from_pretrained


def test_version_under_test():
    expected = os.environ.get(ENV_EXPECT)
    if expected:
        assert transformers.__version__.startswith(expected), transformers.__version__
    assert MAJOR in (4, 5)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_from_pretrained_is_bit_identical(saved_models, load_calls, arch, sharded):
    directory, cls = saved_models[(arch, sharded)]
    assert (directory / "model.safetensors.index.json").exists() == sharded
    stock = cls.from_pretrained(str(directory))
    assert not load_calls
    with fastsafetensors_rs.patched_transformers():
        ours = cls.from_pretrained(str(directory))
    _assert_identical(stock, ours, arch)
    # Every shard was read by the loader, each once (one stream or one bulk read).
    loaded = sorted(f for call in load_calls for f in call)
    assert loaded == _shards(directory)
    assert all(len(call) == 1 for call in load_calls)
    if sharded:
        assert len(loaded) > 1


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}], ids=["cpu", "auto", "dict"])
def test_device_map_on_cpu(saved_models, load_calls, device_map):
    pytest.importorskip("accelerate")
    directory, cls = saved_models[("llama", True)]
    stock = cls.from_pretrained(str(directory), device_map=device_map)
    with fastsafetensors_rs.patched_transformers():
        ours = cls.from_pretrained(str(directory), device_map=device_map)
    _assert_identical(stock, ours, "llama")
    assert {p.device.type for p in ours.parameters()} == {"cpu"}
    assert sorted(f for c in load_calls for f in c) == _shards(directory)


@pytest.mark.parametrize("kwarg", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "auto"], ids=str)
def test_dtype_conversion(saved_models, load_calls, kwarg, dtype):
    directory, cls = saved_models[("llama", True)]  # saved as bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch_dtype is deprecated in favour of dtype
        stock = cls.from_pretrained(str(directory), **{kwarg: dtype})
        with fastsafetensors_rs.patched_transformers():
            ours = cls.from_pretrained(str(directory), **{kwarg: dtype})
    want = torch.bfloat16 if dtype == "auto" else dtype
    assert {p.dtype for p in ours.parameters()} == {want}
    _assert_identical(stock, ours, "llama")
    assert load_calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device_map", ["cuda", "auto"])
def test_device_map_cuda(saved_models, load_calls, device_map):
    pytest.importorskip("accelerate")
    directory, cls = saved_models[("llama", True)]
    stock = cls.from_pretrained(str(directory), device_map=device_map)
    with fastsafetensors_rs.patched_transformers():
        ours = cls.from_pretrained(str(directory), device_map=device_map)
    assert {p.device.type for p in ours.parameters()} == {"cuda"}
    sd_stock, sd_ours = stock.state_dict(), ours.state_dict()
    for name, t in sd_stock.items():
        assert sd_ours[name].device == t.device
        U.assert_same_tensor(sd_ours[name].cpu(), t.cpu(), name)
    assert sorted(f for c in load_calls for f in c) == _shards(directory)


def test_load_sharded_checkpoint(saved_models, load_calls):
    """Trainer's resume path: `load_sharded_checkpoint` reads whole shards with load_file."""
    fn = getattr(transformers.modeling_utils, "load_sharded_checkpoint", None)
    if fn is None:
        fn = transformers.trainer_utils.load_sharded_checkpoint
    directory, cls = saved_models[("llama", True)]
    cfg = cls.config_class.from_pretrained(str(directory))
    torch.manual_seed(0)
    stock = cls(cfg).to(torch.bfloat16)
    torch.manual_seed(1)
    ours = cls(cfg).to(torch.bfloat16)
    fn(stock, str(directory))
    with fastsafetensors_rs.patched_transformers():
        fn(ours, str(directory))
    _assert_identical(stock, ours, "llama")
    assert sorted(f for c in load_calls for f in c) == _shards(directory)


def test_a_corrupt_shard_is_reported_by_name(saved_models, tmp_path):
    directory, cls = saved_models[("llama", True)]
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in directory.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    victim = sorted(broken.glob("*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-8])  # data no longer ends at the end of the file
    with fastsafetensors_rs.patched_transformers():
        with pytest.raises(Exception) as info:
            cls.from_pretrained(str(broken))
    assert str(victim) in str(info.value)


# ------------------------------------------------------------------------ the handle


def test_opening_reads_only_the_header_and_the_first_access_reads_the_file(saved_models, load_calls):
    directory, _ = saved_models[("llama", False)]
    path = str(directory / "model.safetensors")
    with fastsafetensors_rs.patched_transformers():
        opener = transformers.modeling_utils.safe_open
        f = opener(path, framework="pt", device="cpu", backend="mmap")
        assert isinstance(f, tp.PatchedSafeOpen)
        from safetensors import safe_open as st_open
        with st_open(path, framework="pt") as ref:
            assert f.keys() == sorted(ref.keys())
            assert f.offset_keys() == list(ref.offset_keys())
            assert f.metadata() == ref.metadata()
            slices = {k: f.get_slice(k) for k in f.keys()}
            for k, s in slices.items():
                assert s.get_shape() == ref.get_slice(k).get_shape()
                assert s.get_dtype() == ref.get_slice(k).get_dtype()
            assert load_calls == []  # header only so far
            for k, s in slices.items():
                U.assert_same_tensor(s[...], ref.get_tensor(k), k)
            row = next(k for k in slices if len(slices[k].get_shape()) == 2)
            U.assert_same_tensor(slices[row][1:3, :5], ref.get_slice(row)[1:3, :5], row)
            got_all = f.get_tensors()
            assert list(got_all) == list(ref.offset_keys())
        assert load_calls == [[path]]  # one read of the file, whatever was asked after it
        f.__exit__(None, None, None)


def test_concurrent_first_access_loads_the_file_once(tmp_path, load_calls):
    tensors = {f"t{i}": U.finite_tensor(torch.float32, (256, 256), i) for i in range(16)}
    path = U.write_checkpoint(tmp_path / "big.safetensors", tensors)
    handle = tp.PatchedSafeOpen(path)
    barrier = threading.Barrier(8)
    results, errors = {}, []

    def worker(i):
        try:
            barrier.wait()
            for k in list(tensors)[i::8]:
                results[k] = handle.get_slice(k)[...]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert load_calls == [[str(path)]]
    U.assert_same_dict(results, tensors)


def test_requests_the_loader_cannot_serve_go_to_safetensors(saved_models, load_calls):
    directory, _ = saved_models[("llama", False)]
    path = str(directory / "model.safetensors")
    with fastsafetensors_rs.patched_transformers():
        opener = transformers.modeling_utils.safe_open
        handle = opener(path, framework="numpy")
        assert not isinstance(handle, tp.PatchedSafeOpen)
        assert handle.keys()
        handle = opener(path, framework="pt", device="mps")  # a device the loader has not
        assert not isinstance(handle, tp.PatchedSafeOpen)
        assert isinstance(opener(path, framework="pt", device="cpu"), tp.PatchedSafeOpen)
    assert load_calls == []


def test_loader_options_reach_the_loader(saved_models, load_calls, monkeypatch):
    directory, cls = saved_models[("gpt2", False)]
    seen = []
    real = fst_api._open_stream

    def spy(paths, device, reader, *rest):
        seen.append(reader)
        return real(paths, device, reader, *rest)

    monkeypatch.setattr(fst_api, "_open_stream", spy)
    with fastsafetensors_rs.patched_transformers(reader="mmap"):
        cls.from_pretrained(str(directory))
    assert seen == ["mmap"]


def test_weights_from_a_url_with_the_configuration_from_a_folder(saved_models, tmp_path, load_calls):
    """`weights=`: the configuration from a folder without weights, the weight files from an
    HTTP server with range support (one file; shards through their index URL)."""
    from remote_servers import FileServer

    root = saved_models[("llama", False)][0].parent
    with FileServer(root) as server:
        for sharded, rel in ((False, "llama-single/model.safetensors"),
                             (True, "llama-sharded/model.safetensors.index.json")):
            directory, cls = saved_models[("llama", sharded)]
            config_only = tmp_path / f"config-{sharded}"
            config_only.mkdir()
            (config_only / "config.json").write_bytes((directory / "config.json").read_bytes())
            stock = cls.from_pretrained(str(directory))
            load_calls.clear()
            with fastsafetensors_rs.patched_transformers(weights=f"{server.url}/{rel}"):
                ours = cls.from_pretrained(str(config_only))
            _assert_identical(stock, ours, "llama")
            read = sorted({f for call in load_calls for f in call})
            assert read == sorted(f"{server.url}/{directory.name}/{Path(f).name}" for f in _shards(directory)), read
            # Out of the block, the folder's own (absent) weights are looked for again.
            with pytest.raises(OSError):
                cls.from_pretrained(str(config_only))
    with pytest.raises(TypeError, match="weights= takes a URL or a path"):
        fastsafetensors_rs.patch_transformers(weights=3)


# ------------------------------------------------------------------------ patch state


def _current():
    return {(m, a): getattr(__import__(m, fromlist=[a]), a)
            for m, a, _ in tp.PATCH_POINTS if hasattr(__import__(m, fromlist=[a]), a)}


def test_patch_and_unpatch_restore_the_originals():
    import safetensors
    import safetensors.torch

    before = _current()
    assert transformers.modeling_utils.safe_open is safetensors.safe_open
    patched = fastsafetensors_rs.patch_transformers()
    assert "transformers.modeling_utils.safe_open" in patched
    if MAJOR >= 5:
        assert "transformers.modeling_layers.safe_open" in patched
    else:
        assert "transformers.modeling_utils.safe_load_file" in patched
    assert fastsafetensors_rs.patch_transformers() == patched  # idempotent
    assert all(getattr(v, "_fastsafetensors", False) for v in _current().values())
    assert tp.is_transformers_patched()
    fastsafetensors_rs.unpatch_transformers()
    assert _current() == before
    assert transformers.modeling_utils.safe_open is safetensors.safe_open
    assert not tp.is_transformers_patched()
    fastsafetensors_rs.unpatch_transformers()  # a second unpatch is a no-op
    assert _current() == before


def test_context_manager_restores_the_previous_state():
    before = _current()
    with fastsafetensors_rs.patched_transformers():
        assert tp.is_transformers_patched()
    assert _current() == before
    with pytest.raises(KeyError):
        with fastsafetensors_rs.patched_transformers():
            raise KeyError("boom")
    assert _current() == before
    # Inside a global patch, leaving the block keeps the global patch.
    fastsafetensors_rs.patch_transformers(reader="direct")
    patched = _current()
    with fastsafetensors_rs.patched_transformers(reader="mmap"):
        assert tp._options == {"reader": "mmap"}
    assert _current() == patched
    assert tp._options == {"reader": "direct"}


# ------------------------------------------------------------------------ save_pretrained


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("sharded", [False, True])
def test_save_pretrained_under_the_patch_writes_the_stock_files(tmp_path, monkeypatch, arch, sharded):
    """save_pretrained writes each shard through fastsafetensors_rs.save_file under the patch,
    and the directory it leaves is the stock one, byte for byte (shards, index, config)."""
    from fastsafetensors_rs import saving

    cfg, cls, dtype = _config_and_class(arch)
    torch.manual_seed(7)
    model = cls(cfg).to(dtype)
    kwargs = {"max_shard_size": "20KB"} if sharded else {}
    model.save_pretrained(str(tmp_path / "stock"), **kwargs)
    written = []
    real = saving.save_file

    def spy(tensors, filename, *args, **kw):
        written.append(os.path.basename(os.fspath(filename)))
        return real(tensors, filename, *args, **kw)

    monkeypatch.setattr(saving, "save_file", spy)
    with fastsafetensors_rs.patched_transformers():
        model.save_pretrained(str(tmp_path / "ours"), **kwargs)
    stock = sorted(p.name for p in (tmp_path / "stock").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == stock
    assert sorted(written) == [n for n in stock if n.endswith(".safetensors")]
    assert len(written) > 1 if sharded else len(written) == 1
    for name in stock:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "stock" / name).read_bytes(), name


# ------------------------------------------------------------------------ transformers 4.57


@pytest.mark.skipif(bool(os.environ.get(ENV_EXPECT)), reason="already the 4.57 run")
def test_transformers_4_in_a_subprocess():
    """The same tests under transformers 4.57 (.tf4/, installed by `make tf4`)."""
    if not (TF4_DIR / "transformers").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{TF4_DIR} is missing: `make test` installs it (`make tf4`)")
        pytest.skip(f"transformers 4.57 is not installed in {TF4_DIR} (run `make tf4`)")
    env = U.subprocess_env({ENV_EXPECT: "4.57"})
    env["PYTHONPATH"] = os.pathsep.join([str(TF4_DIR), env["PYTHONPATH"]])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x"],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
