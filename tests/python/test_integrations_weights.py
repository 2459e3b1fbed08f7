"""The serving-engine weight iterator (vLLM / SGLang contract) and the vLLM plugin, tested
without vLLM: the plugin against a stand-in package with vLLM's module layout and the
behaviour of its default loader that the plugin relies on."""

from __future__ import annotations

import gc
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs
import fastsafetensors_rs.api as fst_api
import fastsafetensors_rs.progress as fst_progress
import fst_testutils as U
from fastsafetensors_rs import vllm_plugin


@pytest.fixture
def shards(tmp_path):
    """Three shards of finite tensors, as a model directory. Returns (paths, {name: tensor})."""
    d = tmp_path / "model"
    d.mkdir()
    all_tensors = {}
    paths = []
    for i in range(3):
        tensors = {
            f"model.layers.{i}.self_attn.qkv_proj.weight": U.finite_tensor(torch.bfloat16, (48, 16), 10 * i + 1),
            f"model.layers.{i}.mlp.down_proj.weight": U.finite_tensor(torch.float16, (16, 32), 10 * i + 2),
            f"model.layers.{i}.input_layernorm.weight": U.finite_tensor(torch.float32, (16,), 10 * i + 3),
            f"model.layers.{i}.expert_ids": torch.arange(4, dtype=torch.int64) + i,
        }
        paths.append(str(U.write_checkpoint(d / f"model-{i + 1:05d}-of-00003.safetensors", tensors,
                                            metadata={"format": "pt"})))
        all_tensors.update(tensors)
    return paths, all_tensors


# ------------------------------------------------------------------------ the iterator


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_yields_every_checkpoint_tensor_file_by_file(shards, prefetch):
    paths, tensors = shards
    got = list(fastsafetensors_rs.weights_iterator(paths, prefetch=prefetch))
    names = [n for n, _ in got]
    assert sorted(names) == sorted(tensors)
    assert len(names) == len(set(names))
    # File order is kept: every name of shard i comes before those of shard i+1.
    shard_of = [int(n.split(".")[2]) for n in names]
    assert shard_of == sorted(shard_of)
    # Each tensor is what safetensors reads, and owns its memory after the iterator is gone.
    gc.collect()
    ref = {}
    for p in paths:
        ref.update(st_load_file(p))
    U.assert_same_dict(dict(got), ref)


def test_positional_use_like_vllm(shards):
    paths, tensors = shards
    it = fastsafetensors_rs.weights_iterator(paths, False)
    assert iter(it) is it
    name, t = next(it)
    assert isinstance(name, str) and isinstance(t, torch.Tensor)
    rest = dict(it)
    rest[name] = t
    U.assert_same_dict(rest, tensors)


def test_tensors_stay_valid_after_the_iterator_stops_early(shards):
    paths, tensors = shards
    it = fastsafetensors_rs.weights_iterator(paths, prefetch=1)
    kept = [next(it) for _ in range(5)]  # into the second file
    it.close()
    del it
    gc.collect()
    for name, t in kept:
        U.assert_same_tensor(t, tensors[name], name)


def test_the_iterator_keeps_no_reference_to_what_it_yielded(shards):
    paths, _ = shards
    it = fastsafetensors_rs.weights_iterator(paths)
    name, t = next(it)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None, f"{name} is still referenced after the consumer dropped it"
    list(it)


def test_device_dtype_and_reader_reach_the_loader(shards, monkeypatch):
    paths, tensors = shards
    calls = []
    real = fst_api.stream

    def spy(files, **options):
        calls.append((list(files), options))
        return real(files, **options)

    monkeypatch.setattr(fst_api, "stream", spy)
    got = dict(fastsafetensors_rs.weights_iterator(paths, device="cpu", dtype=torch.float32, reader="mmap",
                                                   max_memory="1M"))
    assert [c[0] for c in calls] == [paths]  # one stream over every file, in order
    assert {k: calls[0][1][k] for k in ("dtype", "reader", "max_memory")} == {
        "dtype": torch.float32, "reader": "mmap", "max_memory": "1M"}
    for name, t in tensors.items():
        want = t.float() if t.is_floating_point() else t
        U.assert_same_tensor(got[name], want, name)


def test_a_filter_selects_what_is_read(shards):
    paths, tensors = shards
    got = dict(fastsafetensors_rs.weights_iterator(paths, tensor_filter="*.layers.[02].*"))
    U.assert_same_dict(got, {n: t for n, t in tensors.items() if ".layers.1." not in n})


def test_a_bad_file_fails_before_anything_is_read_and_names_it(shards, tmp_path):
    paths, tensors = shards
    bad = str(U.write_raw(tmp_path / "bad.safetensors", b'{"x": 1}'))
    it = fastsafetensors_rs.weights_iterator([paths[0], bad, paths[1]])
    with pytest.raises(RuntimeError, match=bad):
        next(it)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_straight_to_the_gpu(shards):
    paths, tensors = shards
    got = dict(fastsafetensors_rs.weights_iterator(paths, device="cuda:0", prefetch=1))
    assert {t.device for t in got.values()} == {torch.device("cuda", 0)}
    U.assert_same_dict({k: v.cpu() for k, v in got.items()}, tensors)


def test_enable_logging_rejects_unknown_levels():
    with pytest.raises(ValueError, match="chatty"):
        fastsafetensors_rs.enable_logging("chatty")


def test_empty_and_invalid_arguments(shards):
    assert list(fastsafetensors_rs.weights_iterator([])) == []
    with pytest.raises(ValueError):
        list(fastsafetensors_rs.weights_iterator(shards[0], prefetch=-1))


def test_progress_bar_only_when_asked(shards, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    paths, _ = shards
    monkeypatch.setattr(fst_progress, "DELAY_S", 0)  # show even this fast load
    monkeypatch.delenv(fst_progress.ENV_PROGRESS, raising=False)
    list(fastsafetensors_rs.weights_iterator(paths))
    assert "Loading safetensors" not in capsys.readouterr().err
    list(fastsafetensors_rs.weights_iterator(paths, True))
    assert "Loading safetensors" in capsys.readouterr().err
    monkeypatch.setenv(fst_progress.ENV_PROGRESS, "1")
    list(fastsafetensors_rs.weights_iterator(paths))
    assert "Loading safetensors" in capsys.readouterr().err
    list(fastsafetensors_rs.weights_iterator(paths, False))  # an explicit choice beats the variable
    assert "Loading safetensors" not in capsys.readouterr().err


# ------------------------------------------------------------------------ import hygiene, logging


def test_package_import_pulls_in_no_optional_dependency(shards):
    """transformers, vLLM and tqdm are optional: blocked, the package still imports and its
    iterator (progress bar asked for) still works."""
    proc = U.run_python(
        """
        import sys
        for name in ("tqdm", "tqdm.auto", "transformers", "vllm"):
            sys.modules[name] = None  # any import of these now raises ImportError
        import fastsafetensors_rs
        from fastsafetensors_rs import vllm_plugin
        assert vllm_plugin.register() is False
        got = dict(fastsafetensors_rs.weights_iterator(sys.argv[1:], True))
        try:
            fastsafetensors_rs.patch_transformers()
        except ImportError as e:
            assert "transformers" in str(e)
        else:
            raise AssertionError("patch_transformers() without transformers")
        print(len(got))
        """,
        *shards[0],
    )
    assert U.check_output(proc).strip().splitlines()[-1] == str(len(shards[1]))


def test_package_import_does_not_import_transformers_or_vllm():
    proc = U.run_python(
        """
        import sys
        import fastsafetensors_rs
        print(sorted(m for m in ("transformers", "vllm") if m in sys.modules))
        """
    )
    assert U.check_output(proc).strip() == "[]"


def test_log_env_var_turns_on_debug_logging(shards):
    code = """
        import sys, fastsafetensors_rs
        list(fastsafetensors_rs.weights_iterator(sys.argv[1:], reader="mmap"))
        """
    proc = U.run_python(code, *shards[0], env={"FASTSAFETENSORS_LOG": "debug"})
    U.check_output(proc)
    for p in shards[0]:
        assert f"{p}: read with mmap" in proc.stderr
    assert "reader='mmap' (argument)" in proc.stderr
    quiet = U.run_python(code, *shards[0])
    U.check_output(quiet)
    assert "read with" not in quiet.stderr
    odd = U.run_python(code, *shards[0], env={"FASTSAFETENSORS_LOG": "chatty"})
    assert odd.returncode != 0  # a malformed setting is an error, not ignored
    assert "FASTSAFETENSORS_LOG='chatty' is not valid: expected one of critical, debug" in odd.stderr


# ------------------------------------------------------------------------ vLLM plugin

# A stand-in for the parts of vLLM the plugin touches, with vLLM's module paths: the
# loader registry (register_model_loader / get_model_loader) and a DefaultModelLoader that,
# like vLLM's, rejects unknown extra-config keys and unknown load formats in
# _prepare_weights, builds its weights from _get_weights_iterator(Source) and hands them to
# model.load_weights().
FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/model_loader/__init__.py": '''
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        _LOADERS = {"auto": DefaultModelLoader, "safetensors": DefaultModelLoader}

        def register_model_loader(load_format):
            def wrapper(cls):
                if not issubclass(cls, BaseModelLoader):
                    raise ValueError("The model loader must be a subclass of BaseModelLoader")
                _LOADERS[load_format] = cls
                return cls
            return wrapper

        def get_model_loader(load_config):
            if load_config.load_format not in _LOADERS:
                raise ValueError(f"Load format `{load_config.load_format}` is not supported")
            return _LOADERS[load_config.load_format](load_config)
        ''',
    "vllm/model_executor/model_loader/base_loader.py": '''
        class BaseModelLoader:
            def __init__(self, load_config):
                self.load_config = load_config
        ''',
    "vllm/model_executor/model_loader/default_loader.py": '''
        import dataclasses, glob, os
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        @dataclasses.dataclass
        class LoadConfig:
            load_format: str = "auto"
            model_loader_extra_config: dict = dataclasses.field(default_factory=dict)
            use_tqdm_on_load: bool = True

        class DefaultModelLoader(BaseModelLoader):
            @dataclasses.dataclass
            class Source:
                model_or_path: str
                revision: object
                prefix: str = ""
                fall_back_to_pt: bool = True
                allow_patterns_overrides: object = None

            counter_before_loading_weights: float = 0.0

            def __init__(self, load_config):
                super().__init__(load_config)
                unexpected = set(load_config.model_loader_extra_config) - {"enable_multithread_load", "num_threads"}
                if unexpected:
                    raise ValueError(f"Unexpected extra config keys: {unexpected}")

            def _prepare_weights(self, model_name_or_path, revision, fall_back_to_pt, allow_patterns_overrides):
                if self.load_config.load_format not in ("auto", "hf", "safetensors", "fastsafetensors"):
                    raise ValueError(f"Unknown load_format: {self.load_config.load_format}")
                files = glob.glob(os.path.join(model_name_or_path, "*.safetensors"))
                return model_name_or_path, files, True

            def _get_weights_iterator(self, source):
                raise AssertionError("the plugin must provide its own iterator")

            def get_all_weights(self, model_config, model):
                yield from self._get_weights_iterator(
                    DefaultModelLoader.Source(model_config.model, None, prefix=""))
                for source in getattr(model, "secondary_weights", ()):
                    yield from self._get_weights_iterator(source)

            def load_weights(self, model, model_config):
                loaded = model.load_weights(self.get_all_weights(model_config, model))
                missing = {n for n, _ in model.named_parameters()} - loaded
                if missing:
                    raise ValueError(f"Following weights were not initialized from checkpoint: {missing}")
        ''',
}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    root = tmp_path / "fake_vllm"
    for rel, text in FAKE_VLLM.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(vllm_plugin, "_registered", None)
    yield
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


class TinyModel(torch.nn.Module):
    """A model with vLLM's load_weights(weights) -> set of loaded parameter names."""

    def __init__(self, tensors):
        super().__init__()
        for i, (name, t) in enumerate(sorted(tensors.items())):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
        self.names = {name: f"p{i}" for i, name in enumerate(sorted(tensors))}
        self.seen = []

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            self.seen.append(name)
            getattr(self, self.names[name]).data.copy_(w)
            loaded.add(self.names[name])
        return loaded


def test_vllm_plugin_registers_the_load_format(fake_vllm, shards):
    paths, tensors = shards
    assert vllm_plugin.register() is True
    assert vllm_plugin.register() is True  # idempotent
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import LoadConfig

    config = LoadConfig(load_format="fastsafetensors_rs",
                        model_loader_extra_config={"reader": "mmap", "prefetch": 1, "device": "cpu"})
    loader = get_model_loader(config)
    assert type(loader).__name__ == "FastSafetensorsRsLoader"
    assert loader.fastsafetensors_options == {"reader": "mmap", "prefetch": 1, "device": "cpu"}
    assert config.model_loader_extra_config == {"reader": "mmap", "prefetch": 1, "device": "cpu"}  # untouched
    assert loader.load_config.load_format == "fastsafetensors_rs"

    model = TinyModel(tensors)
    model_config = type("ModelConfig", (), {"model": str(Path(paths[0]).parent)})()
    loader.load_weights(model, model_config)
    assert sorted(model.seen) == sorted(tensors)
    for name, p in model.names.items():
        U.assert_same_tensor(getattr(model, p).data, tensors[name], name)
    assert loader.load_config.load_format == "fastsafetensors_rs"
    assert loader.counter_before_loading_weights > 0


def test_vllm_plugin_keeps_the_default_loader_checks(fake_vllm):
    vllm_plugin.register()
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import LoadConfig

    with pytest.raises(ValueError, match="bogus"):
        get_model_loader(LoadConfig(load_format="fastsafetensors_rs", model_loader_extra_config={"bogus": 1}))
    get_model_loader(LoadConfig(load_format="fastsafetensors_rs",
                                model_loader_extra_config={"num_threads": 2, "nogds": True}))


def test_vllm_plugin_prefix_of_secondary_weights(fake_vllm, shards):
    paths, tensors = shards
    vllm_plugin.register()
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader, LoadConfig

    loader = get_model_loader(LoadConfig(load_format="fastsafetensors_rs"))
    source = DefaultModelLoader.Source(str(Path(paths[0]).parent), None, prefix="draft.")
    names = [n for n, _ in loader._get_weights_iterator(source)]
    assert sorted(names) == sorted("draft." + n for n in tensors)


def test_vllm_plugin_without_vllm_is_a_no_op(monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_registered", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert vllm_plugin.register() is False
