"""The fastsafetensors-compatible API in one process: the 0.5 surface (`SingleGroup`,
`SafeTensorsFileLoader`, `FilesBufferOnDevice`, `fastsafe_open`, `ParallelLoader`, `DType`),
its errors, and what it does better than the original (tensors valid after close, no
defensive copies, local device indices, null `__metadata__`)."""

from __future__ import annotations

import gc
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs as fst
import fst_testutils as U
from fastsafetensors_rs.compat.types import pick_cuda_index

MiB = 1 << 20
FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def open_buffer(paths, pg=None, **copy_kwargs):
    loader = fst.SafeTensorsFileLoader(pg, "cpu")
    loader.add_filenames({0: [str(p) for p in paths]})
    return loader, loader.copy_files_to_device(**copy_kwargs)


@pytest.fixture
def null_metadata_file(tmp_path):
    tensors = {"a": U.finite_tensor(torch.float32, (3, 4), 1), "b": U.random_tensor(torch.int32, (5,), 2)}
    header, data, _ = U.layout(tensors.items())
    path = U.write_raw(tmp_path / "null_meta.safetensors", {"__metadata__": None, **header}, data)
    return path, tensors


# ---------------------------------------------------------------- the public surface


def test_public_names_are_exported():
    for name in ("SafeTensorsFileLoader", "SingleGroup", "FilesBufferOnDevice", "fastsafe_open",
                 "ParallelLoader", "DType"):
        assert hasattr(fst, name) and name in fst.__all__
    from fastsafetensors_rs.loader import SafeTensorsFileLoader, fastsafe_open  # TGIS-style
    from fastsafetensors_rs.parallel_loader import ParallelLoader  # as vLLM imports it

    assert ParallelLoader is fst.ParallelLoader
    assert (SafeTensorsFileLoader, fastsafe_open) == (fst.SafeTensorsFileLoader, fst.fastsafe_open)


def test_dtype_enum_matches_safetensors_names():
    assert fst.DType.AUTO.torch_dtype is None
    for dt, name in U.DTYPES:
        assert fst.DType(name).torch_dtype == dt
        assert fst.DType.from_torch(dt) is fst.DType(name)
    for member in ("BOOL", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "F16", "F32",
                   "F64", "BF16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "AUTO"):
        assert fst.DType[member].value == member  # the original's members and values


def test_single_group():
    g = fst.SingleGroup()
    assert (g.size(), g.rank()) == (1, 0)


@pytest.mark.parametrize("pg", [fst.SingleGroup(), fst.SingleGroup, None], ids=["instance", "class", "none"])
def test_single_group_returns_every_tensor_whole(all_dtypes_file, pg):
    path, written = all_dtypes_file
    loader, fb = open_buffer([path], pg)
    assert sorted(loader.get_keys()) == sorted(written)
    assert sorted(fb.keys()) == sorted(fb.key_to_rank_lidx) == sorted(written)
    assert set(fb.key_to_rank_lidx.values()) == {(0, 0)}
    for name, t in written.items():
        U.assert_same_tensor(fb.get_tensor(name), t, name)
        U.assert_same_tensor(fb.get_tensor(name), t, name)  # reusable access
        U.assert_same_tensor(fb.push_tensor(name, 0), t, name)
        if t.dim() >= 1:
            U.assert_same_tensor(fb.get_sharded(name, 0), t, name)
        if t.dim() >= 2:
            U.assert_same_tensor(fb.get_sharded(name, 1), t, name)
        U.assert_same_tensor(fb.get_sharded(name, -1), t, name)
    got = fb.as_dict({name: -1 for name in written})
    U.assert_same_dict({name: t.get_raw() for name, t in got.items()}, written)
    fb.close()
    loader.close()


def test_shapes_filenames_and_header_order(all_dtypes_file, multi_file_model):
    path, written = all_dtypes_file
    loader, fb = open_buffer([path])
    assert fb.get_shape("float4_e2m1fn_x2.matrix") == [5, 14] == loader.get_shape("float4_e2m1fn_x2.matrix")  # header shape
    assert fb.get_tensor("float4_e2m1fn_x2.matrix").shape == (5, 7)  # torch packs two values
    assert fb.get_shape("float64.scalar") == []
    assert fb.get_filename("float32.cube") == str(path)
    assert fb.get_filename("missing") is None  # TGIS-style loaders test `is None`
    names, *_ = torch.ops.fastsafetensors.describe(str(path))
    assert fb.keys() == list(names), "data order"
    paths, shards = multi_file_model
    loader, fb = open_buffer(paths)
    expected = [name for p in paths for name in torch.ops.fastsafetensors.describe(str(p))[0]]
    assert fb.keys() == expected, "file order, then data order"
    assert [fb.key_to_rank_lidx[n][1] for n in expected] == [
        i for i, s in enumerate(shards) for _ in s
    ]


def test_get_multi_cols_concatenates(tmp_path):
    q, k, v = (U.finite_tensor(torch.bfloat16, (n, 8), i) for i, n in enumerate((12, 4, 4)))
    path = U.write_checkpoint(tmp_path / "qkv.safetensors", {"q": q, "k": k, "v": v})
    loader, fb = open_buffer([path])
    U.assert_same_tensor(fb.get_multi_cols(["q", "k", "v"], 0).get_raw(), torch.cat([q, k, v]))
    U.assert_same_tensor(fb.get_multi_cols(["k", "v"], 1).get_raw(), torch.cat([k, v], 1))
    with pytest.raises(ValueError, match="'q'.*'k'|'k'.*'q'"):
        fb.get_multi_cols(["k", "q"], 1)  # differ outside dim 1


def test_multi_cols_of_dtypes_without_a_cat_kernel(tmp_path):
    a, b = U.random_tensor(torch.float4_e2m1fn_x2, (3, 2), 1), U.random_tensor(torch.float4_e2m1fn_x2, (1, 2), 2)
    path = U.write_checkpoint(tmp_path / "f4.safetensors", {"a": a, "b": b})
    loader, fb = open_buffer([path])
    got = fb.get_multi_cols(["a", "b"], 0).get_raw()
    assert got.dtype == torch.float4_e2m1fn_x2
    assert torch.equal(U.as_bytes(got), torch.cat([U.as_bytes(a), U.as_bytes(b)]))


# ---------------------------------------------------------------- dtypes and devices


@pytest.mark.parametrize("dtype", [fst.DType.F16, torch.float16, "F16"], ids=["DType", "torch", "str"])
def test_copy_files_to_device_casts_floating_point_only(all_dtypes_file, dtype):
    path, written = all_dtypes_file
    loader, fb = open_buffer([path], dtype=dtype)
    for name, t in written.items():
        want = t.to(torch.float16) if t.dtype in FLOATS else t
        U.assert_same_tensor(fb.get_tensor(name), want, name)


def test_per_call_dtype_and_device(all_dtypes_file):
    path, written = all_dtypes_file
    loader, fb = open_buffer([path])
    got = fb.get_tensor("bfloat16.matrix", device="cpu", dtype=fst.DType.F32)
    U.assert_same_tensor(got, written["bfloat16.matrix"].float())
    got = fb.get_sharded("int64.cube", 1, dtype=torch.int16)  # any dtype, as the original
    U.assert_same_tensor(got, written["int64.cube"].to(torch.int16))
    got = fb.get_tensor("float32.matrix", dtype=fst.DType.AUTO)
    U.assert_same_tensor(got, written["float32.matrix"])
    got = fb.get_tensor("float32.matrix", dtype="float16")  # torch's names work too
    U.assert_same_tensor(got, written["float32.matrix"].half())
    with pytest.raises(ValueError, match="unknown dtype"):
        fb.get_tensor("float32.matrix", dtype="float7")


@pytest.mark.parametrize(
    "requested, env, current, expected",
    [
        (None, {}, 0, 0),
        (None, {"LOCAL_RANK": "3"}, 0, 3),  # torchrun, device not set yet
        (None, {"LOCAL_RANK": "3"}, 2, 2),  # the program chose its device: keep it
        (None, {"LOCAL_RANK": "9"}, 0, 0),  # one GPU visible per process (CUDA_VISIBLE_DEVICES)
        (None, {"LOCAL_RANK": "x"}, 1, 1),
        (5, {"LOCAL_RANK": "1"}, 0, 5),  # an explicit, existing index is respected
        (9, {"LOCAL_RANK": "1"}, 0, 1),  # cuda:{global rank} on the second node -> local
        (9, {}, 4, 4),
    ],
)
def test_device_index_is_the_local_one(requested, env, current, expected):
    got = pick_cuda_index(requested, rank_hints=[9], device_count=8, current_device=current, env=env)
    assert got == expected


def test_device_index_rank_remap_warns_and_unknown_index_fails(caplog):
    with caplog.at_level(logging.WARNING, logger="fastsafetensors_rs.compat"):
        assert pick_cuda_index(12, rank_hints=[12, 4], device_count=4, current_device=0,
                               env={"LOCAL_RANK": "0"}) == 0
    assert "cuda:12" in caplog.text and "LOCAL_RANK" in caplog.text
    with pytest.raises(ValueError, match="cuda:7 does not exist"):
        pick_cuda_index(7, rank_hints=[1], device_count=4, current_device=0, env={})
    with pytest.raises(RuntimeError, match="sees none"):
        pick_cuda_index(None, rank_hints=[0], device_count=0, current_device=0, env={})


def test_device_arguments():
    for device in ("cpu", torch.device("cpu"), "CPU"):
        assert fst.SafeTensorsFileLoader(None, device).device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees none"):
            fst.SafeTensorsFileLoader(None, "cuda")
    with pytest.raises(ValueError, match=r"cannot load to device 'meta' \(only cpu and cuda\)"):
        fst.SafeTensorsFileLoader(None, "meta")


# ---------------------------------------------------------------- lifetimes and memory


# Run in a process of its own: it starts (and destroys) the default process group.
RELEASE_SCRIPT = """
import gc, sys, torch.distributed as dist, fastsafetensors_rs as fst
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
pg = dist.group.WORLD
before = sys.getrefcount(pg)
loader = fst.SafeTensorsFileLoader(pg, "cpu")
loader.add_filenames({0: [sys.argv[1]]})
fb = loader.copy_files_to_device()
held = sys.getrefcount(pg)
fb.close()
loader.close()
gc.collect()
print("refs", before, held, sys.getrefcount(pg))
"""


def test_close_lets_go_of_the_process_group(medium_file, tmp_path):
    """After close(), neither the buffer nor the loader keeps the group alive, so that
    destroy_process_group() tears it down (a gloo group still referenced at exit can abort
    the process under torch 2.15)."""
    path, _ = medium_file
    proc = U.run_python(RELEASE_SCRIPT, path, tmp_path / "store")
    # gloo may print its own lines (torch 2.8: "[Gloo] Rank 0 is connected to ...")
    line = [ln for ln in U.check_output(proc).splitlines() if ln.startswith("refs ")][-1]
    before, held, after = map(int, line.split()[1:])
    assert held > before  # the check can see a reference when there is one
    assert after == before


def test_a_closed_loader_refuses_more_work(medium_file):
    path, _ = medium_file
    loader, fb = open_buffer([path])
    loader.close()
    loader.close()  # idempotent
    with pytest.raises(RuntimeError, match="add_filenames: the loader is closed"):
        loader.add_filenames({0: [str(path)]})
    with pytest.raises(RuntimeError, match="copy_files_to_device: the loader is closed"):
        loader.copy_files_to_device()
    assert fb.get_tensor("a.weight").shape == (1024, 1024)  # the buffer is still open


def test_tensors_stay_valid_after_close(medium_file):
    path, written = medium_file
    loader, fb = open_buffer([path])
    got = {name: fb.get_tensor(name) for name in fb.keys()}
    shard = fb.get_sharded("a.weight", 0)
    fb.close()
    loader.close()
    del fb, loader
    gc.collect()
    junk = [torch.full((1 << 18,), 7, dtype=torch.int64) for _ in range(16)]
    del junk
    U.assert_same_dict(got, written)
    U.assert_same_tensor(shard, written["a.weight"])


def test_a_closed_buffer_says_so(medium_file):
    path, _ = medium_file
    loader, fb = open_buffer([path])
    fb.close()
    fb.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed.*'a.weight'"):
        fb.get_tensor("a.weight")
    with pytest.raises(RuntimeError, match="closed.*'a.weight'"):
        fb.get_sharded("a.weight", 0)  # its process group is gone too
    assert fb.get_shape("a.weight") == [1024, 1024]  # metadata stays


PL_RSS_SCRIPT = r"""
import gc, json, sys, torch, psutil
import fastsafetensors_rs as fst
files = sys.argv[1:]
proc = psutil.Process()
rss = lambda: proc.memory_info().rss
gc.collect()
base = rss()
peak, kept = 0, {}
pl = fst.ParallelLoader(fst.SingleGroup(), files, use_tqdm_on_load=False)
for name, t in pl.iterate_weights():
    kept[name] = t
    t.reshape(-1)[::1024].sum()  # touch every page, mapped or not
    peak = max(peak, rss() - base)
pl.close()
gc.collect()
after = rss() - base
ok = all(bool((t == float(name.split(".")[1])).all()) for name, t in kept.items())
print(json.dumps({"peak": peak, "after": after, "n": len(kept), "ok": ok,
                  "bytes": sum(t.numel() * t.element_size() for t in kept.values())}))
"""


def test_parallel_loader_makes_no_copies_in_one_process(tmp_path):
    """The original clones every tensor in a single process (2x while loading); here the
    tensors are the loaded files themselves, so the peak is the checkpoint's size."""
    files = []
    for i in range(3):  # 3 x 48 MiB
        tensors = {f"f{i}.{3 * i + j}": torch.full((1024, 4096), float(3 * i + j)) for j in range(3)}
        files.append(U.write_checkpoint(tmp_path / f"m{i}.safetensors", tensors))
    proc = U.run_python(PL_RSS_SCRIPT, *files, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    got = json.loads(U.check_output(proc).strip().splitlines()[-1])
    total = got["bytes"]
    assert got["ok"] and got["n"] == 9 and total == 144 * MiB
    mib = {k: round(got[k] / MiB) for k in ("peak", "after", "bytes")}
    assert got["peak"] < total + 24 * MiB, mib
    assert total - 8 * MiB < got["after"] < total + 24 * MiB, mib


# ---------------------------------------------------------------- fastsafe_open


def test_fastsafe_open_list_str_and_dict(multi_file_model):
    paths, shards = multi_file_model
    written = {k: v for s in shards for k, v in s.items()}
    for files in ([str(p) for p in paths], {0: [str(p) for p in paths]}):
        with fst.fastsafe_open(files, framework="pt", device="cpu") as f:
            assert sorted(f.keys()) == sorted(written)
            U.assert_same_dict({k: f.get_tensor(k) for k in f.keys()}, written)
            assert f.metadata() == {str(p): {"format": "pt", "shard": str(i)} for i, p in enumerate(paths)}
    with fst.fastsafe_open(str(paths[0])) as f:
        t = f.get_tensor("model.embed_tokens.weight")
    with pytest.raises(RuntimeError, match="closed"):
        f.get_tensor("model.embed_tokens.weight")
    U.assert_same_tensor(t, written["model.embed_tokens.weight"])  # valid after close


def test_null_metadata(null_metadata_file):
    path, written = null_metadata_file
    with fst.fastsafe_open(path) as f:
        assert f.metadata() == {str(path): None}
        U.assert_same_dict({k: f.get_tensor(k) for k in f.keys()}, written)
    loader, fb = open_buffer([path])
    U.assert_same_dict({k: fb.get_tensor(k) for k in fb.keys()}, st_load_file(str(path)))


# ---------------------------------------------------------------- errors


def test_unknown_tensor_is_a_key_error_and_a_value_error(medium_file):
    path, _ = medium_file
    loader, fb = open_buffer([path])
    for exc in (KeyError, ValueError):
        with pytest.raises(exc) as info:
            fb.get_tensor("nope")
        assert "'nope'" in str(info.value) and str(path) in str(info.value)
    with pytest.raises(KeyError, match="'nope'"):
        loader.get_shape("nope")


def test_add_filenames_errors(tmp_path, multi_file_model):
    paths, _ = multi_file_model
    loader = fst.SafeTensorsFileLoader(fst.SingleGroup(), "cpu")
    with pytest.raises(ValueError, match="rank 1 is not a rank of the process group"):
        loader.add_filenames({1: [str(paths[0])]})
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(paths[0].read_bytes())
    loader.add_filenames({0: [str(paths[0])]})
    with pytest.raises(ValueError, match=f"tensor '.*' is in both {paths[0]} and {copy}"):
        loader.add_filenames({0: [str(copy)]})
    bad = U.write_raw(tmp_path / "bad.safetensors", b"{not json")
    with pytest.raises(RuntimeError, match="bad.safetensors"):
        loader.add_filenames({0: [str(bad)]})
    with pytest.raises(RuntimeError, match="missing.safetensors"):
        loader.add_filenames({0: [str(tmp_path / "missing.safetensors")]})
    with pytest.raises(ValueError, match="framework 'paddle'"):
        fst.SafeTensorsFileLoader(None, "cpu", framework="paddle")


def test_bad_dims_name_the_tensor(medium_file):
    path, _ = medium_file
    loader, fb = open_buffer([path])
    with pytest.raises(ValueError, match=r"'b.bias' in .*medium.safetensors.*dim 1"):
        fb.get_sharded("b.bias", 1)
    with pytest.raises(ValueError, match="'d.scalar'.*dim 0"):
        fb.get_sharded("d.scalar", 0)
    with pytest.raises(ValueError, match="dst_rank 1"):
        fb.push_tensor("b.bias", 1)


def test_options_of_the_original_are_accepted(medium_file):
    path, written = medium_file
    loader = fst.SafeTensorsFileLoader(
        fst.SingleGroup(), "cpu", bbuf_size_kb=1024, max_threads=4, nogds=True, set_numa=False,
        disable_cache=False, debug_log=False, framework="pt", max_pinned_memory_in_kb=1024,
    )
    loader.add_filenames({0: [path]})
    fb = loader.copy_files_to_device(dtype=fst.DType.AUTO, use_buf_register=False, max_copy_block_size=1 << 20)
    U.assert_same_dict({k: t.get_raw() for k, t in fb.as_dict({k: -1 for k in fb.keys()}).items()}, written)


def test_reset_and_reuse(multi_file_model):
    paths, shards = multi_file_model
    loader = fst.SafeTensorsFileLoader(fst.SingleGroup(), "cpu")
    for path, shard in zip(paths, shards):
        loader.add_filenames({0: [str(path)]})
        fb = loader.copy_files_to_device()
        U.assert_same_dict({k: fb.get_tensor(k) for k in fb.keys()}, shard)
        fb.close()
        loader.reset()
        assert loader.get_keys() == []


# ---------------------------------------------------------------- weight iterators


@pytest.mark.parametrize("queue_size", [-1, 0, 2])
def test_parallel_loader_single_process(multi_file_model, queue_size):
    paths, shards = multi_file_model
    written = {k: v for s in shards for k, v in s.items()}
    pl = fst.ParallelLoader(None, [str(p) for p in paths], queue_size=queue_size, use_tqdm_on_load=False)
    got = list(pl.iterate_weights())
    pl.close()
    assert [n for n, _ in got] == [n for p in paths for n in torch.ops.fastsafetensors.describe(str(p))[0]]
    U.assert_same_dict(dict(got), written)


def test_parallel_loader_takes_one_path_as_one_file(multi_file_model):
    from pathlib import Path

    paths, shards = multi_file_model
    for one in (str(paths[0]), Path(paths[0])):
        pl = fst.ParallelLoader(fst.SingleGroup(), one, use_tqdm_on_load=False)
        assert pl.hf_weights_files == [str(paths[0])]
        U.assert_same_dict(dict(pl.iterate_weights()), shards[0])
        pl.close()


def test_parallel_loader_stops_early_and_reports_errors(multi_file_model, tmp_path):
    paths, shards = multi_file_model
    pl = fst.ParallelLoader(fst.SingleGroup(), [str(p) for p in paths], use_tqdm_on_load=False)
    it = pl.iterate_weights()
    name, first = next(it)
    pl.close()
    assert list(it) == []
    U.assert_same_tensor(first, shards[0][name])
    with pytest.raises(ValueError, match="max_concurrent_producers"):
        fst.ParallelLoader(None, [], max_concurrent_producers=2)
    missing = str(tmp_path / "gone.safetensors")
    pl = fst.ParallelLoader(None, [str(paths[0]), missing], use_tqdm_on_load=False)
    seen = []
    with pytest.raises(RuntimeError, match="gone.safetensors"):
        for name, _ in pl.iterate_weights():
            seen.append(name)
    assert sorted(seen) == sorted(shards[0]), "the first file's tensors came before the error"


def test_vllm_style_iterator_runs_unchanged(multi_file_model):
    """The body of vLLM's (and SGLang's) fastsafetensors_weights_iterator, with the device
    made "cpu": the attribute and call names it depends on all exist."""
    paths, shards = multi_file_model
    hf_weights_files = [str(p) for p in paths]

    got = dict(U.vllm_weights_iterator(hf_weights_files))
    U.assert_same_dict(got, {k: v for s in shards for k, v in s.items()})


# ---------------------------------------------------------------- the original's tensor wrapper


def test_what_returns_a_wrapper_and_what_returns_a_tensor(tmp_path):
    """As in 0.3-0.5: get_multi_cols, as_dict and the *_wrapped getters return the wrapper
    (TGIS unwraps with `.get_raw()`); get_tensor, get_sharded and push_tensor the tensor."""
    q, k, v = (U.finite_tensor(torch.bfloat16, (n, 8), i) for i, n in enumerate((12, 4, 4)))
    path = U.write_checkpoint(tmp_path / "qkv.safetensors", {"q": q, "k": k, "v": v})
    loader, fb = open_buffer([path])
    qkv = fb.get_multi_cols(["q", "k", "v"], dim=0)
    assert isinstance(qkv, fst.compat.TorchTensor) and isinstance(qkv, fst.compat.TensorBase)
    U.assert_same_tensor(qkv.get_raw(), torch.cat([q, k, v]))
    got = fb.as_dict({"q": -1, "k": 0, "v": 1})
    assert list(got) == ["q", "k", "v"]
    for name, want in (("q", q), ("k", k), ("v", v)):
        assert isinstance(got[name], fst.compat.TorchTensor)
        U.assert_same_tensor(got[name].get_raw(), want)
    U.assert_same_tensor(fb.get_tensor_wrapped("k").get_raw(), k)
    U.assert_same_tensor(fb.get_sharded_wrapped("v", 1, dtype=fst.DType.F32).get_raw(), v.float())
    for plain in (fb.get_tensor("q"), fb.get_sharded("q", 0), fb.push_tensor("q", 0)):
        assert type(plain) is torch.Tensor
    fb.close()
    loader.close()


def test_the_wrapper_offers_what_the_original_does(tmp_path):
    a = U.finite_tensor(torch.float32, (4, 6), 1)
    f4 = U.random_tensor(torch.float4_e2m1fn_x2, (2, 3), 2)
    path = U.write_checkpoint(tmp_path / "w.safetensors", {"a": a, "f4": f4})
    loader, fb = open_buffer([path])
    w = fb.get_multi_cols(["a"], 0)
    raw = w.get_raw()
    assert (w.dtype, w.device, w.real_tensor) == (fst.DType.F32, torch.device("cpu"), raw)
    assert w.get_shape() == [4, 6] and w.get_nbytes() == 96 and w.data_ptr() == raw.data_ptr()
    assert w.to() is w and w.to(device="cpu", dtype=fst.DType.AUTO) is w, "nothing to change: itself"
    half = w.to(dtype=fst.DType.F16)
    assert (half.dtype, half.get_raw().dtype) == (fst.DType.F16, torch.float16)
    assert torch.equal(half.get_raw(), a.half())
    assert torch.equal(w[1:3].get_raw(), a[1:3]) and w[1:3].dtype == fst.DType.F32
    assert torch.equal(w.view(fst.DType.I32).get_raw(), a.view(torch.int32))
    assert torch.equal(w.reshape([6, 4]).get_raw(), a.reshape(6, 4))
    assert torch.equal(w.detach().get_raw(), a) and torch.equal(w[:, 1].contiguous().get_raw(), a[:, 1])
    copy = w.clone()
    assert torch.equal(copy.get_raw(), a) and copy.data_ptr() != w.data_ptr()
    buf = bytearray(96)
    w.copy_to_buffer(memoryview(buf))
    assert bytes(buf) == a.numpy().tobytes()
    packed = fb.get_multi_cols(["f4"], 0)
    assert packed.dtype == fst.DType.F4 and packed.get_shape() == [2, 6], "the header's shape, as the original"
    fb.close()
    loader.close()


# ---------------------------------------------------------------- saver (IBM's save_sharded)


def test_save_sharded_writes_ibm_shards_that_load_back(tmp_path):
    from fastsafetensors_rs.compat import saver

    tensors = {f"layer{i}.w": U.random_tensor(torch.bfloat16, (64 * (i + 1), 32), i) for i in range(5)}
    tensors["scale"] = U.random_tensor(torch.float8_e4m3fn, (7,), 9)
    entries = [saver.plain_entry(name, t) for name, t in tensors.items()]
    assert entries[0].nbytes == tensors["layer0.w"].numel() * 2
    paths = saver.save_sharded(entries, str(tmp_path / "ckpt" / "model"), num_shards=3,
                               metadata={"format": "pt"}, shard0_metadata={"index": "{}"},
                               shard_metadata=lambda shard: {"tensors": str(len(shard))})
    assert [p.rsplit("/", 1)[-1] for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sets, members = set(), []
    for i, path in enumerate(paths):
        md = fst.safe_open(path, "pt").metadata()
        assert (md["fst.shard.index"], md["fst.shard.count"], md["format"]) == (str(i), "3", "pt")
        assert ("index" in md) == (i == 0)
        sets.add(md["fst.shard.set"])
        members.append(sorted(fst.safe_open(path, "pt").keys()))
        assert md["tensors"] == str(len(members[-1]))
    assert len(sets) == 1
    # IBM's balance: largest first into the emptiest shard.
    assert members == [["layer4.w", "scale"], ["layer0.w", "layer3.w"], ["layer1.w", "layer2.w"]]
    loaded = fst.load(paths)
    for name, t in tensors.items():
        U.assert_same_tensor(loaded[name], t, name)
    # ParallelSaver, the class IBM's package exports, writes the same way.
    out = fst.ParallelSaver(num_shards=2).save(tensors, str(tmp_path / "p" / "model"))
    assert sorted(fst.load(out)) == sorted(tensors)


@pytest.mark.parametrize("refused", ["shared-memory", "complex128", "qint8"])
def test_a_tensor_refused_in_a_later_shard_publishes_no_shard(tmp_path, refused):
    """IBM's balance puts the big tensor in shard 1 and the two others in shard 2, where one is
    refused: no shard is published (every shard is written before any is renamed), and the
    directory keeps what it held."""
    from fastsafetensors_rs.compat import saver

    base = torch.arange(8, dtype=torch.float32)
    second = {"shared-memory": base[2:6], "complex128": torch.zeros(2, dtype=torch.complex128),
              "qint8": torch.quantize_per_tensor(torch.zeros(3), 0.5, 0, torch.qint8)}[refused]
    tensors = {"big": torch.zeros(1000), "base": base, "second": second}
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"an earlier shard")
    # Entries made by hand (plain_entry refuses those dtypes at once), as an encoder's are.
    entries = [saver.WriteEntry(n, None, list(t.shape), t.numel() * t.element_size(), t) for n, t in tensors.items()]
    with pytest.raises(RuntimeError) as info:
        saver.save_sharded(entries, str(d / "model"), num_shards=2)
    msg = str(info.value)
    assert "\n" not in msg and ("'second'" in msg or "'base'" in msg), msg
    assert sorted(os.listdir(d)) == ["model-00001-of-00002.safetensors"]
    assert (d / "model-00001-of-00002.safetensors").read_bytes() == b"an earlier shard"


def test_save_sharded_refuses_what_it_cannot_do(tmp_path):
    from fastsafetensors_rs.compat import saver

    entries = [saver.plain_entry("w", torch.zeros(4))]
    with pytest.raises(NotImplementedError, match="custom fill"):
        saver.save_sharded(entries, str(tmp_path / "m"), num_shards=1, fill=lambda work: None)
    with pytest.raises(ValueError, match="header_align=64"):
        saver.save_sharded(entries, str(tmp_path / "m"), num_shards=1, header_align=64)
    with pytest.raises(ValueError, match="duplicate"):
        saver.save_sharded(entries * 2, str(tmp_path / "m"), num_shards=1)
    with pytest.raises(ValueError, match="reserved"):
        saver.save_sharded(entries, str(tmp_path / "m"), num_shards=1,
                           shard_metadata=lambda shard: {"fst.shard.set": "x"})
    assert list(tmp_path.iterdir()) == []
