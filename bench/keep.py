#!/usr/bin/env python3
"""What a restart costs with `keep=True`: attaching to kept weights against reading them.

The checkpoint of bench.py (2 GB, Llama-shaped bf16, 4 files). Each row is a fresh process
timing `fastsafetensors_rs.load(dir, ...)` until the tensors are returned (imports before the
clock), rows in a new order each round:

- cold: a plain load, the page cache evicted;
- warm: a plain load, the files in the page cache;
- warm+verify: a plain load with `verify=Digests(...)` (every byte hashed), warm;
- fill: the first load with `keep=True` (no entry: it reads, cold, into the kept memory and
  hands it to the keeper), against `cold` (goal: at least 0.9x its speed): the two run side
  by side, each first in every other run, and their ratio is the geometric mean of the runs'
  (use an even `--runs`);
- attach: `keep=True` with the entry kept (goal: at most 50 ms and 0.1x `warm+verify`);
- attach+verify: `keep=True, verify=...` with the verified entry kept.

Then memory: 4 processes attached to one entry, each having read every page of every tensor,
and their PSS (proportional set size) of the entry's mappings summed: about 1x the checkpoint
(private copies would be 4x).

The keeper is this run's own (a fresh directory), stopped at the end.

    .venv/bin/python bench/keep.py [--size-gb 2] [--files 4] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the checkpoint and the page-cache helpers)

ROWS = ["cold", "warm", "warm+verify", "fill", "attach", "attach+verify"]
KEPT = {"fill": "", "attach": "", "attach+verify": "verified"}


def kept_pss(pid: str = "self") -> int:
    """Bytes of a process's PSS in mappings of kept entries (/proc/PID/smaps)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = "memfd:fastsafetensors-keep" in line
            elif inside and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


def worker(row: str, model: str, digests: str, hold: bool) -> dict[str, Any]:
    """One timed load in this (fresh) process."""
    import torch  # noqa: F401
    import fastsafetensors_rs as fst
    verify = fst.Digests(json.loads(Path(digests).read_text())) if row.endswith("verify") else None
    start = time.perf_counter()
    tensors = fst.load(model, verify=verify, keep=row in KEPT)
    seconds = time.perf_counter() - start
    checksum = bench.touch(tensors.values())
    out = {"seconds": seconds, "checksum": checksum, "pss": kept_pss()}
    if hold:  # keep the tensors until the parent has measured every holder
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
    return out


def spawn(row: str, model: Path, digests: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--worker", row, str(model), str(digests)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip()[-1500:]}
    return json.loads(lines[-1])


def holders(n: int, model: Path, digests: Path) -> list[dict[str, Any]]:
    """`n` processes attached at once, each having touched every page: their reports."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "attach", str(model), str(digests), "--hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        reports = [json.loads(p.stdout.readline()) for p in procs]
        # Measured again now that all of them map the entry (PSS divides shared pages).
        return [dict(r, pss_all=kept_pss(str(p.pid))) for r, p in zip(reports, procs)]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--holders", type=int, default=4, help="processes attached at once for the PSS row")
    p.add_argument("--dir", default=str(Path(__file__).resolve().parents[1] / "bench-data"))
    p.add_argument("--json", help="also write every sample and the medians here")
    p.add_argument("--worker", nargs=3, metavar=("ROW", "MODEL", "DIGESTS"), help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.hold)))
        return 0

    files, _ = bench.ensure_checkpoint(Path(args.dir), args.size_gb, args.files)
    model = files[0].parent
    scratch = Path(tempfile.mkdtemp(prefix="fstk-bench-", dir="/tmp"))
    os.environ["FASTSAFETENSORS_KEEP_DIR"] = str(scratch / "k")
    os.environ.setdefault("FASTSAFETENSORS_KEEP_IDLE", "600")
    from fastsafetensors_rs import keep
    digests = scratch / "digests.json"
    digests.write_text(json.dumps({f.name: "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest() for f in files}))
    size = sum(f.stat().st_size for f in files)
    samples: dict[str, list[dict[str, Any]]] = {}
    try:
        for run in range(args.runs):
            order = [r for r in ROWS if r != "fill"]
            random.Random(run).shuffle(order)
            # The two cold rows side by side, each first in every other run: the one that reads
            # second reads faster on a virtual disk whose host caches what was just read (the
            # same row measured 0.67 s second and 1.05-1.16 s first), so the ratio below
            # compares them over runs where each went first as often.
            at = order.index("cold")
            order.insert(at + run % 2, "fill")
            for row in order:
                if row == "fill":
                    keep.drop(str(model))
                elif row in KEPT and not any(bool(e["verified"]) == bool(KEPT[row]) for e in keep.entries()):
                    spawn(row, model, digests)  # the entry this row attaches to, untimed
                before = {bool(e["verified"]): e["attaches"] for e in keep.entries()}
                if row in ("cold", "fill"):
                    bench.evict(files)
                    time.sleep(bench.SETTLE_SECONDS)
                else:
                    bench.prewarm(files)
                res = spawn(row, model, digests)
                if row.startswith("attach") and "error" not in res:
                    after = {bool(e["verified"]): e["attaches"] for e in keep.entries()}
                    verified = bool(KEPT[row])
                    if after.get(verified, 0) != before.get(verified, 0) + 1:
                        res = {"error": f"{row} did not attach: {keep.entries()}"}
                samples.setdefault(row, []).append(res)
                shown = res.get("error") or f"{res['seconds'] * 1e3:8.1f} ms  {size / res['seconds'] / 1e9:6.2f} GB/s"
                print(f"  run {run + 1}/{args.runs}  {row:<14} {shown}", flush=True)
        held = holders(args.holders, model, digests)
    finally:
        keep.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    medians: dict[str, float] = {}
    sums = set()
    errors = 0
    for row in ROWS:
        ok = [r for r in samples.get(row, []) if "error" not in r]
        errors += len(samples.get(row, [])) - len(ok)
        sums |= {r["checksum"] for r in ok}
        if ok:
            medians[row] = statistics.median(r["seconds"] for r in ok)
    print(f"\nkept weights: {size / 1e9:.2f} GB in {len(files)} files, median of {args.runs}, fresh process each, "
          "time until the tensors are returned")
    print(f"{'row':<16}{'ms':>10}{'GB/s':>9}")
    for row in ROWS:
        if row in medians:
            print(f"{row:<16}{medians[row] * 1e3:>10.1f}{size / medians[row] / 1e9:>9.2f}")
    ratios = {}
    if {"attach", "warm+verify"} <= medians.keys():
        ratios["attach / warm+verify"] = medians["attach"] / medians["warm+verify"]
    if {"attach+verify", "warm+verify"} <= medians.keys():
        ratios["attach+verify / warm+verify"] = medians["attach+verify"] / medians["warm+verify"]
    pairs = [(c["seconds"], f["seconds"]) for c, f in zip(samples.get("cold", []), samples.get("fill", []))
             if "error" not in c and "error" not in f]
    if pairs:
        # Geometric mean of each run's ratio: the order's effect cancels over an even number of runs.
        ratios["fill speed / cold speed"] = math.exp(statistics.fmean(math.log(c / f) for c, f in pairs))
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}x")
    pss = sum(h["pss_all"] for h in held)
    each = ", ".join(f"{h['pss_all'] / 1e9:.2f}" for h in held)
    print(f"{len(held)} processes attached, every page read: PSS of the kept mappings {pss / 1e9:.2f} GB in all, "
          f"{pss / size:.2f}x the checkpoint (each {each} GB)")
    if len(sums | {h["checksum"] for h in held}) > 1:
        print("error: the rows loaded different bytes")
        errors += 1
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "medians_s": medians, "ratios": ratios,
                                               "holders": held, "bytes": size}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
