"""The fastsafetensors-compatible API in real multi-process runs: 2 and 3 ranks on CPU with
gloo (file:// rendezvous, loopback only).

This file is also the worker: pytest starts one `python test_compat_dist.py ...` per rank,
each runs every scenario through the public API and saves what it got; the tests then
compare every rank's results, bit for bit, with tensors loaded by safetensors and sliced
here. A rank is given the real path only for the files it reads; for every other file it
gets a decoy with the same header and zeroed data, so any tensor that did not travel
through a collective from its owner shows up as wrong bytes.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fst_testutils as U  # noqa: E402

MiB = 1 << 20
WORKER_TIMEOUT_S = 120

# ---------------------------------------------------------------- the checkpoints

SPREAD = [f"spread-{i}.safetensors" for i in range(4)]
QKV_A, QKV_B = "qkv-a.safetensors", "qkv-b.safetensors"
MANY = "many-small.safetensors"
ERR = [f"err-{i}.safetensors" for i in range(3)]
HF_DIR = "hf-model"
HF_SHARDS = [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
MEM = [f"mem-{i}.safetensors" for i in range(3)]
MEM_SHAPE = (1024, 4096)  # f32: 16 MiB a tensor, 4 a file


def spread_tensors() -> list[dict[str, torch.Tensor]]:
    """Four files with every kind of tensor: dtypes of every width, sizes that divide by
    neither 2 nor 3, a dimension smaller than the world, a zero-sized and a 0-d tensor."""
    F, R = U.finite_tensor, U.random_tensor
    return [
        {
            "emb": F(torch.bfloat16, (10, 6), 1),
            "w.f32": F(torch.float32, (7, 5), 2),
            "ids": R(torch.int64, (9,), 3),
            "mask": R(torch.bool, (4, 4), 4),
            "s.f64": F(torch.float64, (), 5),
        },
        {
            "q.f8": R(torch.float8_e4m3fn, (6, 9), 6),
            "u16": R(torch.uint16, (5,), 7),
            "scale.e8m0": R(torch.float8_e8m0fnu, (3,), 8),
            "norm": F(torch.float16, (12,), 9),
            "wide": F(torch.float32, (3, 10), 10),
        },
        {  # written with a null __metadata__ and a header that is not 8-byte aligned
            "z.empty": F(torch.float32, (0, 4), 11),
            "z.w": F(torch.bfloat16, (2, 3), 12),
            "z.i8": R(torch.int8, (5, 2), 13),
        },
        {
            "c64": F(torch.complex64, (4, 2), 14),
            "f4": R(torch.float4_e2m1fn_x2, (4, 4), 15),
            "one": F(torch.float32, (1, 5), 16),
            "e5": R(torch.float8_e5m2, (2, 2), 17),
        },
    ]


def qkv_tensors() -> tuple[dict, dict]:
    F = U.finite_tensor
    a = {
        "attn.q": F(torch.bfloat16, (12, 4), 21),
        "attn.k": F(torch.bfloat16, (5, 4), 22),
        "attn.v": F(torch.bfloat16, (5, 4), 23),
        "mlp.gate": F(torch.float32, (4, 7), 24),
        "mlp.up": F(torch.float32, (4, 3), 25),
    }
    b = {"x.k": F(torch.bfloat16, (7, 4), 26), "x.up": F(torch.float32, (4, 5), 27)}
    return a, b


def many_small_tensors() -> dict[str, torch.Tensor]:
    """200 small tensors (a layer's norms, biases and scales) with two large ones among
    them (same dtype, so that the file keeps them in name order)."""
    out = {}
    for i in range(200):
        out[f"layers.{i:03d}.norm"] = U.finite_tensor(torch.float32, (1 + i % 37,), 100 + i)
        if i in (50, 150):
            out[f"layers.{i:03d}.big"] = U.finite_tensor(torch.float32, (512, 1024), 400 + i)
    return out


def hf_shards() -> list[dict[str, torch.Tensor]]:
    F = U.finite_tensor
    shards = []
    for s in range(5):
        shard = {}
        for layer in (2 * s, 2 * s + 1):
            p = f"model.layers.{layer}"
            shard[f"{p}.self_attn.qkv_proj.weight"] = F(torch.bfloat16, (48, 32), 1000 + layer)
            shard[f"{p}.mlp.down_proj.weight"] = F(torch.bfloat16, (32, 40), 2000 + layer)
            shard[f"{p}.input_layernorm.weight"] = F(torch.float32, (32,), 3000 + layer)
        shards.append(shard)
    shards[0]["model.embed_tokens.weight"] = F(torch.bfloat16, (50, 32), 7)
    shards[4]["lm_head.weight"] = F(torch.bfloat16, (50, 32), 8)
    return shards


def write_null_metadata(path: Path, tensors: dict) -> None:
    header, data, _ = U.layout(tensors.items())
    U.write_raw(path, {"__metadata__": None, **header}, data)


def write_decoy(src: Path, dst: Path) -> None:
    """`src`'s header, then as many zero bytes as its data."""
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    with open(dst, "wb") as f:
        f.write(raw[: 8 + n])
        f.truncate(len(raw))


def build_checkpoints(d: Path) -> None:
    for i, tensors in enumerate(spread_tensors()):
        path = d / SPREAD[i]
        if i == 2:
            write_null_metadata(path, tensors)
        else:
            U.write_checkpoint(path, tensors, metadata={"shard": str(i)})
        write_decoy(path, d / ("decoy-" + SPREAD[i]))
    a, b = qkv_tensors()
    for name, tensors in ((QKV_A, a), (QKV_B, b)):
        U.write_checkpoint(d / name, tensors)
        write_decoy(d / name, d / ("decoy-" + name))
    U.write_checkpoint(d / MANY, many_small_tensors())
    write_decoy(d / MANY, d / ("decoy-" + MANY))
    for i, name in enumerate(ERR):
        U.write_checkpoint(d / name, {f"err{i}.w": U.finite_tensor(torch.float32, (8,), 50 + i)})
    hf = d / HF_DIR
    hf.mkdir()
    weight_map = {}
    for fname, shard in zip(HF_SHARDS, hf_shards()):
        U.write_checkpoint(hf / fname, shard, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=1)
    )
    for i, name in enumerate(MEM):  # 64 MiB each, and a 16 KiB norm
        tensors = {f"mem{i}.{j}": torch.full(MEM_SHAPE, float(10 * i + j)) for j in range(4)}
        tensors[f"mem{i}.9"] = torch.full(MEM_SHAPE[1:], float(10 * i + 9))
        U.write_checkpoint(d / name, tensors)


def load_reference(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Block `rank` of ceil(size / world) along `dim` (shorter or empty at the end)."""
    n = t.shape[dim]
    b = -(-n // world)
    start = min(rank * b, n)
    return t.narrow(dim, start, max(0, min(n, (rank + 1) * b) - start))


def cat_exact(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat bit for bit, also for dtypes without a cat kernel (float4, e8m0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    dt = tensors[0].dtype
    return torch.cat([t.view(ints[t.element_size()]) for t in tensors], dim=dim).view(dt)


def owner_map(n_files: int, world: int) -> dict[int, list[int]]:
    return {r: [i for i in range(n_files) if i % world == r] for r in range(world)}


# ================================================================ the worker


class Worker:
    def __init__(self, d: Path, rank: int, world: int):
        self.d, self.rank, self.world = d, rank, world
        import torch.distributed as dist

        self.dist = dist
        self.pg = dist.group.WORLD

    def paths(self, names: list[str], owners: dict[int, list[int]]) -> dict[int, list[str]]:
        """{rank: [paths]}: the real file where this rank reads it, a decoy elsewhere."""
        out = {}
        for r, idx in owners.items():
            prefix = "" if r == self.rank else "decoy-"
            out[r] = [str(self.d / (prefix + names[i])) for i in idx]
        return out

    def buffer(self, names, owners, **copy_kwargs):
        import fastsafetensors_rs as fst

        loader = fst.SafeTensorsFileLoader(self.pg, "cpu")
        loader.add_filenames(self.paths(names, owners))
        return loader, loader.copy_files_to_device(**copy_kwargs)

    # ------------------------------------------------------------ scenarios

    def spread(self) -> dict:
        owners = owner_map(len(SPREAD), self.world)
        out: dict = {"bcast": {}, "dim0": {}, "dim1": {}}
        for mode in ("bcast", "dim0", "dim1"):
            loader, fb = self.buffer(SPREAD, owners)
            if mode == "bcast":
                out["keys"] = fb.keys()
                out["files"] = {n: os.path.basename(fb.get_filename(n)) for n in fb.keys()}
            for name in fb.keys():
                ndim = len(fb.get_shape(name))
                if mode == "bcast":
                    out[mode][name] = fb.get_tensor(name)
                elif mode == "dim0" and ndim >= 1:
                    out[mode][name] = fb.get_sharded(name, 0)
                elif mode == "dim1" and ndim >= 2:
                    out[mode][name] = fb.get_sharded(name, 1)
            fb.close()
            loader.close()
            del fb, loader
        _churn()  # reuse any memory wrongly freed under the tensors
        return out

    def dtype(self) -> dict:
        import fastsafetensors_rs as fst

        owners = owner_map(len(SPREAD), self.world)
        out = {}
        loader, fb = self.buffer(SPREAD, owners, dtype=fst.DType.F16)
        out["cast_f16"] = {n: fb.get_tensor(n) for n in fb.keys()}
        fb.close()
        loader, fb = self.buffer(SPREAD, owners, dtype=torch.bfloat16)
        out["bf16_then_f64_dim1"] = fb.get_sharded("w.f32", 1, dtype=fst.DType.F64)
        out["ids_i32"] = fb.get_tensor("ids", dtype=torch.int32)
        out["emb_dim0_f32"] = fb.get_sharded("emb", 0, dtype="F32")
        fb.close()
        return out

    def push(self) -> dict:
        owners = owner_map(len(SPREAD), self.world)
        loader, fb = self.buffer(SPREAD, owners)
        out = {}
        for i, name in enumerate(fb.keys()):
            dst = i % self.world
            out[name] = (dst, fb.push_tensor(name, dst))
        fb.close()
        return out

    def multicols(self) -> dict:
        names = [QKV_A, QKV_B]
        owners = {r: [] for r in range(self.world)}
        owners[0].append(0)
        owners[self.world - 1].append(1)
        out = {}
        loader, fb = self.buffer(names, owners)
        out["qkv_dim0"] = fb.get_multi_cols(["attn.q", "attn.k", "attn.v"], 0).get_raw()
        out["gate_up_dim1"] = fb.get_multi_cols(["mlp.gate", "mlp.up"], 1).get_raw()
        fb.close()
        loader, fb = self.buffer(names, owners)
        out["cross_dim0"] = fb.get_multi_cols(["attn.q", "x.k", "attn.v"], 0).get_raw()
        out["cross_dim1"] = fb.get_multi_cols(["mlp.up", "x.up"], 1).get_raw()
        fb.close()
        return out

    def coalesce(self) -> dict:
        dist = self.dist
        owners = {r: [] for r in range(self.world)}
        owners[self.world - 1] = [0]
        calls = {"n": 0}
        real = dist.broadcast

        def counting(*args, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)

        out = {}
        dist.broadcast = counting
        try:
            loader, fb = self.buffer([MANY], owners)
            out["get_tensor"] = {n: fb.get_tensor(n) for n in fb.keys()}
            out["get_tensor_broadcasts"] = calls["n"]
            fb.close()
            calls["n"] = 0
            loader, fb = self.buffer([MANY], owners)
            out["as_dict"] = {n: t.get_raw() for n, t in fb.as_dict({n: -1 for n in fb.keys()}).items()}
            out["as_dict_broadcasts"] = calls["n"]
            fb.close()
        finally:
            dist.broadcast = real
        return out

    def vllm(self) -> dict:
        """The two shapes of vLLM's fastsafetensors_weights_iterator, run unchanged."""
        from fastsafetensors_rs import SafeTensorsFileLoader, SingleGroup  # noqa: F401
        from fastsafetensors_rs.parallel_loader import ParallelLoader

        hf = self.d / HF_DIR
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        hf_weights_files = sorted({str(hf / f) for f in index["weight_map"].values()})
        out = {}
        for queue_size in (0, -1, 2):
            pg = torch.distributed.group.WORLD if torch.distributed.is_initialized() else SingleGroup()
            pl = ParallelLoader(
                pg=pg,
                hf_weights_files=hf_weights_files,
                queue_size=queue_size,
                use_tqdm_on_load=False,
                device="cpu",
                nogds=pg.size() > 1,
            )
            got = []
            try:
                for name, tensor in pl.iterate_weights():
                    got.append((name, tensor))
            finally:
                pl.close()
            out[f"parallel_loader_q{queue_size}"] = got

        out["key_to_rank_lidx_loop"] = list(U.vllm_weights_iterator(hf_weights_files))
        return out

    def tgis(self) -> dict:
        """The calls of a TGIS-style tensor-parallel weights class, run unchanged."""
        from fastsafetensors_rs.loader import SafeTensorsFileLoader

        pg, device, dtype = self.pg, torch.device("cpu"), torch.float16
        filenames = [str(self.d / QKV_A), str(self.d / QKV_B)]
        loader = SafeTensorsFileLoader(pg, device, bbuf_size_kb=163840 // pg.size(), max_threads=16,
                                       nogds=True, debug_log=False)
        rank_filenames: dict = {rank: [] for rank in range(0, pg.size())}
        for idx, filename in enumerate(sorted(filenames, key=lambda x: os.path.basename(x))):
            rank_filenames[idx % pg.size()].append(filename)
        loader.add_filenames(rank_filenames)
        fb = loader.copy_files_to_device(dtype, max_copy_block_size=1 << 20)
        aliases = {"attn.query.weight": ["attn.q.weight", "attn.q"]}

        def get_alias(tensor_name: str) -> str:
            if fb.get_filename(tensor_name) is None:
                for alias in aliases[tensor_name]:
                    if fb.get_filename(alias) is not None:
                        return alias
                raise RuntimeError(f"weight {tensor_name} does not exist")
            return tensor_name

        out = {
            "shape": fb.get_shape(get_alias("attn.query.weight")),
            "qkv": fb.get_multi_cols([get_alias(n) for n in ("attn.query.weight", "attn.k", "attn.v")],
                                     0, device=device, dtype=dtype).get_raw(),  # as TGIS unwraps it
            "row": fb.get_sharded(get_alias("mlp.gate"), 1, device=device, dtype=dtype),
            "push": fb.push_tensor(get_alias("x.up"), 0, device=device, dtype=dtype),
        }
        fb.close()
        loader.close()
        return out

    def subgroup(self) -> dict:
        """A process group of the last two ranks (group ranks 0 and 1), so that group ranks
        and global ranks differ when the world has 3."""
        import fastsafetensors_rs as fst

        members = [self.world - 2, self.world - 1]
        sub = self.dist.new_group(members)
        if self.rank not in members:
            return {}
        loader = fst.SafeTensorsFileLoader(sub, "cpu")
        loader.add_filenames({0: [str(self.d / QKV_A)], 1: [str(self.d / QKV_B)]})
        fb = loader.copy_files_to_device()
        out = {
            "group_rank": sub.rank(),
            "q_dim0": fb.get_sharded("attn.q", 0),
            "x.up": fb.get_tensor("x.up"),
            "pushed": fb.push_tensor("mlp.gate", 1),
        }
        fb.close()
        return out

    def load_error(self) -> dict:
        """The last rank's file disappears between add_filenames and the read."""
        import fastsafetensors_rs as fst

        files = {r: [str(self.d / ERR[r])] for r in range(self.world)}
        victim = self.d / ERR[self.world - 1]
        loader = fst.SafeTensorsFileLoader(self.pg, "cpu")
        loader.add_filenames(files)
        self.dist.barrier()
        if self.rank == self.world - 1:
            victim.rename(victim.with_suffix(".gone"))
        try:
            loader.copy_files_to_device()
            result = {"raised": None, "message": ""}
        except Exception as exc:
            result = {"raised": type(exc).__name__, "message": str(exc)}
        finally:
            self.dist.barrier()
            if self.rank == self.world - 1:
                victim.with_suffix(".gone").rename(victim)
        # The group still works: every rank stopped at the same point.
        t = torch.tensor([self.rank])
        self.dist.all_reduce(t)
        result["after"] = int(t)
        return result

    def rank_dies(self) -> dict:
        """The last rank exits: before `copy_files_to_device` ($FST_STOP=copy) or once the
        buffer is open ($FST_STOP=get, before any `get_tensor`). The others' next call raises:
        how long it took, and what."""
        import time

        import fastsafetensors_rs as fst

        loader = fst.SafeTensorsFileLoader(self.pg, "cpu")
        loader.add_filenames(self.paths(SPREAD, owner_map(len(SPREAD), self.world)))
        last, stop = self.rank == self.world - 1, os.environ["FST_STOP"]
        start = time.monotonic()
        try:
            if last and stop == "copy":
                os._exit(0)
            fb = loader.copy_files_to_device()
            if last and stop == "get":
                os._exit(0)
            start = time.monotonic()
            for name in fb.keys():
                fb.get_tensor(name)
            return {"raised": None, "seconds": time.monotonic() - start}
        except Exception as e:
            return {"raised": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}

    def memory(self) -> dict:
        """RSS above a baseline while every rank keeps its shard of every tensor: once all
        were handed out, and after the buffer and the loader are closed and dropped. Runs
        first, in a fresh process; large allocations are mmapped (MALLOC_MMAP_THRESHOLD_),
        so that freed memory leaves the RSS."""
        import psutil

        import fastsafetensors_rs as fst

        proc = psutil.Process()
        warm = torch.zeros(MEM_SHAPE)  # warm up gloo and the allocator on the same sizes
        self.dist.broadcast(warm, 0)
        del warm
        gc.collect()
        base = proc.memory_info().rss
        loader = fst.SafeTensorsFileLoader(self.pg, "cpu")
        loader.add_filenames({r: [str(self.d / MEM[r])] for r in range(self.world)})
        fb = loader.copy_files_to_device()
        # Every rank keeps its block of each large tensor and every (whole) norm.
        kept = {n: fb.get_tensor(n) if n.endswith(".9") else fb.get_sharded(n, 0) for n in fb.keys()}
        rows = -(-MEM_SHAPE[0] // self.world)
        rows = min(MEM_SHAPE[0], (self.rank + 1) * rows) - self.rank * rows
        correct = {  # each file's tensor j is filled with 10 * file + j
            n: tuple(t.shape) == (MEM_SHAPE[1:] if n.endswith(".9") else (rows, MEM_SHAPE[1]))
            and bool((t == float(10 * int(n[3]) + int(n[-1]))).all())
            for n, t in kept.items()
        }
        during = proc.memory_info().rss - base
        fb.close()
        loader.close()
        del fb, loader
        gc.collect()
        after = proc.memory_info().rss - base
        kept_bytes = sum(t.numel() * t.element_size() for t in kept.values())
        file_bytes = (4 * MEM_SHAPE[0] + 1) * MEM_SHAPE[1] * 4
        return {"during": during, "after": after, "kept_bytes": kept_bytes,
                "file_bytes": file_bytes, "correct": correct}


def _churn() -> None:
    gc.collect()
    junk = [torch.full((1 << 16,), 7, dtype=torch.int64) for _ in range(32)]
    del junk


SCENARIOS = ["memory", "spread", "dtype", "push", "multicols", "coalesce", "vllm", "tgis",
             "subgroup", "load_error"]


def worker_main(mode: str, d: str, rank: int, world: int, init_file: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    w = Worker(Path(d), rank, world)
    results: dict = {}
    status = 0
    try:
        for name in SCENARIOS if mode == "all" else [mode]:
            results[name] = getattr(w, name)()
    except Exception:
        results["error"] = traceback.format_exc()
        status = 1
    torch.save(results, Path(d) / f"{mode}.w{world}.rank{rank}.pt")
    if status == 0 and mode != "rank_dies":  # (a rank is gone: no barrier can complete)
        dist.barrier()
        dist.destroy_process_group()
    return status


def run_ranks(d: Path, mode: str, world: int, env: dict | None = None) -> list[dict]:
    """Runs `mode` on `world` ranks; returns each rank's results."""
    return U.run_rank_workers(__file__, d, mode, world, WORKER_TIMEOUT_S, lambda rank: env or {})


if __name__ == "__main__":
    mode_, d_, rank_, world_, init_ = sys.argv[1:6]
    U.exit_worker(worker_main(mode_, d_, int(rank_), int(world_), init_))


# ================================================================ the tests

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("compat_dist")
    build_checkpoints(d)
    return d


@pytest.fixture(scope="module")
def ref(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor of every checkpoint, loaded by safetensors."""
    out = {}
    for name in SPREAD + [QKV_A, QKV_B, MANY] + ERR:
        out.update(load_reference(ckpt / name))
    for name in HF_SHARDS:
        out.update(load_reference(ckpt / HF_DIR / name))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def world(request, ckpt):
    """Runs every scenario on 2, then 3 ranks: (world size, [results of each rank])."""
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # see Worker.memory
    return request.param, run_ranks(ckpt, "all", request.param, env=env)


def test_decoys_differ_from_the_real_files(ckpt, ref):
    """Guards the design of these tests: a tensor read from a decoy would be all zeros."""
    for name in SPREAD + [QKV_A, QKV_B, MANY]:
        decoy = load_reference(ckpt / ("decoy-" + name))
        for key, t in decoy.items():
            assert not U.as_bytes(t).any()
            if ref[key].numel():
                assert U.as_bytes(ref[key]).any(), key


def test_broadcast_every_dtype_on_every_rank(world, ref):
    n, results = world
    for rank, res in enumerate(results):
        got = res["spread"]["bcast"]
        want = {k: ref[k] for t in spread_tensors() for k in t}
        assert sorted(got) == sorted(want), f"rank {rank}"
        for k, t in want.items():
            U.assert_same_tensor(got[k], t, f"rank {rank}: {k}")


def test_files_spread_over_ranks(world):
    """Every rank sees the same keys in the same order, and every file on the rank chosen."""
    n, results = world
    keys = results[0]["spread"]["keys"]
    for rank, res in enumerate(results):
        assert res["spread"]["keys"] == keys
        for name, fname in res["spread"]["files"].items():
            i = int(fname.split("spread-")[1].split(".")[0])
            mine = i % n == rank
            assert fname == ("" if mine else "decoy-") + SPREAD[i], (rank, name, fname)


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_even_and_uneven(world, ref, dim):
    n, results = world
    names = [k for t in spread_tensors() for k, v in t.items() if v.dim() > dim]
    sizes = {ref[k].shape[dim] for k in names}
    assert any(s % n for s in sizes) and any(s % n == 0 for s in sizes), "needs both cases"
    for rank, res in enumerate(results):
        got = res["spread"][f"dim{dim}"]
        assert sorted(got) == sorted(names)
        for k in names:
            U.assert_same_tensor(got[k], shard(ref[k], dim, rank, n), f"rank {rank}: {k} dim {dim}")
            if ref[k].numel():
                assert got[k].is_contiguous()


def test_shards_reassemble_the_tensor(world, ref):
    n, results = world
    for dim in (0, 1):
        for k, res0 in results[0]["spread"][f"dim{dim}"].items():
            whole = cat_exact([res["spread"][f"dim{dim}"][k] for res in results], dim)
            U.assert_same_tensor(whole, ref[k], f"{k} dim {dim}")


def test_dtype_conversion(world, ref):
    n, results = world
    floats = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    for rank, res in enumerate(results):
        got = res["dtype"]
        for k, t in got["cast_f16"].items():
            want = ref[k].to(torch.float16) if ref[k].dtype in floats else ref[k]
            U.assert_same_tensor(t, want, f"rank {rank}: {k}")
        want = shard(ref["w.f32"].to(torch.bfloat16).to(torch.float64), 1, rank, n)
        U.assert_same_tensor(got["bf16_then_f64_dim1"], want, "w.f32")
        U.assert_same_tensor(got["ids_i32"], ref["ids"].to(torch.int32), "ids")
        U.assert_same_tensor(got["emb_dim0_f32"], shard(ref["emb"], 0, rank, n).float(), "emb")


def test_push_tensor_reaches_only_its_destination(world, ref):
    n, results = world
    for rank, res in enumerate(results):
        assert len(res["push"]) == sum(len(t) for t in spread_tensors())
        for k, (dst, t) in res["push"].items():
            if rank == dst:
                U.assert_same_tensor(t, ref[k], f"rank {rank}: {k}")
            else:
                assert t is None, f"rank {rank} got {k}, pushed to {dst}"


def test_multi_cols_fused_qkv(world, ref):
    n, results = world

    def fused(names, dim, rank):
        return cat_exact([shard(ref[k], dim, rank, n) for k in names], dim)

    for rank, res in enumerate(results):
        got = res["multicols"]
        U.assert_same_tensor(got["qkv_dim0"], fused(["attn.q", "attn.k", "attn.v"], 0, rank))
        U.assert_same_tensor(got["gate_up_dim1"], fused(["mlp.gate", "mlp.up"], 1, rank))
        U.assert_same_tensor(got["cross_dim0"], fused(["attn.q", "x.k", "attn.v"], 0, rank))
        U.assert_same_tensor(got["cross_dim1"], fused(["mlp.up", "x.up"], 1, rank))


def test_small_broadcasts_are_coalesced(world, ref):
    n, results = world
    want = many_small_tensors()
    for rank, res in enumerate(results):
        got = res["coalesce"]
        for how in ("get_tensor", "as_dict"):
            assert sorted(got[how]) == sorted(want)
            for k, t in want.items():
                U.assert_same_tensor(got[how][k], t, f"rank {rank}: {how} {k}")
            # 202 tensors: the two large ones alone, the 200 small ones in one broadcast.
            assert got[f"{how}_broadcasts"] <= 4, (how, got[f"{how}_broadcasts"])


def test_vllm_iterators_over_an_hf_checkpoint(world, ref):
    n, results = world
    want = {k: ref[k] for shard_ in hf_shards() for k in shard_}
    first = None
    for rank, res in enumerate(results):
        for how, pairs in res["vllm"].items():
            names = [name for name, _ in pairs]
            assert sorted(names) == sorted(want), f"rank {rank} {how}: not every tensor once"
            for name, t in pairs:
                U.assert_same_tensor(t, want[name], f"rank {rank} {how}: {name}")
            first = first or names
            assert names == first, "the same sequence on every rank and in every variant"


def test_tgis_style_loader(world, ref):
    n, results = world
    f16 = {k: ref[k].to(torch.float16) for k in ("attn.q", "attn.k", "attn.v", "mlp.gate", "x.up")}
    for rank, res in enumerate(results):
        got = res["tgis"]
        assert got["shape"] == [12, 4]
        qkv = torch.cat([shard(f16[k], 0, rank, n) for k in ("attn.q", "attn.k", "attn.v")])
        U.assert_same_tensor(got["qkv"], qkv, f"rank {rank}: qkv")
        U.assert_same_tensor(got["row"], shard(f16["mlp.gate"], 1, rank, n), f"rank {rank}: row")
        if rank == 0:
            U.assert_same_tensor(got["push"], f16["x.up"], "push")
        else:
            assert got["push"] is None


def test_a_subgroup_uses_group_ranks(world, ref):
    n, results = world
    for rank, res in enumerate(results):
        got = res["subgroup"]
        if rank < n - 2:
            assert got == {}
            continue
        g = rank - (n - 2)
        assert got["group_rank"] == g
        U.assert_same_tensor(got["q_dim0"], shard(ref["attn.q"], 0, g, 2), f"rank {rank}")
        U.assert_same_tensor(got["x.up"], ref["x.up"], f"rank {rank}")
        if g == 1:
            U.assert_same_tensor(got["pushed"], ref["mlp.gate"], f"rank {rank}")
        else:
            assert got["pushed"] is None


def test_a_failed_read_raises_on_every_rank(world):
    n, results = world
    for rank, res in enumerate(results):
        got = res["load_error"]
        assert got["raised"] is not None, f"rank {rank} did not raise"
        if rank == n - 1:
            assert ERR[n - 1] in got["message"], got
        else:
            assert f"[{n - 1}]" in got["message"], got
        assert got["after"] == sum(range(n)), "the group is still usable"


@pytest.mark.parametrize("stop", ["copy", "get"])
def test_a_rank_that_dies_fails_the_others_at_once_naming_the_files(ckpt, stop):
    """3 ranks; the last exits before copy_files_to_device, or after it before any
    get_tensor. The other two raise at their next call, not hang, in one line naming what they
    were exchanging (the loader's files; the tensor's file) with the process group's error."""
    ranks = run_ranks(ckpt, "rank_dies", 3, {"FST_STOP": stop})
    for r in ranks[:2]:
        result = r["rank_dies"]
        raised = result["raised"]
        assert raised is not None and raised.startswith("RuntimeError: ") and "\n" not in raised, result
        assert "the exchange with the other ranks of the process group failed (a rank died" in raised, raised
        if stop == "copy":
            assert f"{SPREAD[0]} and 3 more files: " in raised, raised
        else:
            assert any(f"{f}: " in raised for f in SPREAD), raised
        assert result["seconds"] < 30, result
        print(f"{stop}: raised after {result['seconds']:.1f} s: {raised[:300]}")


def test_no_memory_retained_beyond_the_callers_tensors(world):
    """Each rank reads a 64 MiB file and keeps its block of every large tensor of every
    file (64 MiB in all) and every small one whole. Once every tensor was handed out, and
    again after close() and dropping the loader, the process holds those and nothing else:
    not its own file too (not even through the small tensor it kept from it)."""
    n, results = world
    for rank, res in enumerate(results):
        m = res["memory"]
        assert len(m["correct"]) == 5 * n and all(m["correct"].values()), m["correct"]
        kept = m["kept_bytes"]
        assert kept > 60 * MiB
        mib = {k: round(m[k] / MiB) for k in ("during", "after", "kept_bytes", "file_bytes")}
        assert m["after"] > kept // 2, f"rank {rank}: blocks not resident? {mib}"
        slack = m["file_bytes"] // 3
        assert m["after"] < kept + slack, f"rank {rank}: memory retained after close: {mib}"
        assert m["during"] < kept + slack, f"rank {rank}: its file kept while open: {mib}"
