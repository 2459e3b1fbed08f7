"""Saves by the ranks of a torch.distributed group (`process_group=`), in real multi-process
runs: 1 to 4 ranks on CPU with gloo (file:// rendezvous, loopback only).

This file is also the worker: pytest starts one `python test_save_distributed.py ...` per rank;
each runs the scenarios through the public API and saves what it saw (the paths returned, the
bytes it wrote to storage per /proc/self/io, its error), and the tests read the checkpoints
back, bit for bit, with safetensors and this package.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fst_testutils as U  # noqa: E402

WORKER_TIMEOUT_S = 180
MB = 1 << 20


def replicated() -> dict[str, torch.Tensor]:
    """~12 MB that every rank holds: 6 tensors of ~2 MB, odd sizes among them."""
    F = U.finite_tensor
    return {f"layers.{i}.w": F(torch.bfloat16, (1024, 1000 + 13 * i), i) for i in range(6)} | {
        "norm": F(torch.float32, (777,), 40), "mask": U.random_tensor(torch.bool, (3, 5), 41)}


def own(rank: int) -> dict[str, torch.Tensor]:
    """What only rank `rank` holds (a pipeline stage): ~3 MB of its own names."""
    F = U.finite_tensor
    return {f"stage{rank}.{i}.w": F(torch.float16, (512 + rank, 1000 + i), 100 * rank + i) for i in range(3)}


def old() -> dict[str, torch.Tensor]:
    return {"old.w": U.finite_tensor(torch.float32, (1000, 300), 7)}


def write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


class Worker:
    def __init__(self, d: Path, rank: int, world: int):
        import torch.distributed as dist

        self.d, self.rank, self.world, self.dist = d, rank, world, dist
        self.group = dist.group.WORLD

    def _measured(self, save) -> dict:
        self.dist.barrier()
        before = write_bytes()
        paths = save()
        return {"paths": paths, "wrote": write_bytes() - before}

    def _fresh(self, name: str) -> Path:
        """A directory holding an earlier checkpoint and a config (made by rank 0)."""
        import fastsafetensors_rs as fst

        out = self.d / f"{name}.w{self.world}"
        if self.rank == 0:
            fst.save(old(), out)
            (out / "config.json").write_text('{"model_type": "llama"}')
        self.dist.barrier()
        return out

    def replicated(self) -> dict:
        import fastsafetensors_rs as fst

        out = self._fresh("replicated")
        return self._measured(lambda: fst.save(replicated(), out, max_shard_size=4 * MB, metadata={"format": "pt"},
                                               process_group=self.group))

    def one_file(self) -> dict:
        import fastsafetensors_rs as fst

        out = self.d / f"one_file.w{self.world}.safetensors"
        return self._measured(lambda: fst.save_file(replicated(), out, process_group=self.group))

    def distinct(self) -> dict:
        import fastsafetensors_rs as fst

        out = self._fresh("distinct")
        tensors = {"embed": replicated()["layers.0.w"]} | own(self.rank)
        return self._measured(lambda: fst.save(tensors, out, max_shard_size=4 * MB, process_group=self.group))

    def one_file_distinct(self) -> dict:
        """One file of tensors the ranks hold apart: refused on every rank, nothing written."""
        import fastsafetensors_rs as fst

        out = self.d / f"one_file_distinct.w{self.world}.safetensors"
        try:
            fst.save_file(own(self.rank), out, process_group=self.group)
            return {"error": None, "exists": out.exists()}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "exists": out.exists()}

    def compat(self) -> dict:
        from fastsafetensors_rs.compat import saver

        base = self.d / f"compat.w{self.world}" / "model"
        return self._measured(lambda: saver.ParallelSaver(num_shards=3, pg=self.group).save(replicated(), str(base)))

    def compat_refused(self) -> dict:
        """The compatible saver failing on one rank before its save starts (its shard_metadata
        raising there): every rank fails naming it, none waits for it."""
        from fastsafetensors_rs.compat import saver

        last = self.rank == self.world - 1

        def shard_metadata(shard):
            if last:
                raise ValueError("no metadata on this rank")
            return {}

        base = self.d / f"compat_refused.w{self.world}" / "model"
        try:
            saver.ParallelSaver(num_shards=2, pg=self.group, shard_metadata=shard_metadata).save(replicated(), str(base))
            return {"error": None}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "files": sorted(os.listdir(base.parent))}

    def refused(self) -> dict:
        """Rank world-1 holds a tensor safetensors has no dtype for: every rank fails naming it."""
        import fastsafetensors_rs as fst

        out = self._fresh("refused")
        tensors = replicated()
        if self.rank == self.world - 1:
            tensors["bad"] = torch.zeros(2, dtype=torch.complex128)
        try:
            fst.save(tensors, out, max_shard_size=4 * MB, process_group=self.group)
            return {"error": None}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def mismatched(self) -> dict:
        """Rank world-1 holds a replicated tensor with another shape: every rank fails naming
        the tensor and both ranks, and the old checkpoint stays."""
        import fastsafetensors_rs as fst

        out = self._fresh("mismatched")
        tensors = replicated()
        if self.rank == self.world - 1:
            name = next(iter(tensors))
            tensors[name] = tensors[name][:1].clone()
        try:
            fst.save(tensors, out, max_shard_size=4 * MB, process_group=self.group)
            return {"error": None}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def killed(self) -> dict:
        """The last rank is killed after writing its bytes, before the group commits: every other
        rank fails (its connections close), and the directory keeps its earlier checkpoint."""
        import fastsafetensors_rs as fst
        from fastsafetensors_rs import saving

        out = self._fresh("killed")
        if self.rank == self.world - 1:
            ops = saving.ops

            class Dying:
                def __getattr__(self, name):
                    return getattr(ops, name)

                @staticmethod
                def save_write(*args):
                    ops.save_write(*args)
                    os.kill(os.getpid(), signal.SIGKILL)

            saving.ops = Dying()
        self.dist.barrier()
        started = time.monotonic()
        try:
            fst.save(replicated(), out, max_shard_size=4 * MB, process_group=self.group)
            return {"error": None}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}


SCENARIOS = ["replicated", "one_file", "distinct", "one_file_distinct", "compat", "compat_refused", "refused",
             "mismatched"]


def worker_main(mode: str, d: str, rank: int, world: int, init_file: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    w = Worker(Path(d), rank, world)
    results: dict = {}
    status = 0
    try:
        for name in SCENARIOS if mode == "all" else [mode]:
            results[name] = getattr(w, name)()
            if mode == "all":
                dist.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
        status = 1
    torch.save(results, Path(d) / f"{mode}.w{world}.rank{rank}.pt")
    if status == 0 and mode == "all":
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    mode_, d_, rank_, world_, init_ = sys.argv[1:6]
    U.exit_worker(worker_main(mode_, d_, int(rank_), int(world_), init_))


# ================================================================ the tests

import json  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
from safetensors.torch import load_file as st_load_file  # noqa: E402

import fastsafetensors_rs as fst  # noqa: E402

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    """Every scenario, once per group size, in one set of rank processes."""
    world = request.param
    d = tmp_path_factory.mktemp(f"save_w{world}")
    results = U.run_rank_workers(__file__, d, "all", world, WORKER_TIMEOUT_S)
    return d, world, results


def checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """The checkpoint in `d` through its index, with safetensors (the index lists every file)."""
    weight_map = json.loads((d / INDEX).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors = st_load_file(str(d / shard))
        assert all(weight_map[k] == shard for k in tensors)
        out.update(tensors)
    assert set(out) == set(weight_map)
    return out


def file_bytes(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths if p.endswith(".safetensors"))


def assert_shared_writing(results, world: int, total: int, key: str) -> None:
    """Each rank wrote about 1/world of the bytes (within the 1 MiB units the writing is split
    into), all of them once (within 256 KiB a rank: the index, the 4 KiB tails of direct
    writes, and what else the process writes meanwhile)."""
    wrote = [r[key]["wrote"] for r in results]
    if sum(wrote) == 0:
        pytest.skip("this filesystem does not count writes in /proc/self/io (tmpfs)")
    print(f"{key}, {world} ranks: {[round(w / MB, 2) for w in wrote]} MiB of {total / MB:.2f}")
    assert total <= sum(wrote) <= total + world * 256 * 1024, wrote
    for w in wrote:
        assert abs(w - total / world) <= MB + 256 * 1024, (wrote, total)


def test_replicated_tensors_are_written_once_shared_by_the_ranks(runs):
    d, world, results = runs
    paths = results[0]["replicated"]["paths"]
    assert all(r["replicated"]["paths"] == paths for r in results)
    out = d / f"replicated.w{world}"
    assert paths[-1] == str(out / INDEX) and len(paths) >= 4
    U.assert_same_dict(checkpoint(out), replicated())
    U.assert_same_dict(fst.load(out), replicated())
    assert sorted(os.listdir(out)) == sorted([Path(p).name for p in paths] + ["config.json"])
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    # The single-process save of the same tensors gives the same files.
    alone = d / "alone"
    fst.save(replicated(), alone, max_shard_size=4 * MB, metadata={"format": "pt"})
    for p in paths:
        assert Path(p).read_bytes() == (alone / Path(p).name).read_bytes(), p
    assert_shared_writing(results, world, file_bytes(paths), "replicated")


def test_one_file_from_every_rank(runs):
    d, world, results = runs
    out = d / f"one_file.w{world}.safetensors"
    assert all(r["one_file"]["paths"] is None for r in results)
    reference = d / "reference.safetensors"
    fst.save_file(replicated(), reference)
    assert out.read_bytes() == reference.read_bytes()
    assert_shared_writing(results, world, out.stat().st_size, "one_file")


def test_ranks_holding_their_own_tensors_write_them_under_one_index(runs):
    d, world, results = runs
    out = d / f"distinct.w{world}"
    expected = {"embed": replicated()["layers.0.w"]}
    for r in range(world):
        expected |= own(r)
    U.assert_same_dict(checkpoint(out), expected)
    U.assert_same_dict(fst.load(out), expected)
    index = json.loads((out / INDEX).read_text())
    # No shard mixes tensors held by different ranks: each holds one rank's own, or the shared one.
    def holders(name):
        return frozenset(range(world)) if name == "embed" else frozenset([int(name.split(".")[0][len("stage"):])])

    for shard in set(index["weight_map"].values()):
        owners = {holders(k) for k, s in index["weight_map"].items() if s == shard}
        assert len(owners) == 1, (shard, owners)
    # Each rank wrote its own tensors and its share of the shared one.
    wrote = [r["distinct"]["wrote"] for r in results]
    if sum(wrote) > 0:
        shared = expected["embed"].nbytes
        for rank, w in enumerate(wrote):
            mine = sum(t.nbytes for t in own(rank).values())
            assert mine <= w <= mine + shared / world + MB + 256 * 1024, (rank, wrote)


def test_one_file_of_tensors_the_ranks_hold_apart_is_refused_on_every_rank(runs):
    d, world, results = runs
    for r in results:
        got = r["one_file_distinct"]
        if world == 1:
            assert got == {"error": None, "exists": True}
            continue
        assert "the ranks give different tensors ('stage0.0.w' from ranks [0], 'stage1.0.w' from ranks [1])" in (
            got["error"]), got
        assert "save a checkpoint directory" in got["error"] and "\n" not in got["error"] and not got["exists"]


def test_the_compatible_parallel_saver_writes_ibm_shards_from_the_group(runs):
    d, world, results = runs
    paths = results[0]["compat"]["paths"]
    assert [Path(p).name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sets = set()
    loaded = {}
    for i, p in enumerate(paths):
        with fst.safe_open(p, "pt") as f:
            md = f.metadata()
        assert (md["fst.shard.index"], md["fst.shard.count"]) == (str(i), "3")
        sets.add(md["fst.shard.set"])
        loaded |= st_load_file(p)
    assert len(sets) == 1
    U.assert_same_dict(loaded, replicated())
    assert_shared_writing(results, world, file_bytes(paths), "compat")


def test_the_compatible_saver_failing_on_one_rank_fails_every_rank(runs):
    d, world, results = runs
    for rank, r in enumerate(results):
        got = r["compat_refused"]
        assert got["error"] is not None and "no metadata on this rank" in got["error"], got
        assert (f"rank {world - 1} of the group" in got["error"]) == (rank != world - 1), got
        assert got["files"] == [], got


def test_a_tensor_refused_on_one_rank_fails_every_rank_and_keeps_the_old_checkpoint(runs):
    d, world, results = runs
    for rank, r in enumerate(results):
        error = r["refused"]["error"]
        assert error is not None and "\n" not in error, error
        assert "tensor 'bad' cannot be saved: safetensors has no dtype for torch.complex128" in error, error
        if rank != world - 1:
            assert f"rank {world - 1} of the group" in error, error
    out = d / f"refused.w{world}"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    U.assert_same_dict(fst.load(out), old())
    assert [n for n in os.listdir(d) if n.startswith(".")] == []


def test_a_replicated_tensor_of_another_shape_on_one_rank_fails_every_rank(runs):
    d, world, results = runs
    name, t = next(iter(replicated().items()))
    out = d / f"mismatched.w{world}"
    for r in results:
        error = r["mismatched"]["error"]
        if world == 1:
            assert error is None, error
            continue
        assert error is not None and "\n" not in error, error
        shape, other = list(t.shape), [1, *t.shape[1:]]
        assert (f"tensor '{name}' cannot be saved: rank 0 holds it as {t.dtype} {shape} and rank {world - 1} as "
                f"{t.dtype} {other}") in error, error
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        U.assert_same_dict(fst.load(out), old())


@pytest.mark.parametrize("world", [3])
def test_a_rank_killed_mid_save_fails_every_rank_and_keeps_the_old_checkpoint(tmp_path, world):
    init_file = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, __file__, "killed", str(tmp_path), str(r), str(world), str(init_file)],
                              env=U.subprocess_env({"GLOO_SOCKET_IFNAME": "lo"}), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=WORKER_TIMEOUT_S)[0] for p in procs]
    assert procs[-1].returncode == -signal.SIGKILL, outputs[-1][-3000:]
    for rank in range(world - 1):
        got = torch.load(tmp_path / f"killed.w{world}.rank{rank}.pt", weights_only=False)
        error = got["killed"]["error"]
        assert error is not None and "\n" not in error and "left the group" in error, (rank, error, outputs[rank])
        assert got["killed"]["seconds"] < 30, got
    out = tmp_path / f"killed.w{world}"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    U.assert_same_dict(fst.load(out), old())
    # What the group made beside it goes with the next save (its processes are gone).
    fst.save(replicated(), out, max_shard_size=4 * MB)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    U.assert_same_dict(fst.load(out), replicated())
