"""Checkpoint directories and indexes: `load`, `load_file`, the op (Python and TorchScript),
its fake kernel and the CLI all take them, by one rule (rust/load/checkpoint.rs), and check the
shards against the index; `safe_open` and the compatible API read one file and say so."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs
import fst_testutils as U
from fastsafetensors_rs import cli

ops = torch.ops.fastsafetensors

SHARDS = {
    "model-00001-of-00002.safetensors": {
        "embed.weight": U.finite_tensor(torch.bfloat16, (32, 8), 1),
        "layers.0.weight": U.finite_tensor(torch.float32, (8, 8), 2),
    },
    "model-00002-of-00002.safetensors": {
        "layers.1.weight": U.random_tensor(torch.float8_e4m3fn, (8, 8), 3),
        "ids": torch.arange(5),
    },
}
ALL = {k: v for shard in SHARDS.values() for k, v in shard.items()}


def write_index(path: Path, weight_map: dict) -> Path:
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))
    return path


@pytest.fixture
def sharded(tmp_path) -> Path:
    """A sharded checkpoint with its index, and a stray consolidated file beside it (as some
    repositories ship), which the index leaves out."""
    d = tmp_path / "model"
    d.mkdir()
    weight_map = {}
    for name, tensors in SHARDS.items():
        U.write_checkpoint(d / name, tensors)
        weight_map.update({k: name for k in tensors})
    write_index(d / "model.safetensors.index.json", weight_map)
    U.write_checkpoint(d / "consolidated.safetensors", {"embed.weight": torch.zeros(2)})
    (d / "config.json").write_text("{}")
    return d


def _loaders():
    return {
        "load_file": lambda p: fastsafetensors_rs.load_file(p),
        "load": lambda p: fastsafetensors_rs.load([p], reader="direct"),
        "op": lambda p: U.op_load([str(p)]),
        "op_mmap": lambda p: U.op_load([str(p)], "cpu", None, "mmap"),
        "weights_iterator": lambda p: dict(fastsafetensors_rs.weights_iterator([p])),
    }


LOADERS = _loaders()


@pytest.mark.parametrize("loader", list(LOADERS))
def test_directory_with_index_loads_the_shards_it_lists(sharded, loader):
    got = LOADERS[loader](sharded)
    U.assert_same_dict(got, ALL)
    first = len(SHARDS["model-00001-of-00002.safetensors"])  # shards in name order
    assert set(list(got)[:first]) == set(SHARDS["model-00001-of-00002.safetensors"])


@pytest.mark.parametrize("loader", list(LOADERS))
def test_index_path_loads_its_shards(sharded, loader):
    U.assert_same_dict(LOADERS[loader](sharded / "model.safetensors.index.json"), ALL)


def test_directory_without_index_loads_every_safetensors_file(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    for name, tensors in SHARDS.items():
        U.write_checkpoint(d / name, tensors)
    (d / "notes.txt").write_text("not a model")
    (d / "sub").mkdir()
    U.write_checkpoint(d / "sub" / "other.safetensors", {"not.loaded": torch.ones(1)})
    U.assert_same_dict(fastsafetensors_rs.load_file(d), ALL)


def test_directories_and_files_mix(sharded, tmp_path):
    extra = U.write_checkpoint(tmp_path / "extra.safetensors", {"extra": torch.ones(3)})
    got = fastsafetensors_rs.load([sharded, extra])
    U.assert_same_dict(got, {**ALL, "extra": torch.ones(3)})


def test_hugging_face_cache_layout_of_symbolic_links(tmp_path):
    """snapshots/<rev>/ holds links into blobs/, as huggingface_hub lays out its cache."""
    blobs = tmp_path / "blobs"
    snap = tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    weight_map = {}
    for i, (name, tensors) in enumerate(SHARDS.items()):
        U.write_checkpoint(blobs / f"blob{i}", tensors)
        os.symlink(os.path.relpath(blobs / f"blob{i}", snap), snap / name)
        weight_map.update({k: name for k in tensors})
    write_index(blobs / "index", weight_map)
    os.symlink(os.path.relpath(blobs / "index", snap), snap / "model.safetensors.index.json")
    U.assert_same_dict(fastsafetensors_rs.load_file(snap), ALL)


def test_a_checkpoint_saved_by_transformers(tmp_path):
    """save_pretrained of a small random Llama, sharded with an index: every tensor as
    safetensors reads it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="40KB", safe_serialization=True)
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists()
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    want = {}
    for shard in shards:
        want.update(st_load_file(str(shard)))
    U.assert_same_dict(fastsafetensors_rs.load_file(tmp_path), want)
    U.assert_same_dict(U.op_load([str(index)]), want)


def test_torchscript_loads_a_directory(sharded):
    @torch.jit.script
    def load_dir(path: str) -> dict[str, torch.Tensor]:
        names, tensors = torch.ops.fastsafetensors.load([path])
        return {name: t for name, t in zip(names, tensors)}

    U.assert_same_dict(load_dir(str(sharded)), ALL)


def test_fake_kernel_resolves_directories_as_the_op_does(sharded):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = U.op_load([str(sharded)], "cpu", torch.float16)
    with FakeTensorMode():
        fake = U.op_load([str(sharded)], "cpu", torch.float16)
    assert list(fake) == list(real)
    assert all(fake[k].dtype == real[k].dtype and fake[k].shape == real[k].shape for k in real)


# ---------------------------------------------------------------- what is refused, and how


def _error(call, path) -> str:
    with pytest.raises((RuntimeError, ValueError)) as info:
        call(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def _broken(sharded: Path, edit) -> Path:
    index = sharded / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    edit(doc["weight_map"])
    index.write_text(json.dumps(doc))
    return index


def test_missing_shard_is_named_with_its_index(sharded):
    index = _broken(sharded, lambda m: m.update({"ids": "model-00003-of-00002.safetensors"}))
    for call in (fastsafetensors_rs.load_file, lambda p: U.op_load([str(p)])):
        for path in (sharded, index):
            assert _error(call, path) == (
                f"{index}: lists shard model-00003-of-00002.safetensors, which does not exist")


def test_tensor_in_another_shard_than_the_index_says(sharded):
    index = _broken(sharded, lambda m: m.update({"ids": "model-00001-of-00002.safetensors"}))
    assert _error(fastsafetensors_rs.load_file, sharded) == (
        f"{index}: maps 'ids' to model-00001-of-00002.safetensors, but it is in "
        f"{sharded / 'model-00002-of-00002.safetensors'}")


def test_tensor_the_index_does_not_list(sharded):
    index = _broken(sharded, lambda m: m.pop("ids"))
    assert _error(fastsafetensors_rs.load_file, sharded) == (
        f"{index}: does not list tensor 'ids' of {sharded / 'model-00002-of-00002.safetensors'}")


def test_tensor_no_shard_has(sharded):
    index = _broken(sharded, lambda m: m.update({"lm_head.weight": "model-00002-of-00002.safetensors"}))
    assert _error(fastsafetensors_rs.load_file, sharded) == (
        f"{index}: maps 'lm_head.weight' to model-00002-of-00002.safetensors, but none of the shards it lists has it")


def test_several_problems_are_counted(sharded):
    index = _broken(sharded, lambda m: m.update({"a": "model-00001-of-00002.safetensors",
                                                 "b": "model-00001-of-00002.safetensors"}))
    msg = _error(fastsafetensors_rs.load_file, sharded)
    assert msg.startswith(f"{index}: maps 'a' to model-00001-of-00002.safetensors, but none of the shards it lists has it")
    assert msg.endswith(f"(and 1 more; `python -m fastsafetensors_rs verify {index}` lists them all)")


def test_several_indexes_in_one_directory(sharded):
    write_index(sharded / "model.fp16.safetensors.index.json", {"x": "model-00001-of-00002.safetensors"})
    assert _error(fastsafetensors_rs.load_file, sharded) == (
        f"{sharded}: holds several checkpoint indexes (model.fp16.safetensors.index.json, "
        "model.safetensors.index.json): pass the one to load instead of the directory")
    # Naming one works.
    U.assert_same_dict(fastsafetensors_rs.load_file(sharded / "model.safetensors.index.json"), ALL)


def test_empty_directory(tmp_path):
    assert _error(fastsafetensors_rs.load_file, tmp_path) == (
        f"{tmp_path}: no *.safetensors files and no *.safetensors.index.json in this directory "
        "(subdirectories are not searched)")


WHAT_TO_PASS = (r" \(a load takes \.safetensors files, their directory, or the \*\.safetensors\.index\.json "
                r"that lists them\)")


@pytest.mark.parametrize("text, reason", [
    ('{"architectures": ["LlamaForCausalLM"]}', r"missing field `weight_map` at line 1 column \d+" + WHAT_TO_PASS),
    ('{"weight_map": {}}', r"its weight_map lists no tensors"),
    ('{"weight_map": {"w": "../elsewhere.safetensors"}}',
     r"shard path '\.\./elsewhere\.safetensors' does not stay inside the index's directory"),
    ("not json", r"expected ident at line 1 column 2" + WHAT_TO_PASS),
])
def test_json_that_is_no_index(tmp_path, text, reason):
    path = tmp_path / "config.json"
    path.write_text(text)
    msg = _error(fastsafetensors_rs.load_file, path)
    assert re.fullmatch(re.escape(f"{path}: not a safetensors checkpoint index: ") + reason, msg), msg


@pytest.mark.parametrize("call", [
    lambda p: fastsafetensors_rs.safe_open(p),
    lambda p: fastsafetensors_rs.fastsafe_open(p),
    lambda p: fastsafetensors_rs.SafeTensorsFileLoader(fastsafetensors_rs.SingleGroup()).add_filenames({0: [p]}),
    lambda p: ops.keys(str(p)),
    lambda p: U.op_metadata(str(p)),
], ids=["safe_open", "fastsafe_open", "SafeTensorsFileLoader", "keys", "metadata"])
def test_single_file_readers_refuse_a_directory(sharded, call):
    assert _error(call, sharded) == (
        f"{sharded}: is a directory, but safe_open, keys() and metadata() read one .safetensors file: "
        "pass one of its files, or load the whole checkpoint with load()/load_file()")


# ---------------------------------------------------------------- the CLI uses the same rule


def test_cli_lists_what_the_loader_loads(sharded, capsys):
    assert cli.main(["inspect", "--json", str(sharded)]) == 0
    doc = json.loads(capsys.readouterr().out)
    files, index, problems = ops.checkpoint(str(sharded))
    assert [f["path"] for f in doc["files"]] == list(files)
    assert "consolidated.safetensors" not in " ".join(files)
    assert doc["indexes"] == [index] and problems == [] and doc["problems"] == []


def test_cli_reports_what_the_loader_refuses(sharded, capsys):
    write_index(sharded / "model.fp16.safetensors.index.json", {"x": "model-00001-of-00002.safetensors"})
    assert cli.main(["verify", str(sharded)]) == 2
    err = capsys.readouterr().err
    with pytest.raises(RuntimeError) as info:
        U.op_load([str(sharded)])
    assert err == f"python -m fastsafetensors_rs verify: {info.value}\n"


def test_cli_problems_are_the_loaders_messages(sharded, capsys):
    index = _broken(sharded, lambda m: m.update({"ids": "model-00001-of-00002.safetensors"}))
    assert cli.main(["verify", "--json", str(sharded)]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    with pytest.raises(RuntimeError) as info:
        fastsafetensors_rs.load_file(sharded)
    assert problems == [str(info.value)]
    assert problems[0].startswith(f"{index}: maps 'ids'")
