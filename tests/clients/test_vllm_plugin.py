"""The load format `fastsafetensors_rs` in real vLLM 0.33: registered through the installed
entry point by vLLM's `load_general_plugins()`, built by `get_model_loader`, checked
tensor by tensor against safetensors.torch.load_file and, for every shard filter of
vLLM's DefaultModelLoader, against vLLM's own loader (load format "safetensors") given
the same source."""

from __future__ import annotations

import json
import re
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from safetensors.torch import save_file

import harness
from harness import assert_bit_exact, checkpoint_files, collect, reference

FORMAT = "fastsafetensors_rs"


def _source_fields():
    import dataclasses

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return {f.name for f in dataclasses.fields(DefaultModelLoader.Source)}


SOURCE_FIELDS = _source_fields()


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def loader_for(load_format: str, extra: dict | None = None, **load_config):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(LoadConfig(load_format=load_format, model_loader_extra_config=extra or {},
                                       **load_config))


def source(path, **kwargs):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return DefaultModelLoader.Source(str(path), None, **kwargs)


def ours_and_vllms(src, **attributes):
    """The tensors our loader and vLLM's safetensors loader give for `src`, with the same
    loader state (`attributes`, as vLLM's load_weights sets them) on both."""
    results = []
    for fmt in (FORMAT, "safetensors"):
        loader = loader_for(fmt)
        for name, value in attributes.items():
            setattr(loader, name, value)
        results.append(collect(loader._get_weights_iterator(src)))
    return results


def test_the_entry_point_registers_the_format():
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    ours = [e for e in entry_points(group="vllm.general_plugins") if e.name == FORMAT]
    assert [e.value for e in ours] == ["fastsafetensors_rs.vllm_plugin:register"]
    loader = loader_for(FORMAT)
    assert isinstance(loader, DefaultModelLoader)
    assert type(loader).__module__ == "fastsafetensors_rs.vllm_plugin"


def test_get_all_weights_is_bit_exact(checkpoint):
    config = harness.vllm_config(checkpoint, FORMAT)
    got = collect(loader_for(FORMAT).get_all_weights(config.model_config, torch.nn.Module()))
    assert_bit_exact(got, reference(checkpoint_files(checkpoint)))


def tensors_of(files) -> set:
    """The names of the tensors `files` hold, from their headers."""
    from safetensors import safe_open

    names: set = set()
    for f in files:
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


def test_verify_in_the_extra_config_checks_every_file(checkpoint, tmp_path):
    """`{"verify": {"digests": ...}}` through vLLM's own loader: the right digests give the
    same weights; a wrong one fails naming the file."""
    import hashlib

    files = [Path(f) for f in checkpoint_files(checkpoint)]
    digests = {f.name: "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    config = harness.vllm_config(checkpoint, FORMAT)
    loader = loader_for(FORMAT, {"verify": {"digests": digests}})
    got = collect(loader.get_all_weights(config.model_config, torch.nn.Module()))
    assert_bit_exact(got, reference(checkpoint_files(checkpoint)))
    wrong = {**digests, files[-1].name: "sha256:" + "0" * 64}
    loader = loader_for(FORMAT, {"verify": {"digests": wrong}})
    with pytest.raises(Exception, match=f"{re.escape(files[-1].name)}: digest mismatch"):
        collect(loader.get_all_weights(config.model_config, torch.nn.Module()))
    if len(files) == 1:
        return  # the single-file BERT: no later file (the sharded Llama runs what follows)
    # The first file wrong: the load fails before any tensor of a later file reaches the model.
    wrong = {**digests, files[0].name: "sha256:" + "0" * 64}
    loader = loader_for(FORMAT, {"verify": {"digests": wrong}})
    seen = []
    with pytest.raises(Exception, match=f"{re.escape(files[0].name)}: digest mismatch"):
        for name, _ in loader.get_all_weights(config.model_config, torch.nn.Module()):
            seen.append(name)
    assert not set(seen) & tensors_of(files[1:]), seen


def test_a_checkpoint_saved_by_save_loads_through_vllms_own_loader(llama, tmp_path):
    """`fastsafetensors_rs.save` of a model's tensors, sharded and indexed as transformers
    names them, read by vLLM's own safetensors weight iterator: the same tensors."""
    import fastsafetensors_rs

    expected = reference(checkpoint_files(llama))
    saved = tmp_path / "saved"
    total = sum(t.numel() * t.element_size() for t in expected.values())
    paths = fastsafetensors_rs.save(expected, saved, max_shard_size=total // 3 + 1)
    assert Path(paths[-1]).name == "model.safetensors.index.json" and len(paths) >= 4
    for other in llama.iterdir():
        if not other.name.endswith((".safetensors", ".json")) or other.name == "config.json":
            shutil.copy(other, saved / other.name)
    got = collect(loader_for("safetensors")._get_weights_iterator(source(saved)))
    assert_bit_exact(got, expected)


@pytest.mark.skipif(not harness.can_build_models_on_cpu(),
                    reason="vLLM before 0.33 does not build models on the CPU from its CUDA wheel")
def test_load_model_equals_vllms_safetensors_load(checkpoint):
    """vLLM builds its own model class (LlamaForCausalLM / BertEmbeddingModel) and the
    loader fills it (model.load_weights: fused QKV and gate-up, the strict check that every
    parameter was loaded); the result equals vLLM's safetensors load bit for bit."""
    model, loader = harness.load_vllm_model(checkpoint, FORMAT)
    assert type(loader).__module__ == "fastsafetensors_rs.vllm_plugin"
    expected, _ = harness.load_vllm_model(checkpoint, "safetensors")
    got, want = harness.state(model), harness.state(expected)
    assert len(got) >= 10
    assert_bit_exact(got, want)
    assert loader.counter_before_loading_weights > 0.0


def test_subfolder_and_prefix(llama, tmp_path):
    """Source.subfolder (a checkpoint below the model folder) and Source.prefix, as a
    secondary source of a model names them."""
    shutil.copytree(llama, tmp_path / "draft")
    src = source(tmp_path, subfolder="draft", prefix="draft.")
    ours, vllms = ours_and_vllms(src)
    assert_bit_exact(ours, vllms)
    expected = {"draft." + k: v for k, v in reference(checkpoint_files(llama)).items()}
    assert_bit_exact(ours, expected)


def test_files_outside_the_index_are_not_read(llama, tmp_path):
    """A consolidated file beside the shards (as some repositories ship) is left out: only
    the files the index lists are loaded."""
    model = Path(shutil.copytree(llama, tmp_path / "m"))
    save_file({"consolidated.only": torch.ones(3)}, str(model / "consolidated.safetensors"))
    ours, vllms = ours_and_vllms(source(model))
    assert "consolidated.only" not in ours
    assert_bit_exact(ours, vllms)
    assert_bit_exact(ours, reference(checkpoint_files(llama)))


def test_allow_patterns_overrides(llama):
    """allow_patterns_overrides replaces the file patterns; as in vLLM, they are tried in
    order and the first that matches any file decides. vLLM 0.32+ then skips the index
    filtering; before, the index check refuses a subset of an indexed checkpoint, and our
    loader must refuse it the same way."""
    shards = checkpoint_files(llama)
    src = source(llama, allow_patterns_overrides=["*.missing", Path(shards[-1]).name, "*.safetensors"])
    try:
        vllms = collect(loader_for("safetensors")._get_weights_iterator(src))
    except FileNotFoundError as e:
        assert harness.vllm_version() < Version("0.32"), e
        with pytest.raises(FileNotFoundError, match=re.escape(str(e))):
            collect(loader_for(FORMAT)._get_weights_iterator(src))
        return
    ours = collect(loader_for(FORMAT)._get_weights_iterator(src))
    assert_bit_exact(ours, vllms)
    assert_bit_exact(ours, reference([shards[-1]]))


@pytest.mark.skipif("is_unused_weight" not in SOURCE_FIELDS, reason="Source.is_unused_weight is new in vLLM 0.32")
def test_is_unused_weight_drops_shards(llama):
    """Source.is_unused_weight (vLLM 0.32+): a shard of unused weights only is not read; a
    shard with any used weight is read whole (its unused tensors come too)."""
    files = checkpoint_files(llama)
    last = set(reference([files[-1]]))
    unused = last | {"model.embed_tokens.weight"}  # the first shard holds more than that
    ours, vllms = ours_and_vllms(source(llama, is_unused_weight=unused.__contains__))
    assert_bit_exact(ours, vllms)
    assert_bit_exact(ours, reference(files[:-1]))


def test_mm_encoder_only_filter(llama):
    """--mm-encoder-only (vLLM 0.31+): shards holding only language-model weights are not read
    (the state vLLM's load_weights sets from the model's language-model prefixes)."""
    from vllm.model_executor.model_loader import weight_utils

    files = checkpoint_files(llama)
    lm_prefixes = tuple(sorted(reference([files[-1]])))
    ours, vllms = ours_and_vllms(source(llama), _encoder_only_lm_prefixes=lm_prefixes,
                                 _encoder_only_weights_mapper=None)
    assert_bit_exact(ours, vllms)
    filtering = hasattr(weight_utils, "filter_mm_encoder_only_safetensors_files")  # vLLM 0.31+
    assert_bit_exact(ours, reference(files[:-1] if filtering else files))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A sharded MoE-style checkpoint: 4 experts, experts 2 and 3 alone in the last shard."""
    directory = tmp_path_factory.mktemp("moe")
    g = torch.Generator().manual_seed(3)
    layer = "model.layers.0.mlp"
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
            f"{layer}.gate.weight": torch.randn(4, 8, generator=g),
            **{f"{layer}.experts.{e}.{p}.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16)
               for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")},
            f"{layer}.experts.3.down_proj.weight_scale": torch.ones(1),
        },
        "model-00002-of-00002.safetensors": {
            f"{layer}.experts.{e}.{p}.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16)
            for e in (2, 3) for p in ("gate_proj", "up_proj", "down_proj")
        },
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file))
        weight_map.update({name: file for name in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def test_expert_parallel_filter(moe, monkeypatch):
    """Expert parallelism (local_expert_ids, as vLLM's load_weights computes them): other
    ranks' expert weights are not yielded (scales are), a shard holding only other ranks'
    experts is not read at all, and in the others only this rank's tensors are selected
    (from the headers, before any read)."""
    import fastsafetensors_rs.api

    read, selected = [], []
    real_stream = fastsafetensors_rs.api.stream

    def recording_stream(files, **kwargs):
        read.extend(files)
        selected.extend(torch.ops.fastsafetensors.selected(list(files)))
        keep = kwargs["tensor_filter"]
        selected[:] = [n for n in selected if keep(n)]
        return real_stream(files, **kwargs)

    monkeypatch.setattr(fastsafetensors_rs.api, "stream", recording_stream)
    ours, vllms = ours_and_vllms(source(moe), local_expert_ids={0, 1})
    assert_bit_exact(ours, vllms)
    assert not [n for n in ours if ".experts.2." in n or (".experts.3." in n and n.endswith(".weight"))]
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale" in ours
    assert [Path(f).name for f in read] == ["model-00001-of-00002.safetensors"]
    assert sorted(selected) == sorted(ours), "only this rank's tensors are read"


def test_tensor_parallel_ranks_read_the_checkpoint_once(tmp_path):
    """TP = 2 on the CPU, vLLM's own process groups: each rank gets every tensor bit-exact
    (checked in the ranks), and the two together read the checkpoint once from storage (a
    larger Llama, of about 18 MB: each rank also reads the headers)."""
    llama = harness.save_llama(tmp_path, scale=8)
    lines = harness.run_ranks("vllm", llama, world=2, scenario="plugin-tp")
    assert sum(line.startswith("CHECKED vllm-plugin-tp-rank") for line in lines) == 2, lines
    read = sum(int(line.split()[-1]) for line in lines if line.startswith("CHECKED read_bytes"))
    total = sum(Path(f).stat().st_size for f in checkpoint_files(llama))
    assert 0.9 * total <= read <= 1.1 * total, (read, total)


def test_tensor_parallel_ranks_verify_and_still_read_the_checkpoint_once(tmp_path):
    """`"verify"` in the extra config keeps the ranks' shared reads: the two ranks together
    read the checkpoint once and hash it once (each file by one of them); a wrong digest
    fails both ranks alike."""
    import hashlib

    llama = harness.save_llama(tmp_path, scale=8)
    files = checkpoint_files(llama)
    digests = {Path(f).name: "sha256:" + hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files}
    good, bad = tmp_path / "digests.json", tmp_path / "wrong.json"
    good.write_text(json.dumps(digests))
    last = Path(files[-1]).name
    bad.write_text(json.dumps({**digests, last: "sha256:" + "0" * 64}))
    lines = harness.run_ranks("vllm", llama, world=2, scenario="plugin-tp", args=("--verify", str(good)))
    assert sum(line.startswith("CHECKED vllm-plugin-tp-rank") for line in lines) == 2, lines
    total = sum(Path(f).stat().st_size for f in files)
    read = sum(int(line.split()[-1]) for line in lines if line.startswith("CHECKED read_bytes"))
    hashed = [int(line.split()[-1]) for line in lines if line.startswith("CHECKED hashed_bytes")]
    assert 0.9 * total <= read <= 1.1 * total, (read, total)
    assert len(hashed) == 2 and total <= sum(hashed) <= total + 4096 * len(files), (hashed, total)
    lines = harness.run_ranks("vllm", llama, world=2, scenario="plugin-tp", args=("--verify", str(bad)))
    errors = [line for line in lines if line.startswith("CHECKED error")]
    assert len(errors) == 2 and all(f"{last}: digest mismatch" in e for e in errors), lines
    # The first file wrong: both ranks fail before any tensor of a later file is yielded.
    first = Path(files[0]).name
    bad.write_text(json.dumps({**digests, first: "sha256:" + "0" * 64}))
    lines = harness.run_ranks("vllm", llama, world=2, scenario="plugin-tp", args=("--verify", str(bad)))
    errors = [line for line in lines if line.startswith("CHECKED error")]
    assert len(errors) == 2 and all(f"{first}: digest mismatch" in e for e in errors), lines
    yielded = [set(line.split()[2:]) for line in lines if line.startswith("CHECKED yielded")]
    assert len(yielded) == 2 and not set().union(*yielded) & tensors_of(files[1:]), lines


def test_options_from_model_loader_extra_config(llama):
    """Our keys (reader, prefetch, device, nogds) are taken; vLLM's own keys still pass to
    vLLM; the caller's LoadConfig is left as it was."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    extra = {"reader": "direct", "prefetch": 1, "device": "cpu", "nogds": True,
             "enable_multithread_load": True, "num_threads": 2}
    config = LoadConfig(load_format=FORMAT, model_loader_extra_config=dict(extra))
    loader = get_model_loader(config)
    assert loader.fastsafetensors_options == {"reader": "direct", "prefetch": 1, "device": "cpu", "nogds": True}
    assert config.model_loader_extra_config == extra
    assert loader.load_config.model_loader_extra_config == {"enable_multithread_load": True, "num_threads": 2}
    got = collect(loader._get_weights_iterator(source(llama)))
    assert_bit_exact(got, reference(checkpoint_files(llama)))


@pytest.mark.parametrize("extra, message", [
    ({"prefetch": -1}, r"model_loader_extra_config\['prefetch'\].*integer >= 0"),
    ({"prefetch": True}, r"model_loader_extra_config\['prefetch'\].*integer >= 0"),
    ({"reader": "fast"}, r"model_loader_extra_config\['reader'\].*'auto' or 'direct' or 'mmap'"),
    ({"nogds": "yes"}, r"model_loader_extra_config\['nogds'\]"),
    ({"device": 0}, r"model_loader_extra_config\['device'\]"),
    ({"share": "node"}, r"model_loader_extra_config\['share'\].*'tp' or 'world' or 'none'"),
    ({"bogus": 1}, r"Unexpected extra config keys.*bogus"),  # vLLM's own check
])
def test_bad_options_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        loader_for(FORMAT, extra)


def test_progress_follows_use_tqdm_on_load(llama, monkeypatch):
    from fastsafetensors_rs import weights

    shown = []
    real = weights.progress_enabled

    def recording(requested, **kwargs):
        shown.append(requested)
        return real(requested, **kwargs)

    monkeypatch.setattr(weights, "progress_enabled", recording)
    for use_tqdm in (True, False):
        loader = loader_for(FORMAT, use_tqdm_on_load=use_tqdm)
        collect(loader._get_weights_iterator(source(llama)))
    assert shown == [True, False]


def test_download_model_finds_the_files(llama):
    """download_model calls _prepare_weights by keyword, as vLLM does before loading."""
    config = harness.vllm_config(llama, FORMAT)
    loader_for(FORMAT).download_model(config.model_config)
    prepared = loader_for(FORMAT)._prepare_weights(str(llama), None, None, True, None)
    assert prepared[:3] == (str(llama), prepared[1], True)
    assert sorted(prepared[1]) == checkpoint_files(llama)
    assert prepared[3:] in [(), ("model.safetensors.index.json",)]  # the index name: vLLM 0.31+


def test_torchao_checkpoints_go_through_vllms_iterator(llama):
    """torchao checkpoints need vLLM's own iterator (it rebuilds tensor subclasses): the
    loader hands them to it, which asks for torchao here."""
    loader = loader_for(FORMAT)
    loader.load_config.safetensors_load_strategy = "torchao"
    with pytest.raises((ValueError, ImportError), match="torchao"):
        collect(loader._get_weights_iterator(source(llama)))


def test_keep_in_the_extra_config_attaches_the_next_load(checkpoint, tmp_path, monkeypatch):
    """`{"keep": true}` through vLLM's own loader: the first load keeps the weights, the next
    (a restarted engine) attaches to them, bit for bit."""
    import tempfile

    from fastsafetensors_rs import keep

    scratch = tempfile.mkdtemp(prefix="fstk-", dir="/tmp")  # a short path: socket addresses hold 107 bytes
    monkeypatch.setenv("FASTSAFETENSORS_KEEP_DIR", scratch + "/k")
    config = harness.vllm_config(checkpoint, FORMAT)
    try:
        for _ in range(2):
            got = collect(loader_for(FORMAT, {"keep": True}).get_all_weights(config.model_config, torch.nn.Module()))
            assert_bit_exact(got, reference(checkpoint_files(checkpoint)))
        [entry] = keep.entries()
        assert entry["attaches"] == 1 and entry["device"] == "cpu", entry
    finally:
        keep.stop()
        shutil.rmtree(scratch, ignore_errors=True)
