#!/usr/bin/env python3
"""Remote-source benchmark: a checkpoint in a local S3 server (Garage on 127.0.0.1, the one
the tests use), read into CPU tensors by fastsafetensors_rs, beside the reference clients
reading the same objects from the same server in the same run: parallel ranged GETs with
curl (--aws-sigv4), the bytes sent to /dev/null (`curl`: the network alone) or written to
files in /dev/shm (`curl-shm`: into memory, as a loader must, paying for the pages), boto3
with a thread pool (bytes read into Python objects), and Run:ai's model streamer (its S3
backend, as vLLM's `runai_streamer` format uses it). The loaders take turns in a rotated
order each round, each run in a fresh process; the median of the runs is reported in GB/s
(1e9 bytes of the files per second).

    make bench-remote                                   # 2 GB in 4 files, 5 runs; then with 20 ms RTT
    .venv/bin/python bench/remote.py --size-gb 0.5 --runs 3
    .venv/bin/python bench/remote.py --rtt-ms 20         # the same behind 20 ms of round-trip time

With `--rtt-ms`, the whole run moves into a network namespace of its own (`ip netns`, root
only) whose loopback delays every packet by half the round-trip time (`tc netem`), once the
objects are uploaded: server and clients as far apart as two hosts in one region. There, a
client that waits for one response before the next request (`curl-1stream`) pays the round
trip on every part, and each TCP stream's window bounds its rate.
"""
from __future__ import annotations

import argparse
import json
import resource
import secrets
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "python"))

from bench import ensure_checkpoint  # noqa: E402
from remote_servers import REGION, Garage, garage_binary  # noqa: E402

BUCKET = "bench"

OURS = """
import sys, time, fastsafetensors_rs as fst
start, cpu = time.perf_counter(), time.process_time()
tensors = fst.load(sys.argv[1])  # every byte is in memory when it returns (nothing is mapped)
print(time.perf_counter() - start, time.process_time() - cpu)
"""

BOTO3 = """
import sys, time, boto3, concurrent.futures as cf
from botocore.config import Config
bucket, keys, streams, part = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
s3 = boto3.client("s3", config=Config(max_pool_connections=streams, s3={"addressing_style": "path"}))
start, cpu = time.perf_counter(), time.process_time()
sizes = {k: s3.head_object(Bucket=bucket, Key=k)["ContentLength"] for k in keys}
def get(job):
    k, a, b = job
    return len(s3.get_object(Bucket=bucket, Key=k, Range=f"bytes={a}-{b}")["Body"].read())
jobs = [(k, a, min(a + part, n) - 1) for k, n in sizes.items() for a in range(0, n, part)]
with cf.ThreadPoolExecutor(streams) as pool:
    got = sum(pool.map(get, jobs))
assert got == sum(sizes.values())
print(time.perf_counter() - start, time.process_time() - cpu)
"""


# Run:ai's streamer, the peer that reads object stores (its S3 backend, runai-model-streamer-s3),
# as vLLM's runai_streamer load format drives it. Its tensors are views of the buffer it read
# into, every byte in memory when the loop ends; they are kept, not copied.
RUNAI = """
import os, sys, time
from runai_model_streamer import SafetensorsStreamer
files = sys.argv[1].split(",")
start, cpu = time.perf_counter(), time.process_time()
kept = []
with SafetensorsStreamer() as streamer:
    streamer.stream_files(files)
    for name, tensor in streamer.get_tensors():
        kept.append(tensor)
print(time.perf_counter() - start, time.process_time() - cpu)
"""
# What Run:ai's S3 client is told: path-style requests to the local endpoint.
RUNAI_ENV = {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}


def curl_config(garage: Garage, keys: list[str], sizes: list[int], part: int, out: Path | None) -> str:
    """Ranged GETs of every part of every object; the bytes go to /dev/null, or with `out` to
    one file per part there (a tmpfs: memory, as a loader's are)."""
    lines = []
    for key, size in zip(keys, sizes):
        for a in range(0, size, part):
            b = min(a + part, size) - 1
            dest = "/dev/null" if out is None else str(out / f"{key.replace('/', '_')}.{a}")
            lines += [f'url = "{garage.endpoint}/{BUCKET}/{key}"', f'range = "{a}-{b}"', f'output = "{dest}"',
                      f'aws-sigv4 = "aws:amz:{REGION}:s3"', f'user = "{garage.key_id}:{garage.secret}"',
                      'header = "x-amz-content-sha256: UNSIGNED-PAYLOAD"', "fail", "silent", "next"]
    return "\n".join(lines[:-1]) + "\n"


def children_cpu() -> float:
    """CPU seconds (user + system) of the processes this one has run and waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], env: dict) -> tuple[float, float]:
    """A Python client, which times itself after its imports: (wall, CPU) seconds it prints."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    wall, used = proc.stdout.strip().splitlines()[-1].split()
    return float(wall), float(used)


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """A command timed whole: (wall, CPU) seconds."""
    cpu, start = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    return time.perf_counter() - start, children_cpu() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (GB, 1e9 bytes)")
    ap.add_argument("--files", type=int, default=4, help="number of shards")
    ap.add_argument("--runs", type=int, default=5, help="runs per loader (median)")
    ap.add_argument("--streams", type=int, default=16, help="parallel GETs of the reference clients")
    ap.add_argument("--part-mb", type=int, default=8, help="MiB per ranged GET of the reference clients")
    ap.add_argument("--dir", type=Path, default=REPO / "bench-data", help="checkpoint cache")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="added round-trip time (tc netem in a network namespace; root only)")
    ap.add_argument("--netns", help=argparse.SUPPRESS)  # the namespace this run was moved into
    args = ap.parse_args()
    if args.rtt_ms and not args.netns:
        return run_in_netns(args)

    binary = garage_binary()
    if binary is None:
        sys.exit("Garage is not built: run `make garage` (or `make bench-remote`)")
    files, _ = ensure_checkpoint(args.dir, args.size_gb, args.files)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    keys = [f"ckpt/{f.name}" for f in files]
    part = args.part_mb << 20
    loaders = ["fastsafetensors_rs", "curl", "curl-shm", "curl-1stream"]
    for module, row in (("boto3", "boto3"), ("runai_model_streamer", "runai")):
        try:
            __import__(module)
            loaders.append(row)
        except ImportError:
            print(f"{module} is not installed: no {row} row", file=sys.stderr)

    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        garage = Garage(binary, Path(scratch))
        try:
            garage.bucket(BUCKET)
            for f, key in zip(files, keys):
                garage.put(BUCKET, key, f.read_bytes())
            env = {**os.environ, **garage.env(), "AWS_DEFAULT_REGION": REGION}
            cfg = Path(scratch) / "curl.cfg"
            cfg.write_text(curl_config(garage, keys, sizes, part, None))
            shm = Path(tempfile.mkdtemp(prefix="fst-bench-", dir="/dev/shm"))
            cfg_shm = Path(scratch) / "curl-shm.cfg"
            cfg_shm.write_text(curl_config(garage, keys, sizes, part, shm))
            if args.netns and not add_delay(args.rtt_ms):
                return 0

            def curl_shm() -> tuple[float, float]:
                try:
                    return timed(["curl", "--parallel", "--parallel-max", str(args.streams), "-K", str(cfg_shm)], env)
                finally:
                    for f in shm.iterdir():
                        f.unlink()
            commands = {
                "fastsafetensors_rs": lambda: run([sys.executable, "-c", OURS, f"s3://{BUCKET}/ckpt/"], env),
                "curl": lambda: timed(["curl", "--parallel", "--parallel-max", str(args.streams), "-K", str(cfg)], env),
                "curl-1stream": lambda: timed(["curl", "-K", str(cfg)], env),
                "curl-shm": curl_shm,
                "boto3": lambda: run([sys.executable, "-c", BOTO3, BUCKET, ",".join(keys), str(args.streams),
                                      str(part)], env),
                "runai": lambda: run([sys.executable, "-c", RUNAI, ",".join(f"s3://{BUCKET}/{k}" for k in keys)],
                                     {**env, **RUNAI_ENV}),
            }
            seconds: dict[str, list[float]] = {name: [] for name in loaders}
            cpu: dict[str, list[float]] = {name: [] for name in loaders}
            for r in range(args.runs):
                order = loaders[r % len(loaders):] + loaders[:r % len(loaders)]
                for name in order:
                    wall, used = commands[name]()
                    seconds[name].append(wall)
                    cpu[name].append(used)
        finally:
            garage.stop()
            if "shm" in locals():
                shutil.rmtree(shm, ignore_errors=True)

    rate = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    rtt = f", {args.rtt_ms:g} ms added round-trip time (netem)" if args.rtt_ms else ""
    print(f"{len(files)} file(s), {total / 1e9:.2f} GB in Garage on 127.0.0.1{rtt}, median of {args.runs}; "
          f"references: {args.streams} parallel ranged GETs of {args.part_mb} MiB (curl-1stream: one at a time)")
    cpu_per_gb = {name: statistics.median(c) / (total / 1e9) for name, c in cpu.items()}
    print("  (client CPU: user + system seconds per GB of the client process, after its imports; "
          "the server's own is not counted)")
    for name in loaders:
        print(f"  {name:<20} {statistics.median(seconds[name]) * 1e3:9.1f} ms {rate[name]:7.2f} GB/s"
              f"  client CPU {cpu_per_gb[name]:5.2f} s/GB"
              + ("" if name == "fastsafetensors_rs" else
                 f"   (ours {rate['fastsafetensors_rs'] / rate[name]:.2f}x)"))
    if args.json:
        args.json.write_text(json.dumps({"bytes": total, "seconds": seconds, "cpu_seconds": cpu, "gb_per_s": rate,
                                         "client_cpu_s_per_gb": cpu_per_gb}, indent=1))
    return 0


def run_in_netns(args: argparse.Namespace) -> int:
    """This run again, inside a network namespace made for it (deleted after): `--rtt-ms`
    delays that namespace's loopback, never the machine's. Where namespaces cannot be made,
    says why and measures nothing."""
    name = f"fst-bench-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        print(f"{args.rtt_ms:g} ms RTT: not run: cannot make a network namespace "
              f"(`ip netns add`, root only): {made.stderr.strip() or made.returncode}")
        return 0
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        return subprocess.run(["ip", "netns", "exec", name, sys.executable, *sys.argv, "--netns", name]).returncode
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def add_delay(rtt_ms: float) -> bool:
    """Delays every packet on this namespace's loopback by half of `rtt_ms` (each request and
    its answer cross it once each way); False, saying why, where netem is missing."""
    delay = f"{rtt_ms / 2:g}ms"
    proc = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", delay],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{rtt_ms:g} ms RTT: not run: tc netem is not available here "
              f"(`tc qdisc add dev lo root netem delay {delay}`: {proc.stderr.strip()}); "
              "the kernel needs sch_netem")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
