"""Saving: `save_file` writes byte for byte what `safetensors.torch.save_file` writes; `save`
writes transformers' sharded checkpoints (names, index, balanced shards); what each refuses and
how; and what a failed, full-disk or killed save leaves behind (nothing partial under a final
name)."""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

import fastsafetensors_rs
import fst_testutils as U
from fastsafetensors_rs import SafetensorError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A save's temporary file: hidden, `.NAME.PID.N.tmp`, in the directory of NAME.
TEMP = re.compile(r"^\.(?P<final>.+)\.(?P<pid>\d+)\.(?P<n>\d+)\.tmp$")


# ---------------------------------------------------------------- helpers


def st_bytes(tmp_path: Path, tensors: dict, metadata=None) -> bytes:
    """What safetensors writes for `tensors` (made contiguous: safetensors refuses others)."""
    path = tmp_path / f"reference.{time.monotonic_ns()}.safetensors"
    st_save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    data = path.read_bytes()
    path.unlink()
    return data


def our_bytes(tmp_path: Path, tensors: dict, metadata=None, **kwargs) -> bytes:
    path = tmp_path / f"ours.{time.monotonic_ns()}.safetensors"
    assert fastsafetensors_rs.save_file(tensors, path, metadata=metadata, **kwargs) is None
    data = path.read_bytes()
    path.unlink()
    return data


def split_file(data: bytes) -> tuple[bytes, bytes]:
    """(header JSON bytes with its padding, data section) of a safetensors file."""
    (n,) = struct.unpack("<Q", data[:8])
    return data[8:8 + n], data[8 + n:]


def header_pairs(data: bytes) -> list:
    """The header as nested lists of (key, value) pairs, in the file's order."""
    return json.loads(split_file(data)[0], object_pairs_hook=list)


def listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def shard_keys(path) -> list[str]:
    with st_safe_open(str(path), "pt") as f:
        return list(f.keys())


def assert_one_line_naming(error: BaseException, *names: str) -> str:
    msg = str(error)
    assert "\n" not in msg, f"a multi-line message: {msg!r}"
    for name in names:
        assert name in msg, f"{name!r} not named in {msg!r}"
    return msg


def transformers_split(tensors: dict, max_shard_size: int) -> dict[str, list[str]]:
    """File name -> tensor names, as transformers' save_pretrained splits a state dict
    (huggingface_hub's split_torch_state_dict_into_shards)."""
    hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub comes with transformers (requirements-dev)")
    split = hub.split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)
    return split.filename_to_tensors


def best_max_shard(sizes: list[int], count: int) -> int:
    """The smallest possible largest shard when `sizes` (in order) are cut into `count`
    non-empty consecutive shards (dynamic programming, independent of the implementation)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                best[k][i] = min(best[k][i], max(best[k - 1][j], prefix[i] - prefix[j]))
    return best[count][n]


def fs_type(path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted on `path` (root only), unmounted afterwards."""
    path.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root, and this test runs as uid {os.geteuid()}")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs was refused (no CAP_SYS_ADMIN here): {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


# ---------------------------------------------------------------- save_file: safetensors' bytes


def every_dtype(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype torch holds that safetensors stores: matrices, cubes, empty tensors
    ((0,), (3, 0), (0, 3)) and 0-d tensors (float4 has no 0-d form)."""
    tensors = U.all_dtype_tensors(seed=seed)
    for dt, _ in U.DTYPES:
        tensors[f"{U.dtype_id(dt)}.empty03"] = U.random_tensor(dt, (0, 3), seed)
    return tensors


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}], ids=["no-metadata", "one-key"])
def test_every_dtype_is_the_file_safetensors_writes(tmp_path, metadata):
    tensors = every_dtype(seed=5)
    assert {t.dtype for t in tensors.values()} == {dt for dt, _ in U.DTYPES}
    assert any(t.dim() == 0 for t in tensors.values()) and any(t.numel() == 0 for t in tensors.values())
    ours = our_bytes(tmp_path, tensors, metadata)
    assert ours == st_bytes(tmp_path, tensors, metadata)


@pytest.mark.parametrize("dt", [dt for dt, _ in U.DTYPES], ids=U.dtype_id)
def test_each_dtype_alone(tmp_path, dt):
    """One dtype per file, so each one opens the data section and sets the header's length."""
    tensors = {"x": U.random_tensor(dt, (3, 5), 1), "y": U.random_tensor(dt, (1,), 2),
               "e": U.random_tensor(dt, (0, 3), 3)}
    if dt not in U.PACKED:
        tensors["s"] = U.random_tensor(dt, (), 4)
    path = tmp_path / "one.safetensors"
    fastsafetensors_rs.save_file(tensors, path)
    assert path.read_bytes() == st_bytes(tmp_path, tensors)
    U.assert_same_dict(st_load_file(str(path)), tensors)


@pytest.mark.parametrize("max_memory", [None, "64K"], ids=["default-blocks", "small-blocks"])
def test_tensors_across_write_blocks(tmp_path, max_memory):
    """~21 MB of odd-sized tensors: 8 MiB writes (and, under a 64K cap, thousands of small
    ones) cut through tensors at every kind of offset."""
    tensors = {
        "big.f32": U.random_tensor(torch.float32, (1531, 2053), 1),
        "big.bf16": U.random_tensor(torch.bfloat16, (2047, 1999), 2),
        "odd.u8": U.random_tensor(torch.uint8, (4097,), 3),
        "odd.bool": U.random_tensor(torch.bool, (3,), 4),
        "mid.i64": U.random_tensor(torch.int64, (1000, 3), 5),
        "tail.f8": U.random_tensor(torch.float8_e5m2, (12345,), 6),
    }
    assert sum(t.nbytes for t in tensors.values()) > 20_000_000
    ours = our_bytes(tmp_path, tensors, {"format": "pt"}, max_memory=max_memory)
    reference = st_bytes(tmp_path, tensors, {"format": "pt"})
    assert len(ours) == len(reference)
    assert hashlib.sha256(ours).hexdigest() == hashlib.sha256(reference).hexdigest()


def test_non_contiguous_tensors_are_saved_as_their_contiguous_copies(tmp_path):
    base = U.random_tensor(torch.float32, (6, 10), 1)
    words = U.random_tensor(torch.int16, (40,), 2)
    tensors = {
        "transposed": U.random_tensor(torch.bfloat16, (5, 7), 3).t(),
        "stepped": U.random_tensor(torch.float64, (30,), 4)[1::3],
        "sliced2d": base[1:5, ::2],
        "offset": words[7:19],  # contiguous, but not at the start of its storage
        "expanded": U.random_tensor(torch.int32, (1, 4), 5).expand(3, 4),
        "channels_last": U.random_tensor(torch.float16, (2, 3, 4, 5), 6).to(memory_format=torch.channels_last),
        "f8.transposed": U.random_tensor(torch.float8_e4m3fn, (4, 6), 7).t(),
        "f4.stepped": U.random_tensor(torch.float4_e2m1fn_x2, (6, 8), 8)[::2],
        "c64.transposed": U.random_tensor(torch.complex64, (3, 2), 9).t(),
    }
    assert sum(not t.is_contiguous() for t in tensors.values()) >= 7
    strides = {k: t.stride() for k, t in tensors.items()}
    path = tmp_path / "nc.safetensors"
    fastsafetensors_rs.save_file(tensors, path)
    assert path.read_bytes() == st_bytes(tmp_path, tensors)
    assert {k: t.stride() for k, t in tensors.items()} == strides, "the inputs were changed"
    U.assert_same_dict(fastsafetensors_rs.load_file(path), {k: t.contiguous() for k, t in tensors.items()})


def test_disjoint_slices_of_one_storage_are_not_shared(tmp_path):
    """Back-to-back slices of one buffer overlap in no byte: both are saved (as safetensors
    0.8 saves them)."""
    x = U.random_tensor(torch.float32, (10,), 1)
    tensors = {"head": x[:5], "tail": x[5:], "none": x[3:3]}
    assert our_bytes(tmp_path, tensors) == st_bytes(tmp_path, tensors)


NAMES_TO_ESCAPE = ['quote"d', "back\\slash", "new\nline", "tab\tbed", "ctrl\x01char", "nul\x00byte", "del\x7f",
                   "caf\u00e9", "\u65e5\u672c\u8a9e", "emoji\U0001F600", "a/b/c.weight", "", " spaced ",
                   "line\u2028sep", "</script>", "{\"json\":1}"]


def test_names_that_json_must_escape(tmp_path):
    tensors = {name: U.random_tensor(torch.float32, (2,), i) for i, name in enumerate(NAMES_TO_ESCAPE)}
    path = tmp_path / "names.safetensors"
    fastsafetensors_rs.save_file(tensors, path)
    assert path.read_bytes() == st_bytes(tmp_path, tensors)
    assert sorted(shard_keys(path)) == sorted(NAMES_TO_ESCAPE)
    U.assert_same_dict(fastsafetensors_rs.load_file(path), tensors)


def test_the_dict_order_does_not_change_the_file(tmp_path):
    names = ["b", "a", "B", "A", "\u00e9", "z.1", "z.10", "z.2", "_", "a.b"]
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float8_e4m3fn]
    tensors = {n: U.random_tensor(dtypes[i % len(dtypes)], (i + 1, 3), i) for i, n in enumerate(names)}
    reference = st_bytes(tmp_path, tensors)
    rng = random.Random(0)
    items = list(tensors.items())
    for _ in range(6):
        rng.shuffle(items)
        assert our_bytes(tmp_path, dict(items)) == reference, [k for k, _ in items]


def test_metadata_of_one_key_with_characters_to_escape(tmp_path):
    tensors = {"w": U.random_tensor(torch.float16, (4, 4), 1)}
    metadata = {"n\u00f6te\n": 'a "quoted" \\ value\t\x01 \u65e5'}
    assert our_bytes(tmp_path, tensors, metadata) == st_bytes(tmp_path, tensors, metadata)


def test_metadata_of_several_keys_is_sorted_and_otherwise_safetensors(tmp_path):
    """safetensors writes several metadata keys in an order that changes from process to
    process; ours sorts them. Everything else (tensor entries, data) is safetensors'."""
    tensors = {"w": U.random_tensor(torch.bfloat16, (8, 3), 1), "b": U.random_tensor(torch.float32, (3,), 2)}
    metadata = {"zeta": "1", "alpha": "2", "format": "pt", "\u00fcber": 'x"y'}
    ours = our_bytes(tmp_path, tensors, metadata)
    assert our_bytes(tmp_path, tensors, dict(reversed(list(metadata.items())))) == ours
    reference = st_bytes(tmp_path, tensors, metadata)
    assert len(ours) == len(reference)
    assert split_file(ours)[1] == split_file(reference)[1]
    assert json.loads(split_file(ours)[0]) == json.loads(split_file(reference)[0])
    pairs = header_pairs(ours)
    assert [k for k, _ in pairs] == [k for k, _ in header_pairs(reference)]  # tensor order
    assert pairs[0][0] == "__metadata__"
    assert [k for k, _ in pairs[0][1]] == sorted(metadata)


def test_empty_metadata_and_no_tensors(tmp_path):
    tensors = {"w": U.random_tensor(torch.float32, (3,), 1)}
    assert our_bytes(tmp_path, tensors, {}) == st_bytes(tmp_path, tensors, {})
    assert our_bytes(tmp_path, {}) == st_bytes(tmp_path, {})
    # No tensors and metadata={}: a valid header (safetensors 0.8 writes `{},"__metadata__":{}}`).
    path = tmp_path / "empty.safetensors"
    fastsafetensors_rs.save_file({}, path, metadata={})
    assert path.read_bytes() == struct.pack("<Q", 24) + b'{"__metadata__":{}}' + b" " * 5
    with st_safe_open(str(path), "pt") as f:
        assert (list(f.keys()), f.metadata()) == ([], {})


# ---------------------------------------------------------------- round trips


def test_round_trip_through_safetensors_and_our_loader(tmp_path):
    tensors = every_dtype(seed=9)
    tensors["nc.transposed"] = U.random_tensor(torch.float64, (3, 4), 1).t()
    tensors["nc.stepped"] = U.random_tensor(torch.float8_e8m0fnu, (20,), 2)[::3]
    metadata = {"format": "pt", "origin": "test_save"}
    path = tmp_path / "rt.safetensors"
    fastsafetensors_rs.save_file(tensors, str(path), metadata)
    expected = {k: t.contiguous() for k, t in tensors.items()}
    U.assert_same_dict(st_load_file(str(path)), expected)
    for reader in U.READERS:
        U.assert_same_dict(fastsafetensors_rs.load_file(path, reader=reader), expected)
    U.assert_same_dict(fastsafetensors_rs.load(path), expected)
    with st_safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
    with fastsafetensors_rs.safe_open(path, "pt") as f:
        assert f.metadata() == metadata


# ---------------------------------------------------------------- save: sharded checkpoints


def shard_specs() -> dict[str, torch.Tensor]:
    """A dozen tensors of mixed dtypes and sizes, escaped names among them, ~29 KB."""
    specs = [
        ("model.embed_tokens.weight", torch.bfloat16, (64, 48)),
        ("model.layers.0.q.weight", torch.float32, (32, 40)),
        ("model.layers.0.k.weight", torch.float16, (16, 40)),
        ("model.layers.0.norm.weight", torch.float32, (40,)),
        ("model.layers.0.scale", torch.float32, ()),
        ("model.layers.0.ids", torch.int64, (100,)),
        ("model.layers.1.q.weight", torch.float8_e4m3fn, (64, 64)),
        ("model.layers.1.mask \"\u00e9\"", torch.bool, (7, 9)),
        ("model.layers.1.w", torch.bfloat16, (50, 50)),
        ("model.layers.1.empty", torch.float32, (0, 4)),
        ("model.layers.2.f4", torch.float4_e2m1fn_x2, (30, 20)),
        ("lm_head.weight", torch.bfloat16, (64, 48)),
    ]
    return {name: U.random_tensor(dt, shape, i) for i, (name, dt, shape) in enumerate(specs)}


def test_a_sharded_save_is_transformers_layout_balanced(tmp_path):
    tensors = shard_specs()
    limit = 8000
    metadata = {"format": "pt"}
    stock = transformers_split(tensors, limit)
    count = len(stock)
    assert count >= 3
    d = tmp_path / "ckpt"
    paths = fastsafetensors_rs.save(tensors, d, max_shard_size=limit, metadata=metadata)

    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(stock) == names
    assert all(isinstance(p, str) for p in paths)
    assert paths == [str(d / n) for n in names] + [str(d / INDEX)]
    assert listing(d) == sorted(names + [INDEX])

    # Every tensor in exactly one shard; shards hold consecutive runs of the dict's order.
    per_shard = {n: shard_keys(d / n) for n in names}
    shard_of = {k: n for n, keys in per_shard.items() for k in keys}
    assert sum(len(keys) for keys in per_shard.values()) == len(tensors) == len(shard_of)
    assert set(shard_of) == set(tensors)
    order = [names.index(shard_of[k]) for k in tensors]
    assert order == sorted(order) and set(order) == set(range(count))

    # Balanced: within the limit, and the largest shard as small as `count` shards allow.
    sizes = [t.nbytes for t in tensors.values()]
    shard_bytes = [sum(tensors[k].nbytes for k in per_shard[n]) for n in names]
    assert max(shard_bytes) <= limit
    assert max(shard_bytes) == best_max_shard(sizes, count), shard_bytes

    # Each shard is safetensors' file of its tensors; the index is transformers' (json.dumps).
    for n in names:
        subset = {k: tensors[k] for k in per_shard[n]}
        assert (d / n).read_bytes() == st_bytes(tmp_path, subset, metadata), n
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": shard_of}
    assert (d / INDEX).read_text() == json.dumps(index, indent=2, sort_keys=True) + "\n"

    U.assert_same_dict(fastsafetensors_rs.load(d), tensors)
    U.assert_same_dict(fastsafetensors_rs.load(d / INDEX), tensors)


def test_a_save_within_the_limit_is_one_model_safetensors(tmp_path):
    tensors = shard_specs()
    d = tmp_path / "ckpt"
    paths = fastsafetensors_rs.save(tensors, d)  # "5GB"
    assert paths == [str(d / SINGLE)]
    assert listing(d) == [SINGLE]
    assert (d / SINGLE).read_bytes() == st_bytes(tmp_path, tensors)
    U.assert_same_dict(fastsafetensors_rs.load(d), tensors)
    # A limit given as a string of transformers' units.
    e = tmp_path / "units"
    assert len(fastsafetensors_rs.save(tensors, e, max_shard_size="0.01MB")) > 2  # 10 KB
    assert len(fastsafetensors_rs.save(tensors, tmp_path / "units2", max_shard_size="1MiB")) == 1
    # "MB" is 10^6 bytes and "MiB" 2^20: 1,040,000 bytes of tensors fit the second, not the first.
    two = {"a": torch.zeros(130_000), "b": torch.ones(130_000)}
    names = [Path(p).name for p in fastsafetensors_rs.save(two, tmp_path / "mb", max_shard_size="1MB")]
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX], names
    assert fastsafetensors_rs.save(two, tmp_path / "mib", max_shard_size="1MiB") == [str(tmp_path / "mib" / SINGLE)]


def test_a_tensor_over_the_limit_is_a_shard_of_its_own(tmp_path):
    tensors = {"big": U.random_tensor(torch.uint8, (5000,), 9), "a": U.random_tensor(torch.uint8, (100,), 1),
               "b": U.random_tensor(torch.uint8, (100,), 2)}
    paths = fastsafetensors_rs.save(tensors, tmp_path / "ckpt", max_shard_size=250)
    assert [shard_keys(p) for p in paths[:-1]] == [["big"], ["a", "b"]]
    assert sorted(transformers_split(tensors, 250).values()) == [["a", "b"], ["big"]]
    U.assert_same_dict(fastsafetensors_rs.load(tmp_path / "ckpt"), tensors)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_tensors_beside_one_over_the_limit_stay_within_it(tmp_path, where):
    """As transformers does: a tensor larger than max_shard_size is a shard of its own, and
    every other shard stays within the limit (packed across the big one, as transformers
    packs them), in as many shards as transformers makes."""
    small = {k: U.random_tensor(torch.uint8, (100,), i) for i, k in enumerate("abcd")}
    big = {"big": U.random_tensor(torch.uint8, (5000,), 9)}
    items = list(small.items())
    tensors = dict({"first": list(big.items()) + items, "last": items + list(big.items()),
                    "middle": items[:1] + list(big.items()) + items[1:]}[where])
    paths = fastsafetensors_rs.save(tensors, tmp_path / "ckpt", max_shard_size=250)
    U.assert_same_dict(fastsafetensors_rs.load(tmp_path / "ckpt"), tensors)
    per_shard = [shard_keys(p) for p in paths[:-1]]
    assert ["big"] in per_shard
    over = [keys for keys in per_shard if keys != ["big"] and sum(tensors[k].nbytes for k in keys) > 250]
    assert over == [], f"shards over max_shard_size=250: {over}"
    assert len(per_shard) == len(transformers_split(tensors, 250)) == 3


def test_a_resave_removes_the_earlier_checkpoint_files_only(tmp_path):
    tensors = shard_specs()
    d = tmp_path / "ckpt"
    d.mkdir()
    keep = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
            "model-1-of-2.safetensors.bak": b"not a shard name", ".hidden": b"x"}
    for name, data in keep.items():
        (d / name).write_bytes(data)
    (d / "sub").mkdir()
    (d / "sub" / SINGLE).write_bytes(b"another directory's")

    def files_now():
        return [n for n in listing(d) if n not in keep and n != "sub"]

    def saved(limit):
        paths = fastsafetensors_rs.save(tensors, d, max_shard_size=limit)
        assert files_now() == sorted(os.path.basename(p) for p in paths)
        U.assert_same_dict(fastsafetensors_rs.load(d / (INDEX if len(paths) > 1 else SINGLE)), tensors)
        return len(paths)

    assert saved(6000) >= 6  # five or more shards and the index
    assert saved(16000) == 3  # two shards: the others and the old index replaced or removed
    assert saved(10**9) == 1  # model.safetensors alone: shards and index removed
    assert saved(12000) >= 4  # sharded again: model.safetensors removed
    for name, data in keep.items():
        assert (d / name).read_bytes() == data
    assert (d / "sub" / SINGLE).read_bytes() == b"another directory's"


def test_a_save_into_the_working_directory_commits_in_place(tmp_path, monkeypatch):
    """A directory this process works in is not replaced (its working directory would be the
    removed old one): the files are renamed in one by one, and relative paths keep working."""
    d = tmp_path / "ckpt"
    fastsafetensors_rs.save({"w": _x()}, d)
    inode = d.stat().st_ino
    monkeypatch.chdir(d)
    tensors = shard_specs()
    paths = fastsafetensors_rs.save(tensors, ".", max_shard_size=8000)
    assert d.stat().st_ino == inode and os.path.samefile(".", d)
    assert paths[-1] == f"./{INDEX}" and sorted(os.listdir(".")) == sorted(os.path.basename(p) for p in paths)
    U.assert_same_dict(fastsafetensors_rs.load("."), tensors)
    # Elsewhere, the same directory is replaced as a whole.
    monkeypatch.chdir(tmp_path)
    fastsafetensors_rs.save(tensors, d, max_shard_size=8000)
    assert d.stat().st_ino != inode


def test_save_creates_missing_directories(tmp_path):
    tensors = {"w": U.random_tensor(torch.float32, (4,), 1)}
    d = tmp_path / "a" / "b" / "ckpt"
    assert fastsafetensors_rs.save(tensors, d) == [str(d / SINGLE)]
    U.assert_same_dict(fastsafetensors_rs.load(d), tensors)


# ---------------------------------------------------------------- transformers


def tiny_llama(tie: bool = False):
    transformers = pytest.importorskip("transformers", reason="transformers is in requirements-dev.txt")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_transformers_loads_a_saved_checkpoint(tmp_path):
    model = tiny_llama()
    state = model.state_dict()
    paths = fastsafetensors_rs.save(state, tmp_path, max_shard_size="40KB", metadata={"format": "pt"})
    assert len(paths) >= 3 and paths[-1].endswith(INDEX)
    model.config.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    U.assert_same_dict(loaded.state_dict(), state)


def test_the_checkpoint_save_pretrained_writes(tmp_path):
    """For the same model and max_shard_size: the files save_pretrained writes, the same
    tensors, and the same state dict loaded back (by us and by transformers)."""
    model = tiny_llama()
    state = model.state_dict()
    stock, ours = tmp_path / "stock", tmp_path / "ours"
    model.save_pretrained(stock, max_shard_size="40KB")
    fastsafetensors_rs.save(state, ours, max_shard_size="40KB", metadata={"format": "pt"})
    stock_files = sorted(p.name for p in stock.glob("*.safetensors"))
    assert len(stock_files) > 1
    assert sorted(p.name for p in ours.glob("*.safetensors")) == stock_files
    stock_index, our_index = (json.loads((d / INDEX).read_text()) for d in (stock, ours))
    assert set(our_index["weight_map"]) == set(stock_index["weight_map"]) == set(state)
    assert our_index["metadata"]["total_size"] == stock_index["metadata"]["total_size"]
    # Balanced: our largest shard is no larger than save_pretrained's.
    def largest(d):
        return max(sum(t.nbytes for t in st_load_file(str(d / f)).values()) for f in stock_files)
    assert largest(ours) <= largest(stock)
    for f in stock_files:
        with st_safe_open(str(ours / f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
    U.assert_same_dict(fastsafetensors_rs.load(ours), state)
    U.assert_same_dict(fastsafetensors_rs.load(stock), state)
    (ours / "config.json").write_bytes((stock / "config.json").read_bytes())
    U.assert_same_dict(type(model).from_pretrained(ours).state_dict(),
                       type(model).from_pretrained(stock).state_dict())


def test_tied_weights_are_refused_by_name(tmp_path):
    model = tiny_llama(tie=True)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    d = tmp_path / "ckpt"
    with pytest.raises(SafetensorError) as info:
        fastsafetensors_rs.save(state, d, max_shard_size="40KB")
    assert_one_line_naming(info.value, "lm_head.weight", "model.embed_tokens.weight", "shares memory")
    assert not d.exists()


@pytest.mark.parametrize("commit", ["exchange", "in-place"])
def test_a_sharded_save_drops_an_earlier_model_safetensors_that_is_a_link(tmp_path, monkeypatch, commit):
    """An earlier single-file checkpoint whose model.safetensors is a symbolic link (to a file
    elsewhere): a sharded save over it leaves no model.safetensors (transformers reads it before
    the index), so from_pretrained gets the new weights; the link's target is untouched."""
    monkeypatch.setenv("FASTSAFETENSORS_SAVE_COMMIT", commit)
    model = tiny_llama()
    old = model.state_dict()
    new = {k: (v + 1 if v.is_floating_point() else v) for k, v in old.items()}
    elsewhere = tmp_path / "blobs" / "old.safetensors"
    elsewhere.parent.mkdir()
    fastsafetensors_rs.save_file(old, elsewhere, metadata={"format": "pt"})
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink(elsewhere, d / SINGLE)
    model.config.save_pretrained(d)
    paths = fastsafetensors_rs.save(new, d, max_shard_size="40KB", metadata={"format": "pt"})
    assert len(paths) >= 3 and not os.path.lexists(d / SINGLE), listing(d)
    U.assert_same_dict(type(model).from_pretrained(d).state_dict(), new)
    U.assert_same_dict(st_load_file(str(elsewhere)), old)


# ---------------------------------------------------------------- refusals


def _x():
    return torch.arange(10, dtype=torch.float32)


def _shared_slice():
    x = _x()
    return {"a": x, "b": x[2:5]}


def _shared_view():
    x = _x()
    return {"a": x, "b": x.view(2, 5)}


REFUSED = {
    # case: (tensors, metadata, exception type, what the message starts with)
    "shared-slice": (_shared_slice, None, SafetensorError,
                     "tensor 'b' cannot be saved: it shares memory with tensor 'a'"),
    "shared-view": (_shared_view, None, SafetensorError,
                    "tensor 'b' cannot be saved: it shares memory with tensor 'a'"),
    "interleaved-views": (lambda: (lambda x: {"a": x[::2], "b": x[1::2]})(torch.arange(8.0)), None, SafetensorError,
                          "tensor 'b' cannot be saved: it shares memory with tensor 'a'"),
    "complex128": (lambda: {"ok": _x(), "c": torch.zeros(2, dtype=torch.complex128)}, None, SafetensorError,
                   "tensor 'c' cannot be saved: safetensors has no dtype for torch.complex128"),
    "sparse": (lambda: {"ok": _x(), "s": torch.eye(3).to_sparse()}, None, ValueError,
               "tensor 's' cannot be saved: it is torch.sparse_coo"),
    "not-a-tensor": (lambda: {"ok": _x(), "n": [1.0, 2.0]}, None, ValueError,
                     "Key `n` is invalid, expected torch.Tensor but received <class 'list'>"),
    "meta-device": (lambda: {"m": torch.empty(3, device="meta")}, None, ValueError,
                    "tensor 'm' cannot be saved: it is on meta"),
    "reserved-name": (lambda: {"__metadata__": _x()}, None, SafetensorError,
                      "tensor '__metadata__' cannot be saved: the name is reserved"),
    "float4-0d": (lambda: {"q": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, None,
                  SafetensorError, "tensor 'q' cannot be saved: a 0-d torch.float4_e2m1fn_x2"),
    "metadata-value": (lambda: {"ok": _x()}, {"format": "pt", "step": 3}, TypeError,
                       "metadata: keys and values must be str, got 'step': 3"),
    "metadata-key": (lambda: {"ok": _x()}, {1: "pt"}, TypeError, "metadata: keys and values must be str"),
    "not-a-dict": (lambda: [_x()], None, ValueError, "Expected a dict of [str, torch.Tensor]"),
}


@pytest.mark.parametrize("how", ["save_file", "save"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_inputs_fail_clearly_and_write_nothing(tmp_path, case, how):
    make, metadata, kind, start = REFUSED[case]
    d = tmp_path / "out"
    d.mkdir()
    (d / "keep.txt").write_text("kept")
    with pytest.raises(kind) as info:
        if how == "save_file":
            fastsafetensors_rs.save_file(make(), d / "x.safetensors", metadata=metadata)
        else:
            fastsafetensors_rs.save(make(), d, max_shard_size=16, metadata=metadata)
    assert type(info.value) is kind, type(info.value)
    msg = assert_one_line_naming(info.value)
    assert msg.startswith(start), msg
    assert listing(d) == ["keep.txt"]


# torch dtypes safetensors has no type for; torch's stable ABI cannot even name most of them.
UNSAVABLE = ["qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
             *[f"uint{i}" for i in range(1, 8)], *[f"int{i}" for i in range(1, 8)], "complex32", "complex128"]


def _of_dtype(name: str) -> torch.Tensor:
    dt = getattr(torch, name)
    if name.startswith("q"):
        return torch._empty_affine_quantized([4], scale=0.5, zero_point=0, dtype=dt)
    return torch.empty(4, dtype=dt)


@pytest.mark.parametrize("how", ["save_file", "save", "op", "compat"])
@pytest.mark.parametrize("dtype", UNSAVABLE)
def test_a_dtype_safetensors_lacks_is_refused_in_one_line_naming_the_tensor(tmp_path, dtype, how):
    tensors = {"ok": _x(), "odd.w": _of_dtype(dtype)}
    d = tmp_path / "out"
    d.mkdir()
    kind = {"op": RuntimeError, "compat": ValueError}.get(how, SafetensorError)
    with pytest.raises(kind) as info:
        if how == "save_file":
            fastsafetensors_rs.save_file(tensors, d / "x.safetensors")
        elif how == "save":
            fastsafetensors_rs.save(tensors, d, max_shard_size=16)
        elif how == "op":
            torch.ops.fastsafetensors.save(list(tensors), list(tensors.values()), str(d / "x.safetensors"))
        else:
            from fastsafetensors_rs.compat import saver
            saver.save_sharded([saver.plain_entry(n, t) for n, t in tensors.items()], str(d / "model"), num_shards=2)
    msg = assert_one_line_naming(info.value, "tensor 'odd.w' cannot be saved: safetensors has no dtype for")
    if how != "op":
        assert msg.endswith(f"safetensors has no dtype for torch.{dtype}"), msg
    assert listing(d) == []


def test_temporaries_of_saves_that_are_gone_are_removed_by_the_next_save(tmp_path):
    """Hidden temporaries that killed saves left (`.NAME.PID.N.tmp`: files beside a file,
    staging directories beside a checkpoint directory) are removed when the directory is next
    saved into, once their process is gone; those of a live process and other programs' files
    of that form stay."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = 4_194_305  # above the kernel's largest process id: no such process
        d = tmp_path / "ckpt"
        d.mkdir()
        gone = [d / f".model-00001-of-00002.safetensors.{dead}.0.tmp", d / f".x.safetensors.{dead}.3.tmp",
                tmp_path / f".ckpt.{dead}.1.tmp"]
        kept = [d / f".model.safetensors.{sleeper.pid}.0.tmp", d / f".notes.txt.{dead}.0.tmp",
                tmp_path / f".other.{dead}.1.tmp", tmp_path / f".ckpt.{sleeper.pid}.2.tmp"]
        for p in gone + kept:
            if p.name.endswith(f"{dead}.1.tmp") or p.name.endswith(".2.tmp"):
                p.mkdir()
                (p / "model.safetensors").write_bytes(b"partial")
            else:
                p.write_bytes(b"partial")
        fastsafetensors_rs.save_file({"w": _x()}, d / "x.safetensors")
        assert [p for p in gone if os.path.lexists(p)] == [gone[2]], "save_file cleans its own directory"
        fastsafetensors_rs.save({"w": _x()}, d)
        assert [p for p in gone if os.path.lexists(p)] == []
        assert [p for p in kept if not p.exists()] == []
        U.assert_same_dict(fastsafetensors_rs.load(d / SINGLE), {"w": _x()})
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("how", ["save_file", "save"])
def test_a_malformed_commit_setting_fails_every_save_naming_it(tmp_path, monkeypatch, how):
    monkeypatch.setenv("FASTSAFETENSORS_SAVE_COMMIT", "atomic")
    with pytest.raises(RuntimeError) as info:
        if how == "save_file":
            fastsafetensors_rs.save_file({"w": _x()}, tmp_path / "x.safetensors")
        else:
            fastsafetensors_rs.save({"w": _x()}, tmp_path / "ckpt")
    assert assert_one_line_naming(info.value) == ("FASTSAFETENSORS_SAVE_COMMIT='atomic' is not valid: expected "
                                                  "exchange, rename or in-place (or unset it for the default)")
    assert listing(tmp_path) == []


def test_safetensor_error_is_what_callers_catch():
    assert issubclass(SafetensorError, RuntimeError)
    import safetensors
    assert issubclass(SafetensorError, safetensors.SafetensorError)


def test_a_missing_parent_directory(tmp_path):
    target = tmp_path / "missing" / "x.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        fastsafetensors_rs.save_file({"w": _x()}, target)
    e = info.value
    assert isinstance(e, RuntimeError) and e.errno == errno.ENOENT and e.filename == str(target)
    assert assert_one_line_naming(e).startswith(f"{target}: create failed: No such file or directory (os error 2)")
    assert listing(tmp_path) == []


def test_save_file_onto_a_directory(tmp_path):
    target = tmp_path / "adir"
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(IsADirectoryError) as info:
        fastsafetensors_rs.save_file({"w": _x()}, target)
    assert info.value.errno == errno.EISDIR and info.value.filename == str(target)
    assert assert_one_line_naming(info.value, str(target)).startswith(f"{target}: ")
    assert listing(tmp_path) == ["adir"]  # no temporary left beside it
    assert listing(target) == ["inside"]


def test_a_directory_in_the_way_of_a_shard_fails_the_save_before_anything_is_written(tmp_path):
    """The second shard's name is taken by a directory: the save fails naming it before a
    byte is written, so no shard is published (a rename failing after others succeeded would
    leave some), and the directory is untouched."""
    d = tmp_path / "ckpt"
    (d / "model-00002-of-00003.safetensors").mkdir(parents=True)
    (d / "model-00002-of-00003.safetensors" / "inside").write_text("x")
    tensors = {f"w{i}": U.random_tensor(torch.uint8, (100,), i) for i in range(3)}
    with pytest.raises(IsADirectoryError) as info:
        fastsafetensors_rs.save(tensors, d, max_shard_size=150)
    assert_one_line_naming(info.value, str(d / "model-00002-of-00003.safetensors"), "create failed")
    assert listing(d) == ["model-00002-of-00003.safetensors"]
    assert listing(d / "model-00002-of-00003.safetensors") == ["inside"]


def test_save_onto_a_file(tmp_path):
    target = tmp_path / "afile"
    target.write_text("not a directory")
    with pytest.raises(FileExistsError) as info:
        fastsafetensors_rs.save({"w": _x()}, target)
    assert_one_line_naming(info.value, str(target))
    with pytest.raises(NotADirectoryError) as info:
        fastsafetensors_rs.save({"w": _x()}, target / "sub")
    assert_one_line_naming(info.value, str(target / "sub"))
    assert listing(tmp_path) == ["afile"] and target.read_text() == "not a directory"


@pytest.mark.parametrize("size,kind,match", [
    ("abc", ValueError, "max_shard_size='abc' is not a size"),
    ("5 parsecs", ValueError, "is not a size"),
    (0, ValueError, "max_shard_size=0: must be positive"),
    (-1, ValueError, "max_shard_size=-1: must be positive"),
    ("0KB", ValueError, "must be positive"),
    (1.5, TypeError, "max_shard_size: expected bytes"),
    (True, TypeError, "max_shard_size: expected bytes"),
])
def test_an_invalid_max_shard_size(tmp_path, size, kind, match):
    d = tmp_path / "ckpt"
    with pytest.raises(kind, match=re.escape(match)):
        fastsafetensors_rs.save({"w": _x()}, d, max_shard_size=size)
    assert not d.exists()


# ---------------------------------------------------------------- full and read-only filesystems


def test_a_full_filesystem_fails_before_writing_and_keeps_the_earlier_checkpoint(tmp_path):
    """A 32 MiB tmpfs: a 64 MB save fails with ENOSPC naming the file, leaves no temporary
    and no new file, and the checkpoint saved there before is untouched."""
    big = {f"w{i}": U.random_tensor(torch.uint8, (16_000_000,), i) for i in range(4)}
    small = {"w0": U.random_tensor(torch.float32, (1000,), 7)}
    with tmpfs(tmp_path / "small", "size=32m") as mnt:
        free = os.statvfs(mnt).f_bfree
        target = mnt / "one.safetensors"
        with pytest.raises(OSError) as info:
            fastsafetensors_rs.save_file(big, target)
        e = info.value
        assert e.errno == errno.ENOSPC and e.filename == str(target)
        assert assert_one_line_naming(e).startswith(
            f"{target}: reserving space (fallocate) failed: No space left on device (os error 28)")
        assert listing(mnt) == []
        assert os.statvfs(mnt).f_bfree == free, "space still held by a removed temporary"

        ckpt = mnt / "ckpt"
        fastsafetensors_rs.save({"w0": _x()}, ckpt)
        inode = ckpt.stat().st_ino
        fastsafetensors_rs.save(small, ckpt)  # over it: tmpfs exchanges directories too
        assert ckpt.stat().st_ino != inode and listing(mnt) == ["ckpt"]
        earlier = (ckpt / SINGLE).read_bytes()
        free = os.statvfs(mnt).f_bfree
        with pytest.raises(OSError) as info:
            fastsafetensors_rs.save(big, ckpt, max_shard_size="16MB")  # 4 shards of 16 MB: the third does not fit
        e = info.value
        assert e.errno == errno.ENOSPC
        msg = assert_one_line_naming(e, "No space left on device")
        assert re.match(rf"^{re.escape(str(ckpt))}/model-0000\d-of-00004\.safetensors: ", msg), msg
        assert listing(ckpt) == [SINGLE]
        assert (ckpt / SINGLE).read_bytes() == earlier
        assert os.statvfs(mnt).f_bfree == free, "space still held by a removed temporary"


def test_a_read_only_filesystem_fails_naming_the_file(tmp_path):
    with tmpfs(tmp_path / "ro", "size=1m") as mnt:
        (mnt / SINGLE).write_bytes(b"earlier")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for call, name in [
            (lambda: fastsafetensors_rs.save_file({"w": _x()}, mnt / "x.safetensors"), mnt / "x.safetensors"),
            (lambda: fastsafetensors_rs.save({"w": _x()}, mnt), mnt / SINGLE),
            (lambda: fastsafetensors_rs.save({"w": _x()}, mnt / "sub"), mnt / "sub"),
        ]:
            with pytest.raises(OSError) as info:
                call()
            e = info.value
            assert e.errno == errno.EROFS and e.filename == str(name)
            msg = assert_one_line_naming(e, "Read-only file system (os error 30)")
            assert msg.startswith(f"{name}: "), msg
            assert listing(mnt) == [SINGLE] and (mnt / SINGLE).read_bytes() == b"earlier"


# ---------------------------------------------------------------- write paths


def test_without_o_direct_the_buffered_writes_give_the_same_file(tmp_path, no_o_direct_preload):
    """On a filesystem that refuses O_DIRECT the save writes through the page cache (the file
    is then cached, where direct writes leave it uncached) and the bytes are the same."""
    code = """
        import sys, torch, fastsafetensors_rs
        import fst_testutils as U
        tensors = {"a": U.random_tensor(torch.bfloat16, (1500, 1001), 1), "b": U.random_tensor(torch.int8, (77,), 2)}
        fastsafetensors_rs.save_file(tensors, sys.argv[1], {"format": "pt"})
        print(U.resident_fraction(sys.argv[1]))
    """
    buffered = tmp_path / "buffered.safetensors"
    out = U.check_output(U.run_python(code, buffered, env={"LD_PRELOAD": str(no_o_direct_preload)}))
    assert float(out) > 0.9, "not written through the page cache"
    tensors = {"a": U.random_tensor(torch.bfloat16, (1500, 1001), 1), "b": U.random_tensor(torch.int8, (77,), 2)}
    assert buffered.read_bytes() == st_bytes(tmp_path, tensors, {"format": "pt"})
    if fs_type(tmp_path) in ("tmpfs", "ramfs") or not U.supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} is on {fs_type(tmp_path)}: either it refuses O_DIRECT or its pages are "
                    "its storage, so a direct write cannot be told from a buffered one here")
    direct = tmp_path / "direct.safetensors"
    out = U.check_output(U.run_python(code, direct))
    assert float(out) < 0.5, "a direct save left the file in the page cache"
    assert direct.read_bytes() == buffered.read_bytes()


# ---------------------------------------------------------------- host memory


def test_max_memory_bounds_the_save_of_a_large_model(tmp_path):
    """~200 MB saved in shards under max_memory="16M": the process's peak RSS grows by at most
    the budget and 64 MiB of slack over its RSS with the tensors made (a copy of the model
    would be 200 MB)."""
    code = """
        import json, os, resource, sys, torch
        import fastsafetensors_rs as F

        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024

        d = sys.argv[1]
        gen = torch.Generator().manual_seed(0)
        tensors = {f"w{i}": torch.empty(2_500_000 + 1000 * i, dtype=torch.float64).random_(generator=gen)
                   for i in range(10)}  # in place: no temporaries
        F.save_file({"warm": torch.zeros(4)}, os.path.join(d, "warm.safetensors"), max_memory="16M")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak (VmHWM) to the current RSS
            reset = True
        except OSError:
            reset = False
        base = rss()
        peak_before = hwm() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        paths = F.save(tensors, os.path.join(d, "ckpt"), max_shard_size="64MB", max_memory="16M")
        peak = hwm() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        loaded = F.load(os.path.join(d, "ckpt"))
        same = loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
        print(json.dumps({"bytes": sum(t.nbytes for t in tensors.values()), "base": base,
                          "peak_before": peak_before, "peak": peak, "files": len(paths), "same": same,
                          "reset": reset}))
    """
    result = json.loads(U.check_output(U.run_python(code, tmp_path)).strip().splitlines()[-1])
    assert result["same"] and result["files"] >= 4
    assert result["bytes"] > 200_000_000
    # The measurement sees growth from `base` up only if the peak had not been higher already.
    assert result["peak_before"] - result["base"] < 16 << 20, result
    shutil.rmtree(tmp_path / "ckpt")
    growth = result["peak"] - result["base"]
    print(f"RSS growth during a {result['bytes'] / 1e6:.0f} MB save under max_memory=16M: "
          f"{growth / 2**20:.1f} MiB (VmHWM reset: {result['reset']})")
    assert growth <= (16 << 20) + (64 << 20), f"peak RSS grew by {growth / 2**20:.1f} MiB"
    # Tighter: the default's buffers alone take 64 MiB on a small machine, so the slack above
    # would not tell a budget ignored; the save's own state beside its buffers is small.
    assert growth <= (16 << 20) + (16 << 20), f"peak RSS grew by {growth / 2**20:.1f} MiB"


# ---------------------------------------------------------------- killed saves

# A process that, for each command `save ARGS...`, forks a child that runs `child(*ARGS)` (the
# fork spares each trial the import and the tensors, made once before) and says its pid; `wait
# PID` reaps it and says its status. It never saves itself, so no thread pool of the library
# exists when it forks.
_FORK_SERVER = r"""
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "save":
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child(*args)
                code = 0
            except BaseException as e:
                print(f"child: {e!r}", file=sys.stderr, flush=True)
            os._exit(code)
        print(f"pid {pid}", flush=True)
    elif cmd == "wait":
        _, status = os.waitpid(int(args[0]), 0)
        print(f"status {status}", flush=True)
"""

# Two versions of a ~525 MB checkpoint, each saved by a child of the fork server.
_SAVER = r"""
import os, sys, time
import torch
torch.set_num_threads(1)
import fastsafetensors_rs as F

WORDS = 26 * 2**20 // 8
DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.uint8]

def version(seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(-2**62, 2**62, (WORDS,), dtype=torch.int64, generator=gen)
    return {f"model.layers.{i}.weight": (base ^ (seed * 7919 + i * 104729)).view(DTYPES[i % 4])
            for i in range(20)}

versions = {1: version(1), 2: version(2)}

def child(seed, directory):
    F.save(versions[int(seed)], directory, max_shard_size="110MB")
""" + _FORK_SERVER


class Saver:
    """Drives _SAVER (or another fork server): `save(seed, dir)` starts a save and returns its
    pid; `wait(pid)` reaps it (until then the pid cannot be reused, so killing it is always
    safe)."""

    def __init__(self, script: str = _SAVER, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=U.subprocess_env(env))
        self.buf = b""
        self.expect("ready", timeout=120)

    def line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0, left))
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not chunk:
                self.proc.kill()
                raise AssertionError(f"the saver {'exited' if ready else 'timed out'}: "
                                     f"{self.proc.stderr.read().decode(errors='replace')[-3000:]}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def expect(self, word: str, timeout: float = 60) -> str:
        line = self.line(timeout)
        assert line.split()[0] == word, line
        return line

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def save(self, seed: int, directory: Path) -> int:
        self.send(f"save {seed} {directory}")
        return int(self.expect("pid").split()[1])

    def wait(self, pid: int) -> int:
        self.send(f"wait {pid}")
        return int(self.expect("status", timeout=120).split()[1])

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_a_killed_save_leaves_every_file_whole(tmp_path):
    """kill -9 at random moments of a ~525 MB, 5-shard save into a directory holding an earlier
    checkpoint of the same names (20 trials, alternating two versions): every file under a
    final name is, byte for byte, one of the two versions' files; only hidden temporaries of
    the killed process may be left beside them."""
    started = time.monotonic()
    saver = Saver()
    try:
        d, ref = tmp_path / "ckpt", tmp_path / "reference"
        t0 = time.monotonic()
        assert saver.wait(saver.save(1, d)) == 0, "the first save failed"
        save_time = time.monotonic() - t0
        assert saver.wait(saver.save(2, ref)) == 0, "the reference save failed"
        names = listing(d)
        assert names == listing(ref) and len(names) == 6 and INDEX in names
        # name -> {digest: version}: the index is the same for both.
        good = {n: {sha256(ref / n): 2, sha256(d / n): 1} for n in names}
        assert all(len(good[n]) == 2 for n in names if n != INDEX), "the two versions must differ"
        for n in names:
            if n != INDEX:
                assert len(shard_keys(d / n)) == len(shard_keys(ref / n)) == 4, n
            (ref / n).unlink()
        ref.rmdir()

        rng = random.Random(20240531)
        verified = {n: (d / n).stat() for n in names}  # stat of each file as last checked
        version = dict.fromkeys(names, 1)
        killed = mixed = changed = left_temps = 0
        # Kill times spread over 0 .. 1.3 x the save's time: one in each of 20 slices, in random order.
        slices = list(range(20))
        rng.shuffle(slices)
        for trial in range(20):
            seed = 2 if trial % 2 == 0 else 1
            pid = saver.save(seed, d)
            time.sleep((slices[trial] + rng.random()) / 20 * 1.3 * save_time)
            os.kill(pid, signal.SIGKILL)
            status = saver.wait(pid)
            assert (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL) or (
                os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0), f"trial {trial}: status {status:#x}"
            killed += os.WIFSIGNALED(status)

            entries = listing(d)
            finals = [e for e in entries if not e.startswith(".")]
            temps = [e for e in entries if e.startswith(".")]
            assert finals == names, f"trial {trial}: {entries}"
            for t in temps:
                m = TEMP.match(t)
                assert m and m["final"] in names and int(m["pid"]) == pid, f"trial {trial}: {t}"
                (d / t).unlink()
            left_temps += bool(temps)
            before = dict(version)
            for n in names:
                # A file whose inode, size, mtime and ctime are those last checked has not been
                # written since (any write moves mtime): only the others are read again.
                st, old = (d / n).stat(), verified[n]
                if (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (
                        old.st_ino, old.st_size, old.st_mtime_ns, old.st_ctime_ns):
                    digest = sha256(d / n)
                    assert digest in good[n], f"trial {trial}: {n} is neither version's file"
                    verified[n], version[n] = st, good[n][digest]
            changed += version != before
            mixed += version != before and len({version[n] for n in names if n != INDEX}) > 1
        # A last, whole save: the directory is that version's checkpoint, loadable.
        assert saver.wait(saver.save(1, d)) == 0
        assert listing(d) == names
        assert all(good[n].get(sha256(d / n)) == 1 for n in names)
        assert len(fastsafetensors_rs.load(d)) == 20
        shutil.rmtree(d)  # half a gigabyte: not kept among pytest's last temporary directories
    finally:
        saver.close()
    elapsed = time.monotonic() - started
    print(f"20 trials of a {save_time:.2f} s save: {killed} killed mid-save, {changed} changed the checkpoint, "
          f"{mixed} of them left shards of both versions, {left_temps} left temporaries; {elapsed:.1f} s in all")
    assert killed >= 10, f"only {killed} of 20 trials were killed before the save finished"
    assert mixed == 0, f"{mixed} kills left shards of both versions"


# ---------------------------------------------------------------- the order that makes a save durable


def _traced_save(tmp_path, code: str, *args) -> list:
    """The fsyncs and renames of `code` run with `args` (strace), in the order they completed:
    ("fsync", path), ("rename", source, target, call text)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: the order of the system calls cannot be observed")
    log = tmp_path / f"strace.{time.monotonic_ns()}.log"
    proc = subprocess.run([strace, "-f", "-y", "-qq", "-o", str(log), "-e", "trace=fsync,fdatasync,rename,renameat,renameat2",
                           sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=U.subprocess_env())
    assert proc.returncode == 0, proc.stderr
    events = []
    pending = {}  # pid -> the call it started, where strace split it ("<unfinished ...>")
    for line in log.read_text().splitlines():
        pid, call = line.split(None, 1)
        if call.endswith("<unfinished ...>"):
            pending[pid] = call
            continue
        if "resumed>" in call:
            call = pending.pop(pid, "") + call.split("resumed>", 1)[1]
        if not call.rstrip().endswith("= 0"):
            continue
        m = re.match(r"f(?:data)?sync\(\d+<([^>]*)>", call)
        if m:
            events.append(("fsync", m.group(1)))
        m = re.match(r"rename(?:at2?)?\((?:[^,\"]*, )?\"([^\"]+)\", (?:[^,\"]*, )?\"([^\"]+)\"", call)
        if m:
            events.append(("rename", m.group(1), m.group(2), call))
    return events


_SAVE_FOUR = ("import sys, torch, fastsafetensors_rs as F\n"
              "F.save({f'w{i}': torch.full((50_000,), i + int(sys.argv[2]), dtype=torch.uint8) for i in range(4)},"
              " sys.argv[1], max_shard_size=120_000)\n")


def test_every_file_is_synced_before_the_directory_is_exchanged_and_the_parent_synced_after(tmp_path):
    """What docs/save.md promises, seen in the system calls of real saves (strace): the shards
    and the index are written into a staging directory beside the checkpoint and each
    fsynced, the staging directory is fsynced, then it is renamed to the checkpoint's name (a
    new directory) or swapped with the checkpoint directory by one
    renameat2(RENAME_EXCHANGE), and the parent is fsynced after that. No file is renamed into
    the checkpoint directory one by one."""
    d = tmp_path / "ckpt"
    code = _SAVE_FOUR + "open(sys.argv[1] + '/config.json', 'w').write('{}')\n" + _SAVE_FOUR.split("\n", 1)[1]
    events = _traced_save(tmp_path, code, d, 1)
    commits = [e for e in events if e[0] == "rename" and e[2] == str(d)]
    assert len(commits) == 2, events
    assert "RENAME_EXCHANGE" not in commits[0][3] and "RENAME_EXCHANGE" in commits[1][3], commits
    assert not [e for e in events if e[0] == "rename" and e not in commits], events
    for commit in commits:
        stage = commit[1]
        assert Path(stage).parent == tmp_path and TEMP.match(Path(stage).name)["final"] == "ckpt", stage
        at = events.index(commit)
        synced = {e[1] for e in events[:at] if e[0] == "fsync"}
        for name in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]:
            assert f"{stage}/{name}" in synced, f"{name} not synced before the commit: {events}"
        assert stage in synced, f"the staging directory is not synced before the commit: {events}"
        assert ("fsync", str(tmp_path)) in events[at:], f"the parent is not synced after the commit: {events}"
    assert listing(d) == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    assert listing(tmp_path) == ["ckpt", *[n for n in listing(tmp_path) if n.startswith("strace")]]


def test_in_place_commits_rename_each_file_synced_and_the_index_last(tmp_path):
    """FASTSAFETENSORS_SAVE_COMMIT=in-place (and directories that cannot be replaced: a mount
    point, the working directory): each file synced before it is renamed to its name, the
    index renamed after every shard, the directory synced after the renames."""
    d = tmp_path / "ckpt"
    code = f"import os; os.environ['FASTSAFETENSORS_SAVE_COMMIT'] = 'in-place'\n{_SAVE_FOUR}"
    events = _traced_save(tmp_path, code, d, 0)
    renames = [e for e in events if e[0] == "rename" and str(d) in e[2]]
    names = [Path(e[2]).name for e in renames]
    assert len(names) == 3 and names[-1] == INDEX and all(n.startswith("model-0000") for n in names[:-1]), events
    for e in renames:
        synced = [i for i, f in enumerate(events) if f == ("fsync", e[1])]
        assert synced and synced[0] < events.index(e), f"{e[1]} renamed before it was synced: {events}"
    last_rename = max(events.index(e) for e in renames)
    assert any(f == ("fsync", str(d)) for f in events[last_rename:]), f"the directory is not synced after the renames: {events}"


# ---------------------------------------------------------------- a checkpoint is whole or not there

# An LD_PRELOAD library that counts the calls that change files (writes, syncs, renames, links,
# removals, creations) once armed, and kills its process with SIGKILL at the N-th: the state a
# `kill -9` at that moment leaves, at a point chosen exactly rather than by a timer. Armed to
# fail instead (`fst_fail`), the N-th call fails with the errno given, as a full disk or a
# refused rename would.
_CRASH_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static long armed_at = -1; /* -1: off; 0: count only; N: SIGKILL (or fail) at the N-th call */
static long calls = 0;
static int fail_errno = 0;  /* 0: kill; else the N-th call fails with this errno */

void fst_arm(long at) { __atomic_store_n(&calls, 0, __ATOMIC_SEQ_CST); fail_errno = 0; armed_at = at; }
void fst_fail(long at, int err) { fst_arm(at); fail_errno = err; }
long fst_calls(void) { return __atomic_load_n(&calls, __ATOMIC_SEQ_CST); }

/* Whether this call fails (it kills instead where armed to). */
static int tick(void) {
    if (armed_at < 0) return 0;
    long n = __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
    if (armed_at > 0 && n == armed_at && fail_errno) { errno = fail_errno; return 1; }
    if (armed_at > 0 && n >= armed_at && !fail_errno) { kill(getpid(), SIGKILL); for (;;) pause(); }
    return 0;
}

#define REAL(ret, name, args) static ret (*real) args; if (!real) real = (ret (*) args) dlsym(RTLD_NEXT, #name)
#define WRAP(ret, name, params, args, types)                                   \
    ret name params { if (tick()) return -1; REAL(ret, name, types); return real args; }

WRAP(ssize_t, pwrite, (int fd, const void *b, size_t n, off_t o), (fd, b, n, o), (int, const void *, size_t, off_t))
WRAP(ssize_t, pwrite64, (int fd, const void *b, size_t n, off_t o), (fd, b, n, o), (int, const void *, size_t, off_t))
WRAP(int, fsync, (int fd), (fd), (int))
WRAP(int, fdatasync, (int fd), (fd), (int))
WRAP(int, fallocate, (int fd, int m, off_t o, off_t l), (fd, m, o, l), (int, int, off_t, off_t))
WRAP(int, fallocate64, (int fd, int m, off_t o, off_t l), (fd, m, o, l), (int, int, off_t, off_t))
WRAP(int, ftruncate, (int fd, off_t l), (fd, l), (int, off_t))
WRAP(int, ftruncate64, (int fd, off_t l), (fd, l), (int, off_t))
WRAP(int, rename, (const char *a, const char *b), (a, b), (const char *, const char *))
WRAP(int, renameat, (int fa, const char *a, int fb, const char *b), (fa, a, fb, b), (int, const char *, int, const char *))
WRAP(int, renameat2, (int fa, const char *a, int fb, const char *b, unsigned f), (fa, a, fb, b, f),
     (int, const char *, int, const char *, unsigned))
WRAP(int, link, (const char *a, const char *b), (a, b), (const char *, const char *))
WRAP(int, linkat, (int fa, const char *a, int fb, const char *b, int f), (fa, a, fb, b, f),
     (int, const char *, int, const char *, int))
WRAP(int, unlink, (const char *p), (p), (const char *))
WRAP(int, unlinkat, (int fd, const char *p, int f), (fd, p, f), (int, const char *, int))
WRAP(int, rmdir, (const char *p), (p), (const char *))
WRAP(int, mkdir, (const char *p, mode_t m), (p, m), (const char *, mode_t))
WRAP(int, mkdirat, (int fd, const char *p, mode_t m), (fd, p, m), (int, const char *, mode_t))
WRAP(int, chmod, (const char *p, mode_t m), (p, m), (const char *, mode_t))
WRAP(int, utimensat, (int fd, const char *p, const struct timespec t[2], int f), (fd, p, t, f),
     (int, const char *, const struct timespec *, int))

#define OPEN_LIKE(name)                                                        \
int name(const char *path, int flags, ...) {                                   \
    mode_t mode = 0;                                                           \
    if (flags & (O_CREAT | O_TMPFILE)) {                                       \
        va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap);  \
        if (tick()) return -1;                                                 \
    }                                                                          \
    REAL(int, name, (const char *, int, ...));                                 \
    return real(path, flags, mode);                                            \
}
#define OPENAT_LIKE(name)                                                      \
int name(int dirfd, const char *path, int flags, ...) {                        \
    mode_t mode = 0;                                                           \
    if (flags & (O_CREAT | O_TMPFILE)) {                                       \
        va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap);  \
        if (tick()) return -1;                                                 \
    }                                                                          \
    REAL(int, name, (int, const char *, int, ...));                            \
    return real(dirfd, path, flags, mode);                                     \
}
OPEN_LIKE(open)
OPEN_LIKE(open64)
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)
"""


@pytest.fixture(scope="session")
def crash_shim(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash_shim")
    (d / "crash.c").write_text(_CRASH_SHIM)
    so = d / "crash.so"
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build the crash shim")
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(d / "crash.c"), "-ldl"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"building the crash shim failed:\n{proc.stderr}"
    return so


# Four versions of a ~1 MB checkpoint of the same tensor names: "a5" and "b5" in 5 shards of the
# same layout, "c3" in 3 shards, "s1" as model.safetensors alone.
_VERSIONS = r"""
import torch
SPECS = [(f"model.layers.{i}.{w}", dt, shape) for i in range(4)
         for w, dt, shape in (("q.weight", torch.bfloat16, (128, 160)), ("norm.weight", torch.float32, (1000,)),
                              ("up.weight", torch.float16, (96, 200)))]
LIMITS = {"a5": 240_000, "b5": 240_000, "c3": 400_000, "s1": 10**9}
SEEDS = {"a5": 1, "b5": 2, "c3": 3, "s1": 4}

def version(name):
    gen = torch.Generator().manual_seed(SEEDS[name])
    return {k: torch.randint(0, 256, (torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size(),),
                             dtype=torch.uint8, generator=gen).view(dt).view(shape) for k, dt, shape in SPECS}
"""

# Every version, each saved by a child of the fork server that arms the crash shim first (at 0:
# count only, and write the count to `count_file`).
_CRASHER = _VERSIONS + r"""
import ctypes, os, sys
torch.set_num_threads(1)
import fastsafetensors_rs as F
shim = ctypes.CDLL(None)
shim.fst_arm.argtypes = [ctypes.c_long]
shim.fst_fail.argtypes = [ctypes.c_long, ctypes.c_int]
shim.fst_calls.restype = ctypes.c_long
versions = {name: version(name) for name in LIMITS}

def child(name, directory, at, count_file, fail_errno="0", how="exchange"):
    error = None
    # how: the directory's commit (FASTSAFETENSORS_SAVE_COMMIT), or "file": save_file to the path.
    if how != "file":
        os.environ["FASTSAFETENSORS_SAVE_COMMIT"] = how
    if int(fail_errno):
        shim.fst_fail(int(at), int(fail_errno))
    else:
        shim.fst_arm(int(at))
    try:
        if how == "file":
            F.save_file(versions[name], directory)
        else:
            F.save(versions[name], directory, max_shard_size=LIMITS[name])
    except Exception as e:
        error = e
    calls = shim.fst_calls()
    shim.fst_arm(-1)
    with open(count_file, "w") as f:
        f.write(str(calls) if error is None else f"error {type(error).__name__}: {error}")
""" + _FORK_SERVER


def _versions() -> dict:
    scope: dict = {}
    exec(_VERSIONS, scope)
    return {name: scope["version"](name) for name in scope["LIMITS"]}


def _same(a, b) -> bool:
    return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
            and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                    and torch.equal(U.as_bytes(a[k]), U.as_bytes(b[k])) for k in a))


def _read_glob(d: Path):
    """vLLM's iterator without an index: every *.safetensors of the directory."""
    out: dict = {}
    for path in sorted(d.glob("*.safetensors")):
        for k, v in st_load_file(str(path)).items():
            if k in out:
                return f"{k} in two files"
            out[k] = v
    return out if d.is_dir() else None


def _read_index(d: Path, single_first: bool):
    """safetensors through the index (single_first: as transformers resolves, model.safetensors
    before the index)."""
    if not d.is_dir():
        return None
    if (d / SINGLE).exists() and (single_first or not (d / INDEX).exists()):
        return st_load_file(str(d / SINGLE))
    weight_map = json.loads((d / INDEX).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        out.update(st_load_file(str(d / shard)))
    return out if set(out) == set(weight_map) else "the index and its shards differ"


def _read_ours(d: Path):
    return fastsafetensors_rs.load(d) if d.is_dir() else None


READERS_OF_A_DIRECTORY = {"load": _read_ours, "index": lambda d: _read_index(d, False),
                          "transformers' order": lambda d: _read_index(d, True), "glob": _read_glob}


def _others(d: Path) -> dict:
    """The directory's entries other than the checkpoint's files and hidden temporaries: path ->
    (kind, contents or link target, inode of a file)."""
    out = {}
    if not d.is_dir():
        return out
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            rel = str(p.relative_to(d))
            if root == str(d) and (re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", name)
                                   or name == INDEX or TEMP.match(name)):
                continue
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p), None)
            elif p.is_dir():
                out[rel] = ("dir", oct(st.st_mode), None)
            else:
                out[rel] = ("file", p.read_bytes(), st.st_ino)
    return out


class Crasher(Saver):
    """Drives _CRASHER (LD_PRELOAD'ed with the crash shim): `save(version, dir, at)` saves with
    the process killed at the at-th call that changes a file (0: never; returns the count)."""

    def __init__(self, shim: Path, tmp: Path):
        super().__init__(_CRASHER, {"LD_PRELOAD": str(shim)})
        self.count_file = tmp / "calls"

    def save(self, version: str, d: Path, at: int, fail_errno: int = 0, how: str = "exchange") -> int | str | None:
        """The number of calls of a save that completed, None where it was killed, or its error
        (`fail_errno`: the at-th call fails with it instead of killing). `how`: the commit, or
        "file" for `save_file(version, d)`."""
        self.count_file.unlink(missing_ok=True)
        self.send(f"save {version} {d} {at} {self.count_file} {fail_errno} {how}")
        status = self.wait(int(self.expect("pid").split()[1]))
        if os.WIFSIGNALED(status):
            assert os.WTERMSIG(status) == signal.SIGKILL and at > 0, f"status {status:#x}"
            return None
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the save's process failed: status {status:#x}"
        done = self.count_file.read_text()
        return done if done.startswith("error") else int(done)


# (scenario, the two versions it saves one over the other; None: into a new directory)
CRASH_SCENARIOS = {"same-layout": ("a5", "b5"), "other-shard-count": ("a5", "c3"),
                   "over-model.safetensors": ("s1", "c3"), "new-directory": (None, "a5")}


def _interrupted_saves(tmp_path: Path, crash_shim: Path, scenario: str, fail_errno: int = 0) -> collections.Counter:
    """20 saves of `scenario`, each killed (or, with `fail_errno`, failed) at a random one of its
    calls that change a file, each followed by the checks the tests below state. Returns how
    many ended with the new checkpoint in place, by whether the save was interrupted."""
    first, second = CRASH_SCENARIOS[scenario]
    versions = _versions()
    parent = tmp_path / "models"
    parent.mkdir()
    d = parent / "ckpt"
    crasher = Crasher(crash_shim, tmp_path)
    outcomes: collections.Counter = collections.Counter()
    try:
        counts = {}
        if first is not None:
            d.mkdir()
            (d / "config.json").write_text('{"model_type": "llama"}')
            (d / "tokenizer.json").write_bytes(os.urandom(3000))
            (d / "original").mkdir()
            (d / "original" / "params.json").write_text("{}")
            os.symlink("config.json", d / "latest.json")
            os.chmod(d, 0o750)
            assert crasher.save(first, d, 0)
            counts[first, second] = crasher.save(second, d, 0)
            counts[second, first] = crasher.save(first, d, 0)
        else:
            counts[None, second] = crasher.save(second, d, 0)
        others, mode = _others(d), (d.stat().st_mode if d.exists() else None)
        rng = random.Random(f"{scenario}-{fail_errno}-20")
        current = first
        for trial in range(20):
            if first is None:
                shutil.rmtree(d, ignore_errors=True)
                current = None
            target = second if current == first else first
            count = counts[current, target]
            at = rng.randint(1, count)
            done = crasher.save(target, d, at, fail_errno)
            how = f"trial {trial} ({current} -> {target}, {'failed' if fail_errno else 'killed'} at call {at} of {count})"
            states = {}
            for reader, read in READERS_OF_A_DIRECTORY.items():
                got = read(d)
                state = [v for v in (current, target) if (got is None if v is None else _same(got, versions[v]))]
                assert state, f"{how}: {reader} read neither version: {sorted(got) if isinstance(got, dict) else got}"
                states[reader] = state[0]
            assert len(set(states.values())) == 1, f"{how}: the readers disagree: {states}"
            assert not isinstance(done, int) or states["load"] == target, f"{how}: the save returned, yet {states}"
            if isinstance(done, str):  # a failed save says why in one line, naming a path
                assert "\n" not in done and str(parent) in done, f"{how}: {done}"
            assert _others(d) == others, f"{how}: the directory's other entries changed"
            if d.exists() and mode is not None:
                assert d.stat().st_mode == mode
            left = [n for n in os.listdir(parent) if n != "ckpt"]
            assert all(TEMP.match(n) and TEMP.match(n)["final"] == "ckpt" for n in left), left
            outcomes[(states["load"] == target, not isinstance(done, int))] += 1
            current = states["load"]
        # A last save, not interrupted: it completes, and nothing an interrupted one left remains.
        target = second if current == first else first
        assert crasher.save(target, d, 0)
        assert os.listdir(parent) == ["ckpt"]
        assert not [n for n in os.listdir(d) if n.startswith(".")]
        assert _others(d) == others and _same(_read_ours(d), versions[target])
    finally:
        crasher.close()
    print(f"{scenario}: {dict(counts)} calls; (new checkpoint, interrupted): {dict(outcomes)}")
    return outcomes


@pytest.mark.parametrize("scenario", list(CRASH_SCENARIOS))
def test_a_save_killed_at_any_point_leaves_the_old_checkpoint_or_the_new_one(tmp_path, crash_shim, scenario):
    """kill -9 (SIGKILL from the crash shim) before the N-th call that changes a file, at 20
    random N over the whole save, of a save over an existing checkpoint of the same layout, of
    another shard count, over model.safetensors, or into a new directory: every time, our
    load(dir), safetensors through the index, transformers' order (model.safetensors, then the
    index) and a glob of dir/*.safetensors (vLLM without an index) each read exactly the old
    checkpoint or exactly the new one, and the directory's other entries (files, a link, a
    subdirectory) are untouched. The next save removes what a killed one left."""
    outcomes = _interrupted_saves(tmp_path, crash_shim, scenario)
    # Kills before the commit and (but for a new directory, where one fsync follows it) after.
    new_directory = CRASH_SCENARIOS[scenario][0] is None
    assert outcomes[(False, True)] >= 3 and (new_directory or outcomes[(True, True)] >= 1), outcomes


def _files_of_each_version(crasher: Crasher, tmp_path: Path, name: str, how: str) -> dict:
    """Versions a5 and b5 saved whole once (`how`: "file" for save_file, else the commit):
    version -> file name -> bytes, what a file under its name may be."""
    files: dict = {}
    for v in ("a5", "b5"):
        ref = tmp_path / f"reference-{v}"
        ref.mkdir()
        assert crasher.save(v, ref / name, 0, how=how)
        files[v] = ({name: (ref / name).read_bytes()} if how == "file"
                    else {p.name: p.read_bytes() for p in (ref / name).iterdir()})
    # (The index is the same file in both: the same layout.)
    assert files["a5"].keys() == files["b5"].keys()
    assert all(files["a5"][n] != files["b5"][n] for n in files["a5"] if n.endswith(".safetensors"))
    return files


@pytest.mark.parametrize("how", ["file", "in-place", "exchange", "rename"])
def test_a_failed_sync_after_the_commit_says_the_new_files_are_in_place(tmp_path, crash_shim, how):
    """Each call of a save of b5 over a5 failed in turn (EIO). Where the failed call is the
    sync of a directory that the new files (or the new checkpoint directory) were renamed into,
    the save raises saying they are in place but not known to be durable, and they are: the
    directory holds exactly b5's files, nothing of a5 stays beside them (no stale file, no
    old checkpoint set aside), and an OSError with errno EIO is what a caller catches."""
    parent = tmp_path / "models"
    parent.mkdir()
    d = parent / ("model.safetensors" if how == "file" else "ckpt")
    where = parent if how == "file" else d
    crasher = Crasher(crash_shim, tmp_path)
    in_place = []
    try:
        files = _files_of_each_version(crasher, tmp_path, d.name, how)
        assert crasher.save("a5", d, 0, how=how)
        count = crasher.save("b5", d, 0, how=how)
        for at in range(1, count + 1):
            assert crasher.save("a5", d, 0, how=how)
            done = crasher.save("b5", d, at, errno.EIO, how=how)
            if not (isinstance(done, str) and "in place but not known to be durable" in done):
                continue
            in_place.append(at)
            assert done.startswith("error OSError: ") and done.endswith("failed: Input/output error (os error 5)"), done
            assert sorted(os.listdir(where)) == sorted(files["b5"]), (at, os.listdir(where))
            assert all((where / n).read_bytes() == b for n, b in files["b5"].items()), at
            assert sorted(os.listdir(parent)) == [d.name], (at, os.listdir(parent))
    finally:
        crasher.close()
    print(f"{how}: {count} calls, failing the sync at call {in_place} said the new files were in place")
    assert in_place, f"no failed call of {count} was a sync after the commit"


@pytest.mark.parametrize("how", ["file", "in-place"])
def test_save_file_and_in_place_commits_killed_at_any_point_leave_each_file_whole(tmp_path, crash_shim, how):
    """kill -9 before the N-th call that changes a file, at 20 random N, of `save_file` over a
    file of the same name, and of a 5-shard save committed in place over one of the same
    layout: every file under its name is, byte for byte, the old version's file or the new
    one's (in place, shards of the two may sit side by side: docs/save.md says so), the
    directory holds nothing else but hidden temporaries of the killed process, and the next
    save, not interrupted, removes them."""
    parent = tmp_path / "models"
    parent.mkdir()
    d = parent / ("model.safetensors" if how == "file" else "ckpt")
    crasher = Crasher(crash_shim, tmp_path)
    try:
        files = _files_of_each_version(crasher, tmp_path, d.name, how)
        where = parent if how == "file" else d
        counts = {}
        counts["a5"] = crasher.save("a5", d, 0, how=how)
        counts["b5"] = crasher.save("b5", d, 0, how=how)
        rng = random.Random(f"{how}-20")
        current, seen = "b5", collections.Counter()
        for trial in range(20):
            target = "a5" if current == "b5" else "b5"
            # The save first removes what the last killed one left: one more call per temporary.
            count = counts[target] + sum(1 for n in os.listdir(where) if TEMP.match(n))
            at = rng.randint(1, count)
            done = crasher.save(target, d, at, how=how)
            how_ = f"trial {trial} ({current} -> {target}, killed at call {at} of {count})"
            finals = sorted(n for n in os.listdir(where) if not TEMP.match(n))
            assert finals == sorted(files[target]), f"{how_}: {finals}"
            got = {n: [v for v in ("a5", "b5") if (where / n).read_bytes() == files[v][n]] for n in finals}
            assert all(got.values()), f"{how_}: files of neither version: {[n for n, v in got.items() if not v]}"
            temps = [TEMP.match(n) for n in os.listdir(where) if TEMP.match(n)]
            assert all(t["final"] in files[target] for t in temps), f"{how_}: {os.listdir(where)}"
            assert done is None or all(target in v for v in got.values()), f"{how_}: the save returned, yet {got}"
            states = {v[0] for v in got.values() if len(v) == 1}
            seen[(tuple(sorted(states)), done is None)] += 1
            current = states.pop() if len(states) == 1 else current
        # A last save, not interrupted: it completes, and what the killed ones left is gone.
        assert crasher.save("a5", d, 0, how=how)
        assert sorted(os.listdir(where)) == sorted(files["a5"]), os.listdir(where)
        assert all((where / n).read_bytes() == b for n, b in files["a5"].items())
    finally:
        crasher.close()
    print(f"{how}: {counts} calls; (versions seen, killed): {dict(seen)}")
    # Kills landed before the commit (the old version whole) and after it (the new one).
    assert sum(n for (states, killed), n in seen.items() if killed and len(states) == 1) >= 10, seen
    assert len({states for states, killed in seen if killed}) >= 2, seen


@pytest.mark.parametrize("scenario", ["same-layout", "over-model.safetensors"])
def test_a_save_failing_at_any_point_leaves_the_old_checkpoint_or_the_new_one(tmp_path, crash_shim, scenario):
    """The same, with the N-th call failing (EIO) instead: a write, a sync, a link, the rename
    refused. The save raises one line naming a path (or completes, where the call was one it
    does without), and the directory reads as the old checkpoint or the new one."""
    outcomes = _interrupted_saves(tmp_path, crash_shim, scenario, errno.EIO)
    assert outcomes[(False, True)] >= 3, outcomes
