#!/usr/bin/env python3
"""The `fanout` scenario of `make bench`: loads shared by the ranks of a gloo group on CPU.

Each round, in a rotated order and with the files evicted before each run: one process
loading the checkpoint alone; 2 and 4 ranks loading it with `process_group=` the world
group; and two simulated nodes of 2 ranks each (two `torchrun --nnodes 2` launches on
127.0.0.1), once with `node_group()` and once with the world group. Every rank reports the
seconds of its `load` call (process start, imports and the group's set-up are outside) and
the bytes it read from storage (`read_bytes` of /proc/self/io). Reported: the slowest rank's
time against the single process, and the bytes read per node and in all against the
checkpoint's size. The "exchange only" rows time the all-gathers of the same bytes with no
reads: the floor gloo over loopback puts under a shared load on this machine. The "verified"
rows load with `verify=Digests(...)` (each file hashed once in the group): beside the bytes
each rank read, the bytes it hashed (`distributed.verified_bytes()`), and the time against
the unverified load of as many ranks.

Run alone: `python bench/fanout.py FILE... [--runs N]`.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import shutil
import subprocess
import tempfile
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SETTLE_SECONDS = 2.0
TIMEOUT_S = 600
VARIANTS = ("single", "2 ranks", "4 ranks", "2 ranks verified", "4 ranks verified", "2x2 node groups",
            "2x2 world group", "2 ranks exchange only", "4 ranks exchange only")
CHUNK = 64 << 20  # what the loader exchanges per all-gather


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def evict(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rank_main(files: list[str], group: str, out_dir: str, digests: str | None = None) -> None:
    """One rank (or the single process): loads the files (verified against the JSON file of
    digests `digests`, if given) and writes its result to `out_dir`."""
    import torch.distributed as dist

    import fastsafetensors_rs as fst
    from fastsafetensors_rs.distributed import verified_bytes

    verify = fst.Digests(json.loads(Path(digests).read_text())) if digests else None

    pg = None
    if group != "none":
        dist.init_process_group("gloo")
        pg = fst.node_group() if group == "node" else dist.group.WORLD  # "exchange": no load
        dist.barrier()
    before, hashed, start = read_bytes(), verified_bytes(), time.perf_counter()
    if group == "exchange":
        exchange(sum(os.path.getsize(f) for f in files))
        count = 0
    else:
        count = len(fst.load(files, process_group=pg, verify=verify))
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "read": read_bytes() - before, "tensors": count,
              "hashed": verified_bytes() - hashed, "node": os.environ.get("GROUP_RANK", "0")}
    if pg is not None:
        dist.barrier()
        dist.destroy_process_group()
    name = f"{result['node']}-{os.environ.get('LOCAL_RANK', '0')}.json"
    Path(out_dir, name).write_text(json.dumps(result))


def exchange(total: int) -> None:
    """The exchange alone, as a shared load makes it (all-gathers of 64 MiB chunks into fresh
    memory), without reading anything: the floor the group's transport puts under the load."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    buf = torch.empty(total + CHUNK, dtype=torch.uint8)
    piece = CHUNK // world
    for offset in range(0, total, CHUNK):
        dist.all_gather_into_tensor(buf[offset:offset + CHUNK], buf[offset + rank * piece:offset + (rank + 1) * piece])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(variant: str, files: list[str], digests: str) -> list[dict[str, Any]]:
    """Runs one variant once; returns every rank's result."""
    out_dir = tempfile.mkdtemp(prefix="fanout-")
    me = [str(HERE), "--rank-worker", "--out", out_dir, *files]
    if "verified" in variant:
        me += ["--digests", digests]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1"]
    if variant == "single":
        commands = [[sys.executable, *me, "--group", "none"]]
    elif "ranks" in variant:
        n, group = variant.split()[0], "exchange" if "exchange" in variant else "world"
        commands = [torchrun + ["--nproc-per-node", n, "--master-port", str(free_port()), *me, "--group", group]]
    else:
        group = "node" if "node" in variant else "world"
        port = str(free_port())
        commands = [torchrun + ["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2", "--master-port",
                                port, *me, "--group", group] for k in range(2)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise RuntimeError(f"{variant}: exit {p.returncode}\n{out[-2000:]}\n{err[-4000:]}")
    results = [json.loads(f.read_text()) for f in sorted(Path(out_dir).glob("*.json"))]
    shutil.rmtree(out_dir)
    return results


def measure(files: list[str], runs: int) -> dict[str, list[list[dict[str, Any]]]]:
    import hashlib

    samples: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    digests = Path(tempfile.mkdtemp(prefix="fanout-digests-")) / "digests.json"
    hashes = {}
    for f in files:
        with open(f, "rb") as fh:
            hashes[os.path.basename(f)] = "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
    digests.write_text(json.dumps(hashes))
    for r in range(runs):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            evict(files)
            time.sleep(SETTLE_SECONDS)
            samples[variant].append(launch(variant, files, str(digests)))
    return samples


def report(samples: dict[str, list[list[dict[str, Any]]]], total: int) -> tuple[list[str], list[str], dict]:
    """The table, the verdicts against the issue's targets, and the numbers."""
    single = statistics.median(max(r["seconds"] for r in run) for run in samples["single"])
    lines = [f"{'fan-out (gloo, cold)':<22} {'slowest s':>9} {'GB/s':>6} {'x single':>8} {'read/ckpt':>9} "
             f"{'per node':>9}"]
    verdicts, numbers = [], {}
    for variant, runs in samples.items():
        slowest = statistics.median(max(r["seconds"] for r in run) for run in runs)
        read = statistics.median(sum(r["read"] for r in run) for run in runs) / total
        per_node = statistics.median(max(sum(r["read"] for r in run if r["node"] == n)
                                         for n in {r["node"] for r in run}) for run in runs) / total
        numbers[variant] = {"seconds": slowest, "read_ratio": read, "per_node_ratio": per_node}
        lines.append(f"{variant:<22} {slowest:>9.2f} {total / slowest / 1e9:>6.2f} {slowest / single:>8.2f} "
                     f"{read:>9.2f} {per_node:>9.2f}")
        if "exchange" in variant:
            lines[-1] += "   (no reads: gloo's all-gathers alone)"
        elif variant.endswith("verified"):
            world = int(variant.split()[0])
            share = total / world
            read_rank = statistics.median(max(r["read"] for r in run) for run in runs) / share
            hashed = statistics.median(max(r["hashed"] for r in run) for run in runs) / share
            hashed_all = statistics.median(sum(r["hashed"] for r in run) for run in runs) / total
            plain = statistics.median(max(r["seconds"] for r in run) for run in samples[f"{world} ranks"])
            numbers[variant].update(read_per_rank=read_rank, hashed_per_rank=hashed, hashed_ratio=hashed_all,
                                    vs_unverified=plain / slowest)
            lines[-1] += (f"   (per rank: read {read_rank:.2f}x, hashed {hashed:.2f}x its 1/{world}; "
                          f"hashed in all {hashed_all:.2f}x)")
            verdicts.append(f"fan-out {variant}: {plain / slowest:.2f}x the unverified load's rate (target >= 0.9): "
                            f"{'MET' if plain / slowest >= 0.9 else 'MISS'}; the most any rank hashed "
                            f"{hashed:.2f}x its 1/{world} share, in all {hashed_all:.2f}x the checkpoint")
        elif variant.endswith("ranks"):
            verdicts.append(f"fan-out {variant}: read {read:.2f}x the checkpoint (target <= 1.05): "
                            f"{'MET' if read <= 1.05 else 'MISS'}; slowest rank {slowest / single:.2f}x a "
                            f"single process (target <= 1.5): {'MET' if slowest <= 1.5 * single else 'MISS'}")
        elif variant.startswith("2x2"):
            want, got = (per_node, "per node") if "node" in variant else (read, "in all")
            verdicts.append(f"fan-out {variant}: read {want:.2f}x the checkpoint {got} (target 1.0, <= 1.05): "
                            f"{'MET' if want <= 1.05 else 'MISS'}")
    return lines, verdicts, numbers


def run(files: list[Path], runs: int) -> tuple[list[str], dict]:
    """Measures and prints the scenario; returns (verdict lines, numbers)."""
    names = [str(f) for f in files]
    total = sum(f.stat().st_size for f in files)
    print(f"\nfan-out: {len(VARIANTS)} variants x {runs} runs, {total / 1e9:.2f} GB in {len(files)} files")
    lines, verdicts, numbers = report(measure(names, runs), total)
    print("\n".join(lines))
    return verdicts, numbers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--group", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--digests", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        rank_main(args.files, args.group, args.out, args.digests)
        return 0
    verdicts, _ = run([Path(f) for f in args.files], args.runs)
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
