#!/usr/bin/env python3
"""Remote-source benchmark: a checkpoint in a local S3 server (Garage on 127.0.0.1, the one
the tests use), read into CPU tensors by fastsafetensors_rs, beside the reference clients
reading the same objects from the same server in the same run: parallel ranged GETs with
curl (--aws-sigv4), the bytes sent to /dev/null (`curl`: the network alone) or written to
files in /dev/shm (`curl-shm`: into memory, as a loader must, paying for the pages), and,
when it is installed, boto3 with a thread pool (bytes read into Python objects). The loaders take turns in a rotated order each round, each run in a fresh
process; the median of the runs is reported in GB/s (1e9 bytes of the files per second).

    make bench-remote                                   # 2 GB in 4 files, 5 runs
    .venv/bin/python bench/remote.py --size-gb 0.5 --runs 3
"""
from __future__ import annotations

import argparse
import json
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
start = time.perf_counter()
tensors = fst.load(sys.argv[1])  # every byte is in memory when it returns (nothing is mapped)
print(time.perf_counter() - start)
"""

BOTO3 = """
import sys, time, boto3, concurrent.futures as cf
from botocore.config import Config
bucket, keys, streams, part = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
s3 = boto3.client("s3", config=Config(max_pool_connections=streams, s3={"addressing_style": "path"}))
start = time.perf_counter()
sizes = {k: s3.head_object(Bucket=bucket, Key=k)["ContentLength"] for k in keys}
def get(job):
    k, a, b = job
    return len(s3.get_object(Bucket=bucket, Key=k, Range=f"bytes={a}-{b}")["Body"].read())
jobs = [(k, a, min(a + part, n) - 1) for k, n in sizes.items() for a in range(0, n, part)]
with cf.ThreadPoolExecutor(streams) as pool:
    got = sum(pool.map(get, jobs))
assert got == sum(sizes.values())
print(time.perf_counter() - start)
"""


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


def run(cmd: list[str], env: dict) -> float:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (GB, 1e9 bytes)")
    ap.add_argument("--files", type=int, default=4, help="number of shards")
    ap.add_argument("--runs", type=int, default=5, help="runs per loader (median)")
    ap.add_argument("--streams", type=int, default=16, help="parallel GETs of the reference clients")
    ap.add_argument("--part-mb", type=int, default=8, help="MiB per ranged GET of the reference clients")
    ap.add_argument("--dir", type=Path, default=REPO / "bench-data", help="checkpoint cache")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = ap.parse_args()

    binary = garage_binary()
    if binary is None:
        sys.exit("Garage is not built: run `make garage` (or `make bench-remote`)")
    files, _ = ensure_checkpoint(args.dir, args.size_gb, args.files)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    keys = [f"ckpt/{f.name}" for f in files]
    part = args.part_mb << 20
    loaders = ["fastsafetensors_rs", "curl", "curl-shm"]
    try:
        import boto3  # noqa: F401
        loaders.append("boto3")
    except ImportError:
        print("boto3 is not installed: no boto3 row", file=sys.stderr)

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

            def curl_shm() -> float:
                try:
                    return timed(["curl", "--parallel", "--parallel-max", str(args.streams), "-K", str(cfg_shm)], env)
                finally:
                    for f in shm.iterdir():
                        f.unlink()
            commands = {
                "fastsafetensors_rs": lambda: run([sys.executable, "-c", OURS, f"s3://{BUCKET}/ckpt/"], env),
                "curl": lambda: timed(["curl", "--parallel", "--parallel-max", str(args.streams), "-K", str(cfg)], env),
                "curl-shm": curl_shm,
                "boto3": lambda: run([sys.executable, "-c", BOTO3, BUCKET, ",".join(keys), str(args.streams),
                                      str(part)], env),
            }
            seconds: dict[str, list[float]] = {name: [] for name in loaders}
            for r in range(args.runs):
                order = loaders[r % len(loaders):] + loaders[:r % len(loaders)]
                for name in order:
                    seconds[name].append(commands[name]())
        finally:
            garage.stop()
            if "shm" in locals():
                shutil.rmtree(shm, ignore_errors=True)

    rate = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    print(f"{len(files)} file(s), {total / 1e9:.2f} GB in Garage on 127.0.0.1, median of {args.runs}; "
          f"references: {args.streams} parallel ranged GETs of {args.part_mb} MiB")
    for name in loaders:
        print(f"  {name:<20} {statistics.median(seconds[name]) * 1e3:9.1f} ms {rate[name]:7.2f} GB/s"
              + ("" if name == "fastsafetensors_rs" else
                 f"   (ours {rate['fastsafetensors_rs'] / rate[name]:.2f}x)"))
    if args.json:
        args.json.write_text(json.dumps({"bytes": total, "seconds": seconds, "gb_per_s": rate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
