"""The serving-engine weight iterator (vLLM / SGLang contract), and the vLLM plugin where vLLM
is not installed. The plugin in real vLLM is tested by tests/clients (`make test-vllm`)."""

from __future__ import annotations

import gc
import sys
import weakref

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


def test_one_path_is_one_file(shards):
    """A single path (str or PathLike) is that file, as for `load` and `stream`, not a
    sequence of one-character paths."""
    from pathlib import Path

    paths, tensors = shards
    want = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    for one in (paths[0], Path(paths[0])):
        U.assert_same_dict(dict(fastsafetensors_rs.weights_iterator(one)), want)
        U.assert_same_dict(dict(fastsafetensors_rs.weights_iterator(one, prefetch=1)), want)


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

# The plugin itself runs against real vLLM releases in tests/clients (make test-vllm); here
# only what it does where vLLM is missing or misconfigured.


def test_vllm_plugin_without_vllm_is_a_no_op(monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_registered", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert vllm_plugin.register() is False


def test_vllm_plugin_options_are_checked():
    assert vllm_plugin.parse_options({"reader": "mmap", "prefetch": 2, "num_threads": 4}) == {
        "reader": "mmap", "prefetch": 2}
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['prefetch'\] .* integer >= 0, got -1"):
        vllm_plugin.parse_options({"prefetch": -1})
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['reader'\]"):
        vllm_plugin.parse_options({"reader": "fast"})
    assert vllm_plugin.parse_options({"max_memory": "512M"}) == {"max_memory": "512M"}
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['max_memory'\] .* a size such as '1G'"):
        vllm_plugin.parse_options({"max_memory": 1.5})


def test_vllm_plugin_install_as_setting_is_checked(monkeypatch):
    monkeypatch.setattr(vllm_plugin, "_registered", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv(vllm_plugin.ENV_INSTALL_AS, "maybe")
    with pytest.raises(ValueError, match=r"\$FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS='maybe'"):
        vllm_plugin.register()
