#!/usr/bin/env python3
"""Remote-source benchmark: a checkpoint in a local S3 server (Garage on 127.0.0.1, the one
the tests use), read into CPU tensors by fastsafetensors_rs, beside the reference clients
reading the same objects from the same server in the same run: parallel ranged GETs with
curl (--aws-sigv4), the bytes sent to /dev/null (`curl`: the network alone) or written to
files in /dev/shm (`curl-shm`: into memory, as a loader must, paying for the pages), boto3
with a thread pool (bytes read into Python objects), and Run:ai's model streamer (its S3
backend, as vLLM's `runai_streamer` format uses it). `fastsafetensors_rs-stream` is the same
load streamed (`stream(url, max_memory="256M")`, each tensor dropped once seen), with its
peak memory. The loaders take turns in a rotated order each round, each run in a fresh
process; the median of the runs is reported in GB/s (1e9 bytes of the files per second),
with the client's CPU seconds per GB beside.

    make bench-remote                                   # 2 GB in 4 files, 5 runs, at 0, 20 and 80 ms
    .venv/bin/python bench/remote.py --size-gb 0.5 --runs 3 --rtt-ms 0,80

Each round-trip time after 0 puts the project's delaying TCP proxy (tests/python/
remote_servers.py DelayProxy, in a process of its own) between every client and Garage: each
byte crosses it half the round-trip time after it arrived, each way, as between two hosts
in one region (20 ms) or across a continent (80 ms). This kernel has no netem. There, a
client that waits for one answer before its next request (`curl-1stream`) pays the round
trip on every part.
"""
from __future__ import annotations

import argparse
import json
import resource
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "python"))

from bench import ensure_checkpoint  # noqa: E402
from remote_servers import REGION, Garage, garage_binary, wait_for_port  # noqa: E402

BUCKET = "bench"

# Ours prints a third figure: its peak resident memory above what it held after its imports.
# With a budget (argv[2]) it streams, each tensor dropped once seen; without, it loads all.
OURS = """
import resource, sys, time, fastsafetensors_rs as fst
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
start, cpu = time.perf_counter(), time.process_time()
if len(sys.argv) > 2:
    for name, tensor in fst.stream(sys.argv[1], max_memory=sys.argv[2]):
        del tensor
else:
    tensors = fst.load(sys.argv[1])  # every byte is in memory when it returns (nothing is mapped)
print(time.perf_counter() - start, time.process_time() - cpu,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
"""
STREAM_BUDGET = "256M"

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


def curl_config(server, keys: list[str], sizes: list[int], part: int, out: Path | None) -> str:
    """Ranged GETs of every part of every object from `server` (its endpoint, key id and
    secret); the bytes go to /dev/null, or with `out` to one file per part there (a tmpfs:
    memory, as a loader's are)."""
    lines = []
    for key, size in zip(keys, sizes):
        for a in range(0, size, part):
            b = min(a + part, size) - 1
            dest = "/dev/null" if out is None else str(out / f"{key.replace('/', '_')}.{a}")
            lines += [f'url = "{server.endpoint}/{BUCKET}/{key}"', f'range = "{a}-{b}"', f'output = "{dest}"',
                      f'aws-sigv4 = "aws:amz:{REGION}:s3"', f'user = "{server.key_id}:{server.secret}"',
                      'header = "x-amz-content-sha256: UNSIGNED-PAYLOAD"', "fail", "silent", "next"]
    return "\n".join(lines[:-1]) + "\n"


def children_cpu() -> float:
    """CPU seconds (user + system) of the processes this one has run and waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], env: dict, peaks: list[float] | None = None) -> tuple[float, float]:
    """A Python client, which times itself after its imports: (wall, CPU) seconds it prints;
    a third figure, its peak memory above its imports, goes to `peaks`."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    wall, used, *peak = proc.stdout.strip().splitlines()[-1].split()
    if peaks is not None and peak:
        peaks.append(float(peak[0]))
    return float(wall), float(used)


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """A command timed whole: (wall, CPU) seconds."""
    cpu, start = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    return time.perf_counter() - start, children_cpu() - cpu


class Proxy:
    """The delaying TCP proxy in a process of its own, in front of `upstream` (a port)."""

    def __init__(self, upstream: int, rtt_ms: float, scratch: Path):
        port_file = scratch / f"proxy-{rtt_ms:g}.port"
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "python" / "remote_servers.py"), "proxy",
                                      str(upstream), str(rtt_ms), str(port_file)])
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the delay proxy did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        wait_for_port(self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (GB, 1e9 bytes)")
    ap.add_argument("--files", type=int, default=4, help="number of shards")
    ap.add_argument("--runs", type=int, default=5, help="runs per loader (median)")
    ap.add_argument("--streams", type=int, default=16, help="parallel GETs of the reference clients")
    ap.add_argument("--part-mb", type=int, default=8, help="MiB per ranged GET of the reference clients")
    ap.add_argument("--dir", type=Path, default=REPO / "bench-data", help="checkpoint cache")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--rtt-ms", default="0",
                    help="round-trip times to add, comma-separated (0: straight to the server; others "
                         "through the delaying proxy)")
    ap.add_argument("--before", type=Path,
                    help="a directory where an earlier build of the package is installed (pip install --target): "
                         "its load gets a row of its own, for before/after figures from one run")
    ap.add_argument("--before-name", default="before", help="what that row is called")
    args = ap.parse_args()
    rtts = [float(r) for r in args.rtt_ms.split(",")]

    binary = garage_binary()
    if binary is None:
        sys.exit("Garage is not built: run `make garage` (or `make bench-remote`)")
    files, _ = ensure_checkpoint(args.dir, args.size_gb, args.files)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    keys = [f"ckpt/{f.name}" for f in files]
    loaders = ["fastsafetensors_rs", "fastsafetensors_rs-stream", "curl", "curl-shm", "curl-1stream"]
    if args.before:
        loaders.insert(1, f"fastsafetensors_rs ({args.before_name})")
    for module, row in (("boto3", "boto3"), ("runai_model_streamer", "runai")):
        try:
            __import__(module)
            loaders.append(row)
        except ImportError:
            print(f"{module} is not installed: no {row} row", file=sys.stderr)

    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        garage = Garage(binary, Path(scratch))
        shm = Path(tempfile.mkdtemp(prefix="fst-bench-", dir="/dev/shm"))
        try:
            garage.bucket(BUCKET)
            for f, key in zip(files, keys):
                garage.put(BUCKET, key, f.read_bytes())
            for rtt in rtts:
                results[rtt] = measure(args, garage, Path(scratch), shm, loaders, keys, sizes, rtt)
                report(args, results[rtt], loaders, files, total, rtt)
        finally:
            garage.stop()
            shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"bytes": total, "by_rtt_ms": {f"{r:g}": v for r, v in results.items()}},
                                        indent=1))
    return 0


def measure(args, garage: Garage, scratch: Path, shm: Path, loaders: list[str], keys: list[str], sizes: list[int],
            rtt: float) -> dict:
    """Every loader's runs at one round-trip time: seconds, CPU seconds and (ours) peak bytes."""
    proxy = Proxy(int(garage.endpoint.rsplit(":", 1)[1]), rtt, scratch) if rtt else None
    try:
        endpoint = f"http://127.0.0.1:{proxy.port}" if proxy else garage.endpoint
        env = {**os.environ, **garage.env(), "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": endpoint}
        via = SimpleNamespace(endpoint=endpoint, key_id=garage.key_id, secret=garage.secret)
        part = args.part_mb << 20
        cfg = scratch / "curl.cfg"
        cfg.write_text(curl_config(via, keys, sizes, part, None))
        cfg_shm = scratch / "curl-shm.cfg"
        cfg_shm.write_text(curl_config(via, keys, sizes, part, shm))

        def curl_shm() -> tuple[float, float]:
            try:
                return timed(["curl", "--parallel", "--parallel-max", str(args.streams), "-K", str(cfg_shm)], env)
            finally:
                for f in shm.iterdir():
                    f.unlink()
        peaks: dict[str, list[float]] = {"fastsafetensors_rs": [], "fastsafetensors_rs-stream": []}
        url = f"s3://{BUCKET}/ckpt/"
        commands = {
            "fastsafetensors_rs": lambda: run([sys.executable, "-c", OURS, url], env, peaks["fastsafetensors_rs"]),
            "fastsafetensors_rs-stream": lambda: run([sys.executable, "-c", OURS, url, STREAM_BUDGET], env,
                                                     peaks["fastsafetensors_rs-stream"]),
            "curl": lambda: timed(["curl", "--parallel", "--parallel-max", str(args.streams), "-K", str(cfg)], env),
            "curl-1stream": lambda: timed(["curl", "-K", str(cfg)], env),
            "curl-shm": curl_shm,
            "boto3": lambda: run([sys.executable, "-c", BOTO3, BUCKET, ",".join(keys), str(args.streams),
                                  str(part)], env),
            "runai": lambda: run([sys.executable, "-c", RUNAI, ",".join(f"s3://{BUCKET}/{k}" for k in keys)],
                                 {**env, **RUNAI_ENV}),
        }
        if args.before:
            before = f"fastsafetensors_rs ({args.before_name})"
            peaks[before] = []
            path = os.pathsep.join(filter(None, [str(args.before.resolve()), env.get("PYTHONPATH")]))
            commands[before] = lambda: run([sys.executable, "-c", OURS, url], {**env, "PYTHONPATH": path},
                                           peaks[before])
        seconds: dict[str, list[float]] = {name: [] for name in loaders}
        cpu: dict[str, list[float]] = {name: [] for name in loaders}
        for r in range(args.runs):
            order = loaders[r % len(loaders):] + loaders[:r % len(loaders)]
            for name in order:
                wall, used = commands[name]()
                seconds[name].append(wall)
                cpu[name].append(used)
        return {"seconds": seconds, "cpu_seconds": cpu, "peak_bytes": peaks}
    finally:
        if proxy:
            proxy.stop()


def report(args, result: dict, loaders: list[str], files: list[Path], total: int, rtt: float) -> None:
    seconds, cpu, peaks = result["seconds"], result["cpu_seconds"], result["peak_bytes"]
    rate = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    result["gb_per_s"] = rate
    result["client_cpu_s_per_gb"] = {name: statistics.median(c) / (total / 1e9) for name, c in cpu.items()}
    where = f"{rtt:g} ms round-trip time added (delay proxy)" if rtt else "straight to the server"
    print(f"\n{len(files)} file(s), {total / 1e9:.2f} GB in Garage on 127.0.0.1, {where}, median of {args.runs}; "
          f"references: {args.streams} parallel ranged GETs of {args.part_mb} MiB (curl-1stream: one at a time)")
    print("  (client CPU: user + system seconds per GB of the client process, after its imports; "
          "the server's and the proxy's own are not counted)")
    ours = rate["fastsafetensors_rs"]
    for name in loaders:
        line = (f"  {name:<26} {statistics.median(seconds[name]) * 1e3:9.1f} ms {rate[name]:7.2f} GB/s"
                f"  client CPU {result['client_cpu_s_per_gb'][name]:5.2f} s/GB")
        if name in peaks and peaks[name]:
            line += f"  peak {max(peaks[name]) / 2**20:6.0f} MiB above imports"
        if name == "fastsafetensors_rs-stream":
            line += f"   ({rate[name] / ours:.2f}x the bulk load; budget {STREAM_BUDGET})"
        elif name != "fastsafetensors_rs":
            line += f"   (ours {ours / rate[name]:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
