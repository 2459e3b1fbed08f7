"""Loads shared by the ranks of a torch.distributed group (`process_group=`), in real
multi-process runs: 1 to 4 ranks on CPU with gloo (file:// rendezvous, loopback only).

This file is also the worker: pytest starts one `python test_distributed.py ...` per rank;
each runs the scenarios through the public API and saves what it got, and the tests compare
every rank's tensors, bit for bit, with those safetensors loads, and sum the bytes the ranks
read from storage (`read_bytes` of /proc/self/io, after evicting the files).
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

WORKER_TIMEOUT_S = 180

# Uneven files: one of 8 MiB, one of about 1 MiB, one of a few KiB, and a single-tensor one.
FILES = ["big.safetensors", "mid.safetensors", "small.safetensors", "one.safetensors"]


def checkpoint_tensors() -> list[dict[str, torch.Tensor]]:
    F, R = U.finite_tensor, U.random_tensor
    return [
        {f"layers.{i}.w": F(torch.bfloat16, (1024, 1024 + 7 * i), i) for i in range(4)}
        | {"layers.0.ids": R(torch.int64, (1001,), 40), "layers.0.mask": R(torch.bool, (3, 5), 41)},
        {f"layers.{i}.norm": F(torch.float32, (4096 * 16 + i,), 10 + i) for i in range(4)}
        | {"q.f8": R(torch.float8_e4m3fn, (9, 7), 20), "z.empty": F(torch.float32, (0, 3), 21)},
        {"s.f64": F(torch.float64, (), 30), "f4": R(torch.float4_e2m1fn_x2, (4, 4), 31),
         "c64": F(torch.complex64, (3, 2), 32), "odd.f16": F(torch.float16, (3,), 33)},
        {"lm_head": F(torch.float16, (513, 1000), 50)},
    ]


def build(d: Path) -> None:
    for name, tensors in zip(FILES, checkpoint_tensors()):
        U.write_checkpoint(d / name, tensors)
    # One rank's own copy, later cut short (the read-failure scenario).
    for r in range(4):
        (d / f"rank{r}").mkdir(exist_ok=True)
        U.write_checkpoint(d / f"rank{r}" / "model.safetensors", checkpoint_tensors()[1])
    sign_shards(d)
    flip_each_file(d)


def flip_each_file(d: Path) -> None:
    """`flipped{i}/`: the checkpoint with one byte in the middle of file i's tensor data
    flipped (the other files hard links to the originals)."""
    for i, name in enumerate(FILES):
        (d / f"flipped{i}").mkdir()
        for other in FILES:
            if other != name:
                os.link(d / other, d / f"flipped{i}" / other)
        data = bytearray((d / name).read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        data[(start + len(data)) // 2] ^= 0x01
        (d / f"flipped{i}" / name).write_bytes(bytes(data))


SHARD = 64 << 10


def sign_shards(d: Path) -> None:
    """`signed/model.safetensors`, signed by model_signing with a manifest of 64 KiB shards
    (`shards.sig`, key `shards.pub`), and `edited/`, the same file with one byte of a tensor in
    the middle of its third shard changed after signing (`edited.txt` names that tensor)."""
    import shutil

    import model_signing
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    signed = d / "signed"
    signed.mkdir()
    U.write_checkpoint(signed / "model.safetensors",
                       {f"t{i}": U.finite_tensor(torch.float32, (5000 + 11 * i,), 60 + i) for i in range(12)})
    key = ec.generate_private_key(ec.SECP256R1())
    (d / "shards.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    (d / "shards.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    hashing = model_signing.hashing.Config().use_shard_serialization(shard_size=SHARD)
    model_signing.signing.Config().use_elliptic_key_signer(private_key=d / "shards.pem").set_hashing_config(
        hashing).sign(signed, d / "shards.sig")
    shutil.copytree(signed, d / "edited")
    at = 2 * SHARD + SHARD // 2
    data = bytearray((d / "edited" / "model.safetensors").read_bytes())
    data[at] ^= 0x10
    (d / "edited" / "model.safetensors").write_bytes(bytes(data))
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    at -= 8 + header_len
    tensors = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    (d / "edited.txt").write_text(next(k for k, (a, b) in tensors.items() if a <= at < b))


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


class Worker:
    def __init__(self, d: Path, rank: int, world: int):
        import torch.distributed as dist

        self.d, self.rank, self.world, self.dist = d, rank, world, dist
        self.files = [str(d / f) for f in FILES]
        self.group = dist.group.WORLD

    def _measured(self, load):
        """`load()` once untimed (so that code it pages in, such as a cast's kernels in a fresh
        environment, is not counted), then again with the files evicted: its result and the
        bytes it read from storage."""
        load()
        self._cold(self.files)
        before = read_bytes()
        out = load()
        return out, read_bytes() - before

    def _digests(self) -> dict:
        """Each file's sha256 digest, by name: what `fst.Digests` takes."""
        import hashlib

        return {Path(f).name: "sha256:" + hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in self.files}

    def _cold(self, files) -> None:
        """Every file evicted from the page cache, by rank 0, before every rank goes on."""
        if self.rank == 0:
            for f in files:
                U.make_cold(f)
        self.dist.barrier()

    def bulk(self) -> dict:
        import fastsafetensors_rs as fst

        # Measured after an untimed run, as `sharded` is: the first load of a fresh process
        # pages in code, which read_bytes counts (one rank read 0.5 MB more than its share).
        out, read = self._measured(lambda: fst.load(self.files, process_group=self.group, reader="direct"))
        one = fst.load_file(self.files[3], process_group=self.group)  # fewer files than ranks
        return {"tensors": out, "read": read, "one": one}

    def verified(self) -> dict:
        """A verified shared load: every file checked once by one rank; a digest that does not
        match (the last file's, replaced) fails every rank alike."""
        import fastsafetensors_rs as fst

        from fastsafetensors_rs.distributed import verified_bytes

        digests = self._digests()
        before = verified_bytes()
        out = fst.load(self.files, process_group=self.group, verify=fst.Digests(digests))
        hashed = verified_bytes() - before
        wrong = {**digests, FILES[-1]: "sha256:" + "0" * 64}
        try:
            fst.load(self.files, process_group=self.group, verify=fst.Digests(wrong))
            error = None
        except RuntimeError as e:
            error = str(e)
        return {"tensors": out, "error": error, "hashed": hashed}

    def verified_stream(self) -> dict:
        """A verified shared stream (and a verified handle's `tensors()`): bit-exact, each file
        hashed once in the group; the first file's digest wrong fails every rank at the end of
        that file, before any tensor of a later file."""
        import fastsafetensors_rs as fst

        digests = self._digests()
        out = {n: t.clone() for n, t in fst.stream(self.files, process_group=self.group, max_memory="1M",
                                                     verify=fst.Digests(digests))}
        with fst.safe_open(self.files[1:], verify=fst.Digests(digests)) as f:
            handle = dict(f.tensors(process_group=self.group))
        wrong = {**digests, FILES[0]: "sha256:" + "0" * 64}
        seen, error = [], None
        try:
            for name, _ in fst.stream(self.files, process_group=self.group, max_memory="1M",
                                      verify=fst.Digests(wrong)):
                seen.append(name)
        except RuntimeError as e:
            error = str(e)
        return {"tensors": out, "safe_open": handle, "error": error, "seen": seen}

    def verified_shards(self) -> dict:
        """A shared, filtered load verified against a shard manifest: the plan reads the
        shards holding the wanted tensor and the header whole; a byte edited in the middle of
        a shard fails every rank."""
        import fastsafetensors_rs as fst

        sig = fst.Signature(self.d / "shards.sig", public_key=self.d / "shards.pub")
        name = (self.d / "edited.txt").read_text()
        ok = fst.load(str(self.d / "signed" / "model.safetensors"), process_group=self.group, tensor_filter=[name],
                      verify=sig)
        try:
            fst.load(str(self.d / "edited" / "model.safetensors"), process_group=self.group, tensor_filter=[name],
                     verify=sig)
            error = None
        except RuntimeError as e:
            error = str(e)
        return {"tensors": ok, "name": name, "error": error}

    def filtered(self) -> dict:
        import fastsafetensors_rs as fst

        out, read = self._measured(lambda: fst.load(self.files, process_group=self.group, reader="direct",
                                                    dtype=torch.float32, tensor_filter=["layers.1.*", "lm_head"]))
        return {"tensors": out, "read": read}

    def streamed(self) -> dict:
        import fastsafetensors_rs as fst

        it = fst.stream(self.files, process_group=self.group, max_memory="1M", dtype="bfloat16")
        names, got = [], {}
        for name, t in it:
            names.append(name)
            got[name] = t.clone()
        with fst.safe_open(self.files[:2], tensor_filter="layers.*") as f:
            handle = dict(f.tensors(process_group=self.group))
        return {"tensors": got, "order": names, "counts": (it.tensor_count, it.byte_count), "safe_open": handle}

    def sharded(self) -> dict:
        """Row blocks of the layers' weights, column blocks of lm_head, the rest whole."""
        import fastsafetensors_rs as fst

        # Measured after an untimed run, as `filtered` is: the first load of this kind in a
        # fresh process may page in code (read_bytes counts it): 1 run in 14 here read 3 MB
        # more than the checkpoint holds, on 1 rank, where the load itself reads with O_DIRECT.
        out, read = self._measured(lambda: fst.load(self.files, process_group=self.group, reader="direct",
                                                    shard={"layers.*.w": 0, "lm_head": 1, "f4": -1}))
        cast = fst.load(self.files, process_group=self.group, dtype=torch.float32, tensor_filter="layers.2.*",
                        shard={"layers.2.w": 1, "*.norm": 0})
        return {"tensors": out, "read": read, "cast": cast}

    def verified_sharded(self) -> dict:
        """`shard=` verified: the blocks, the bytes this rank read (cold) and hashed; then one
        byte flipped in each file in turn (`flipped{i}/`), each load's error."""
        import fastsafetensors_rs as fst

        from fastsafetensors_rs.distributed import verified_bytes

        digests = fst.Digests(self._digests())
        spec = {"layers.*.w": 0, "lm_head": 1, "f4": -1}

        def load(files):
            return fst.load(files, process_group=self.group, reader="direct", shard=spec, verify=digests)

        load(self.files)  # untimed first, as `_measured` does
        self._cold(self.files)
        read, hashed = read_bytes(), verified_bytes()
        out = load(self.files)
        read, hashed = read_bytes() - read, verified_bytes() - hashed
        errors = []
        for i in range(len(FILES)):
            try:
                load([str(self.d / f"flipped{i}" / f) for f in FILES])
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        return {"tensors": out, "read": read, "hashed": hashed, "errors": errors}

    def mismatch(self) -> dict:
        import fastsafetensors_rs as fst

        out = {}
        for key, kwargs in [("tensor_filter", {"tensor_filter": "layers.*" if self.rank else "lm_head"}),
                            ("dtype", {"dtype": torch.float16 if self.rank == self.world - 1 else None}),
                            ("files", {"files": self.files[:1 + (self.rank == 0)]})]:
            args = {"files": self.files, **kwargs}
            try:
                fst.load(args.pop("files"), process_group=self.group, **args)
                out[key] = None
            except ValueError as e:
                out[key] = str(e)
        return out

    def plan_failure(self) -> dict:
        """The last rank's copy of the checkpoint is cut short before the load: its header no
        longer matches its length. Each rank passes the same relative path, in its own directory."""
        import fastsafetensors_rs as fst

        mine = self.d / f"rank{self.rank}"
        victim = mine / "model.safetensors"
        saved = victim.read_bytes()
        if self.rank == self.world - 1:
            victim.write_bytes(saved[:-100])
        cwd = os.getcwd()
        os.chdir(mine)
        try:
            fst.load("model.safetensors", process_group=self.group)
            return {"raised": None}
        except RuntimeError as e:
            return {"raised": str(e)}
        finally:
            os.chdir(cwd)
            victim.write_bytes(saved)

    def rank_stops(self) -> dict:
        """Every rank streams the checkpoint; the last one, after its first tensor, dies
        ($FST_STOP=die: the process exits) or stalls for one and a half group timeouts
        ($FST_STOP=stall), then exits. The others' stream raises: how long it took, and what."""
        import time

        import fastsafetensors_rs as fst

        timeout = float(os.environ["FST_GROUP_TIMEOUT"])
        got, start = [], time.monotonic()
        try:
            for name, _ in fst.stream(self.files, process_group=self.group, reader="direct"):
                got.append(name)
                if self.rank == self.world - 1:
                    torch.save({"rank_stops": {"stopped_after": got}}, self.d / f"rank_stops.w{self.world}.rank{self.rank}.pt")
                    if os.environ["FST_STOP"] == "stall":
                        time.sleep(1.5 * timeout)
                    os._exit(0)
            return {"raised": None, "got": got, "seconds": time.monotonic() - start}
        except Exception as e:
            return {"raised": f"{type(e).__name__}: {e}", "got": got, "seconds": time.monotonic() - start}

    def read_failure(self) -> dict:
        """The last rank's copy is cut short after the load planned its reads: a stream (cut
        between opening it and iterating), and a bulk load (cut as the ranks have agreed on
        the plan, the last step before reading)."""
        import fastsafetensors_rs as fst
        from fastsafetensors_rs import distributed

        mine = self.d / f"rank{self.rank}"
        victim = mine / "model.safetensors"
        saved = victim.read_bytes()

        def cut() -> None:
            if self.rank == self.world - 1:
                with open(victim, "r+b") as f:
                    f.truncate(len(saved) // 2)

        cwd = os.getcwd()
        os.chdir(mine)
        try:
            it = fst.stream("model.safetensors", process_group=self.group, reader="direct")
            cut()
            self.dist.barrier()
            got = []
            try:
                for name, _ in it:
                    got.append(name)
                result = {"raised": None, "got": got}
            except RuntimeError as e:
                result = {"raised": str(e), "got": got}
            victim.write_bytes(saved)

            agree = distributed.SharedLoad._agree

            def agree_then_cut(load, *args):
                agree(load, *args)
                cut()

            distributed.SharedLoad._agree = agree_then_cut
            try:
                result["bulk"] = {"raised": None, "got": sorted(fst.load("model.safetensors", process_group=self.group,
                                                                          reader="direct"))}
            except RuntimeError as e:
                result["bulk"] = {"raised": str(e), "got": []}
            finally:
                distributed.SharedLoad._agree = agree
        finally:
            os.chdir(cwd)
            victim.write_bytes(saved)
        # The group still works: every rank stopped at the same point.
        t = torch.tensor([self.rank])
        self.dist.all_reduce(t)
        result["after"] = int(t)
        return result

    def different_bytes(self) -> dict:
        """Each rank's own `tuned.safetensors`, passed by the same relative path from its own
        directory: one layout, but ranks 1 and 3 hold other values than ranks 0 and 2 (another
        fine-tune). Then the same bytes everywhere, with each rank's copy given its own
        modification time (copies made at different times)."""
        import fastsafetensors_rs as fst

        mine = self.d / f"rank{self.rank}"
        tuned = {n: t + (self.rank % 2) if t.dtype == torch.float32 else t
                 for n, t in checkpoint_tensors()[1].items()}
        U.write_checkpoint(mine / "tuned.safetensors", tuned)
        cwd = os.getcwd()
        os.chdir(mine)
        out: dict = {}
        try:
            self.dist.barrier()
            for key, load in [("bulk", lambda: fst.load("tuned.safetensors", process_group=self.group)),
                              ("stream", lambda: dict(fst.stream("tuned.safetensors", process_group=self.group))),
                              ("sharded", lambda: fst.load("tuned.safetensors", process_group=self.group,
                                                           shard={"layers.*": 0}, tensor_filter="layers.*"))]:
                try:
                    load()
                    out[key] = None
                except RuntimeError as e:
                    out[key] = str(e)
            U.write_checkpoint(mine / "tuned.safetensors", checkpoint_tensors()[1])
            os.utime(mine / "tuned.safetensors", (1_000_000 + self.rank, 1_000_000 + self.rank))
            self.dist.barrier()
            out["same"] = fst.load("tuned.safetensors", process_group=self.group)
        finally:
            os.chdir(cwd)
        return out

    def nodes(self) -> dict:
        """Two simulated nodes of two ranks each (torchrun's GROUP_RANK): with node groups each
        node reads every byte once; with the world group, the job does."""
        import fastsafetensors_rs as fst

        group = fst.node_group()
        members = sorted(self.dist.get_process_group_ranks(group))
        results = {"members": members}
        for name, g in [("node", group), ("world", self.group)]:
            self._cold(self.files)
            before = read_bytes()
            out = fst.load(self.files, process_group=g, reader="direct")
            results[name] = {"read": read_bytes() - before, "tensors": out}
        results["again"] = fst.node_group() is group
        return results


    def remote(self) -> dict:
        """The files from an HTTP server (their URLs in $FST_REMOTE_FILES): the ranks split the
        ranged GETs as they split local reads."""
        import fastsafetensors_rs as fst

        urls = os.environ["FST_REMOTE_FILES"].split(",")
        return {"tensors": fst.load(urls, process_group=self.group)}


def owned(value):
    """`value` with every tensor copied out of the buffer it is a view of (torch.save refuses
    views of one buffer as different types)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: owned(v) for k, v in value.items()}
    return value


SCENARIOS = ["bulk", "verified", "verified_stream", "verified_shards", "filtered", "streamed", "sharded",
             "verified_sharded", "mismatch", "plan_failure", "read_failure", "different_bytes"]


def worker_main(mode: str, d: str, rank: int, world: int, init_file: str) -> int:
    import torch.distributed as dist

    import datetime

    timeout = datetime.timedelta(seconds=float(os.environ.get("FST_GROUP_TIMEOUT", 1800)))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    w = Worker(Path(d), rank, world)
    results: dict = {}
    status = 0
    try:
        for name in SCENARIOS if mode == "all" else [mode]:
            results[name] = owned(getattr(w, name)())
            if name != "rank_stops":  # (a rank is gone: no barrier can complete)
                dist.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
        status = 1
    torch.save(results, Path(d) / f"{mode}.w{world}.rank{rank}.pt")
    if status == 0 and mode != "rank_stops":
        dist.destroy_process_group()
    return status


def run_ranks(d: Path, mode: str, world: int, env_of=lambda rank: {}) -> list[dict]:
    """Runs `mode` on `world` ranks; returns each rank's results."""
    return U.run_rank_workers(__file__, d, mode, world, WORKER_TIMEOUT_S, env_of)


if __name__ == "__main__":
    mode_, d_, rank_, world_, init_ = sys.argv[1:6]
    U.exit_worker(worker_main(mode_, d_, int(rank_), int(world_), init_))


# ================================================================ the tests

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("distributed")
    build(d)
    return d


@pytest.fixture(scope="module")
def ref(ckpt) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in FILES:  # copied out of safetensors' mappings, which would keep the files resident
        out.update({k: v.clone() for k, v in load_file(ckpt / f).items()})
    gc.collect()
    return out


def file_bytes(ckpt, names=FILES) -> int:
    return sum((ckpt / f).stat().st_size for f in names)


def page_bytes(ckpt, names=FILES) -> int:
    """The files' sizes, each rounded up to whole pages: what a group hashes of them."""
    return sum(-(-(ckpt / f).stat().st_size // 4096) * 4096 for f in names)


def fingerprint_bytes(ckpt, names=FILES) -> int:
    """What each rank reads to fingerprint the files before a shared load: a 4 KiB page per
    MiB of each file, 4 to 64 (see docs/distributed.md)."""
    return sum(min(64, max(4, (ckpt / f).stat().st_size >> 20)) * 4096 for f in names)


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"{n}ranks")
def world(request, ckpt):
    """Every scenario on 1, 2, 3 and 4 ranks: (world size, [results of each rank])."""
    return request.param, run_ranks(ckpt, "all", request.param)


def test_every_rank_gets_every_tensor_bit_exact(world, ref):
    n, ranks = world
    for r in ranks:
        U.assert_same_dict(r["bulk"]["tensors"], ref)
        U.assert_same_dict(r["bulk"]["one"], {"lm_head": ref["lm_head"]})


def test_each_byte_is_read_by_one_rank(world, ckpt):
    n, ranks = world
    if not U.supports_o_direct(ckpt):
        pytest.skip(f"{ckpt}: no O_DIRECT, so read_bytes would count readahead")
    total = file_bytes(ckpt)
    read = [r["bulk"]["read"] for r in ranks]
    fingerprints = fingerprint_bytes(ckpt) * n if n > 1 else 0
    assert total * 0.95 <= sum(read) <= total * 1.05 + fingerprints, (read, total)
    # Balanced: every rank reads its share, whatever the files' sizes.
    for b in read:
        assert abs(b - total / n) <= 0.05 * total / n + 64 * 4096, (read, total)


def test_a_verified_load_checks_each_file_once_and_fails_every_rank_alike(world, ref, ckpt):
    n, results = world
    errors = {r["verified"]["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and f"{FILES[-1]}: digest mismatch" in error, error
    if n > 1:
        assert "checked by rank" in error, error
    for r in results:
        U.assert_same_dict(r["verified"]["tensors"], ref)
    if n == 1:
        return  # a group of one loads as a process alone does
    # Each file hashed once in the group, by one rank: the ranks' bytes add up to the files'
    # (each rounded up to whole pages), and no rank hashes more than its share or one file.
    hashed = [r["verified"]["hashed"] for r in results]
    pages = page_bytes(ckpt)
    assert sum(hashed) == pages, (hashed, pages)
    biggest = max((ckpt / f).stat().st_size for f in FILES)
    assert max(hashed) <= max(pages / n, biggest) + 4096, hashed


def test_a_verified_stream_hashes_each_file_once_and_stops_every_rank_before_the_next_file(world, ref):
    n, results = world
    names_of_first = set(checkpoint_tensors()[0])
    for r in results:
        got = r["verified_stream"]
        U.assert_same_dict(got["tensors"], ref)
        U.assert_same_dict(got["safe_open"], {k: v for k, v in ref.items() if k not in names_of_first})
        assert got["error"] is not None and f"{FILES[0]}: digest mismatch" in got["error"], got["error"]
        if n > 1:
            assert "no tensor of a later file was handed out" in got["error"], got["error"]
        assert set(got["seen"]) <= names_of_first, "a tensor of a later file was handed out"


def test_a_verified_filtered_load_of_a_shard_manifest_fails_every_rank_on_an_edited_shard(world, ckpt):
    from safetensors.torch import load_file

    n, results = world
    name = results[0]["verified_shards"]["name"]
    errors = {r["verified_shards"]["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and "edited/model.safetensors: digest mismatch" in error, error
    expected = {name: load_file(ckpt / "signed" / "model.safetensors")[name]}
    for r in results:
        U.assert_same_dict(r["verified_shards"]["tensors"], expected)


def test_a_filter_reads_only_the_selected_tensors_once(world, ckpt, ref):
    n, ranks = world
    names = ["layers.1.w", "layers.1.norm", "lm_head"]
    for r in ranks:
        assert sorted(r["filtered"]["tensors"]) == sorted(names)
        for name in names:
            t = r["filtered"]["tensors"][name]
            assert t.dtype == torch.float32 and torch.equal(t, ref[name].float()), name
    if U.supports_o_direct(ckpt):
        selected = sum(ref[k].numel() * ref[k].element_size() for k in names)
        fingerprints = fingerprint_bytes(ckpt) if n > 1 else 0
        assert sum(r["filtered"]["read"] for r in ranks) <= selected * 1.05 + (4 * 4096 + fingerprints) * n


def test_streams_hand_out_every_tensor_in_read_order(world, ref, ckpt):
    n, ranks = world
    first = ranks[0]["streamed"]
    assert first["counts"][0] == len(ref)
    for r in ranks:
        s = r["streamed"]
        assert s["order"] == first["order"] and sorted(s["order"]) == sorted(ref)
        for name, t in s["tensors"].items():
            want = ref[name].to(torch.bfloat16) if ref[name].dtype in (torch.float16, torch.float32, torch.float64) \
                else ref[name]
            U.assert_same_tensor(t, want, name)
        layers = {k: v for k, v in ref.items() if k.startswith("layers.")}
        U.assert_same_dict(s["safe_open"], layers)


# The blocks the `sharded` scenarios ask for (`"f4": -1` is its last dimension, 1).
SHARD_DIMS = {f"layers.{i}.w": 0 for i in range(4)} | {"lm_head": 1, "f4": 1}


def assert_blocks(got: dict, ref: dict, world: int, rank: int) -> None:
    """`got` is rank `rank`'s load of `ref` with the shards of SHARD_DIMS: its block of each
    of those tensors, every other tensor whole, bit for bit."""
    from fastsafetensors_rs.distributed import block

    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        if name in SHARD_DIMS:
            start, stop = block(t.shape[SHARD_DIMS[name]], world, rank)
            t = t.narrow(SHARD_DIMS[name], start, stop - start)
        U.assert_same_tensor(got[name], t, name)


def test_shards_are_each_ranks_block_read_once_between_the_ranks(world, ref, ckpt):
    from fastsafetensors_rs.distributed import block

    n, ranks = world
    for rank, r in enumerate(ranks):
        assert_blocks(r["sharded"]["tensors"], ref, n, rank)
        cast = r["sharded"]["cast"]
        start, stop = block(ref["layers.2.w"].shape[1], n, rank)
        assert torch.equal(cast["layers.2.w"], ref["layers.2.w"].float().narrow(1, start, stop - start))
        start, stop = block(ref["layers.2.norm"].shape[0], n, rank)
        assert torch.equal(cast["layers.2.norm"], ref["layers.2.norm"][start:stop])
    if U.supports_o_direct(ckpt):
        total = file_bytes(ckpt)
        # Row blocks are read in whole pages: a few pages more per block at most.
        fingerprints = fingerprint_bytes(ckpt) * n if n > 1 else 0
        most = total * 1.05 + 16 * 4096 * n + fingerprints
        assert total * 0.95 <= sum(r["sharded"]["read"] for r in ranks) <= most


def test_verified_shards_are_each_ranks_blocks_of_files_read_and_hashed_once_in_the_group(world, ref, ckpt):
    """`shard=` with `verify=`: each rank's blocks as unverified, every file read once from
    storage and hashed once in the group; a byte flipped in any one file fails every rank
    alike, naming that file."""
    n, ranks = world
    for rank, r in enumerate(ranks):
        assert_blocks(r["verified_sharded"]["tensors"], ref, n, rank)
    errors = {tuple(r["verified_sharded"]["errors"]) for r in ranks}
    assert len(errors) == 1, errors
    for i, (name, error) in enumerate(zip(FILES, errors.pop())):
        assert error is not None and f"flipped{i}/{name}: digest mismatch" in error, error
    hashed = [r["verified_sharded"]["hashed"] for r in ranks]
    if n > 1:
        pages = page_bytes(ckpt)
        assert sum(hashed) == pages, (hashed, pages)
    if U.supports_o_direct(ckpt):
        total = file_bytes(ckpt)
        fingerprints = fingerprint_bytes(ckpt) * n if n > 1 else 0
        read = sum(r["verified_sharded"]["read"] for r in ranks)
        assert total * 0.95 <= read <= total * 1.05 + fingerprints, (read, total)


def test_ranks_asking_for_different_loads_are_refused_naming_the_difference(world):
    n, ranks = world
    for key in ["tensor_filter", "dtype", "files"]:
        messages = [r["mismatch"][key] for r in ranks]
        if n == 1:
            assert messages == [None]
            continue
        for m in messages:
            assert m is not None and f"the ranks asked for different loads: {key} is" in m, messages


def test_a_rank_that_cannot_plan_makes_every_rank_raise_naming_it(world):
    n, ranks = world
    for r in ranks:
        message = r["plan_failure"]["raised"]
        assert message is not None and "model.safetensors" in message
        if n > 1:
            assert f"on rank {n - 1} of the {n} ranks" in message, message


@pytest.mark.parametrize("how", ["die", "stall"])
def test_a_rank_that_dies_or_stalls_mid_stream_fails_the_others_within_the_group_timeout(ckpt, how):
    """3 ranks stream the checkpoint with a 10 s group timeout; after its first tensor the last
    rank exits, or stops iterating for 15 s. The other two raise, not hang: at once where the
    rank died (its connections close), within the timeout where it stalls; in one line naming
    the file whose exchange failed and why, with the process group's own error."""
    timeout = 10
    ranks = run_ranks(ckpt, "rank_stops", 3, lambda r: {"FST_GROUP_TIMEOUT": str(timeout), "FST_STOP": how})
    assert len(ranks[2]["rank_stops"]["stopped_after"]) == 1
    for r in ranks[:2]:
        result = r["rank_stops"]
        raised = result["raised"]
        assert raised is not None and raised.startswith("RuntimeError: ") and "\n" not in raised, result
        assert any(f"{f}: the exchange with the other ranks of the process group failed" in raised
                   for f in FILES), raised
        limit = timeout + 15
        assert result["seconds"] < limit, f"rank waited {result['seconds']:.1f} s: {result['raised']}"
        if how == "stall":
            assert result["seconds"] > timeout * 0.8, result
        print(f"{how}: raised after {result['seconds']:.1f} s: {result['raised'][:300]}")


def test_a_rank_whose_read_fails_makes_every_rank_raise_with_nothing_handed_out(world):
    n, ranks = world
    if n == 1:
        pytest.skip("a group of one is an ordinary stream, which reads ahead as soon as it is opened")
    for r in ranks:
        result = r["read_failure"]
        for outcome in (result, result["bulk"]):
            assert outcome["raised"] is not None and "model.safetensors" in outcome["raised"], outcome
            assert f"read by rank {n - 1} of the {n} ranks" in outcome["raised"], outcome
            assert "nothing was loaded" in outcome["raised"], outcome
            assert outcome["got"] == [], "no tensor of an unfilled buffer"
        assert result["after"] == sum(range(n))


def test_ranks_holding_other_bytes_under_the_same_path_are_refused_naming_file_and_ranks(world):
    n, ranks = world
    same = checkpoint_tensors()[1]
    for r in ranks:
        result = r["different_bytes"]
        U.assert_same_dict(result["same"], same)  # the same bytes load, whatever their mtimes
        for key in ["bulk", "stream", "sharded"]:
            message = result[key]
            if n == 1:
                assert message is None, message
                continue
            assert message is not None, f"{key}: rank loaded a mix of the ranks' files without an error"
            odd = ", ".join(str(k) for k in range(1, n, 2))
            even = ", ".join(str(k) for k in range(0, n, 2))
            assert message.startswith("process_group: tuned.safetensors holds different bytes on different ranks"), message
            assert f"{even}: version 1" in message and f"{odd}: version 2" in message, message


def test_node_groups_read_once_per_node_and_the_world_once_per_job(ckpt, ref):
    if not U.supports_o_direct(ckpt):
        pytest.skip(f"{ckpt}: no O_DIRECT, so read_bytes would count readahead")
    # Two nodes of two ranks, as torchrun numbers them: GROUP_RANK is the node's rank.
    ranks = run_ranks(ckpt, "nodes", 4, env_of=lambda r: {"GROUP_RANK": str(r // 2), "LOCAL_WORLD_SIZE": "2"})
    total = file_bytes(ckpt)
    assert [r["nodes"]["members"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # Each rank of a shared load also reads the pages it fingerprints (fingerprint_bytes).
    for node in (ranks[:2], ranks[2:]):
        assert total * 0.95 <= sum(r["nodes"]["node"]["read"] for r in node) <= total * 1.05 + fingerprint_bytes(ckpt) * 2
    assert total * 0.95 <= sum(r["nodes"]["world"]["read"] for r in ranks) <= total * 1.05 + fingerprint_bytes(ckpt) * 4
    for r in ranks:
        assert r["nodes"]["again"]
        U.assert_same_dict(r["nodes"]["node"]["tensors"], ref)
        U.assert_same_dict(r["nodes"]["world"]["tensors"], ref)


def _data_bytes_fetched(server, sizes: dict) -> int:
    """Bytes of the ranged GETs `server` answered, but for the first GET of each open (the
    first MiB, header included, which every rank fetches to plan)."""
    total = 0
    for method, path, byte_range in server.requests:
        if method != "GET" or byte_range == "bytes=0-1048575":
            continue
        first, last = map(int, byte_range.removeprefix("bytes=").split("-"))
        total += min(last + 1, sizes[path.rsplit("/", 1)[-1]]) - first
    return total


def test_ranks_split_the_ranged_gets_of_remote_files(ckpt, ref, monkeypatch):
    """URLs with `process_group=`: the data GETs of 2 ranks together fetch what one process
    alone does (parts of 512 KiB, so that no data GET looks like a header's)."""
    from remote_servers import FileServer

    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "512K")
    sizes = {f: (ckpt / f).stat().st_size for f in FILES}
    fetched = {}
    with FileServer(ckpt) as server:
        urls = ",".join(f"{server.url}/{f}" for f in FILES)
        for n in (1, 2):
            server.reset()
            ranks = run_ranks(ckpt, "remote", n, env_of=lambda r: {"FST_REMOTE_FILES": urls})
            for r in ranks:
                U.assert_same_dict(r["remote"]["tensors"], ref)
            fetched[n] = _data_bytes_fetched(server, sizes)
    # One process fetches the big file past its first MiB in data GETs at least.
    assert fetched[1] >= sizes[FILES[0]] - (1 << 20), fetched
    assert fetched[2] <= fetched[1] * 1.1, fetched
