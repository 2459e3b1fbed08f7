#!/usr/bin/env python3
"""Verified loads against the two passes users run today, cold and warm.

The checkpoint of bench.py (2 GB, Llama-shaped bf16, 4 files) is signed with
`model_signing sign key` (a fresh P-256 key), then each row loads it in a fresh process,
rows interleaved in a new order each round, the page cache evicted (cold) or filled (warm)
before each run:

- ours: `fastsafetensors_rs.load(dir)`, unverified;
- ours+verify: the same with `verify=Signature(model.sig, public_key=...)`: every byte hashed
  as it lands, in the same pass;
- oms+safetensors: `model_signing`'s verify, then safetensors' `load_file` of each file;
- oms+ours: `model_signing`'s verify, then our unverified load.

With `--before DIR` (an earlier build of this package installed there, `pip install
--target DIR --no-deps WHEEL`), a row `ours+verify (NAME)` loads verified with that build, for
before/after figures from one run.

Each row reports GB/s (median) and CPU seconds per GB (user + system, the process and its
children). Then the hash rate of one core: this package's sha256 (`fastsafetensors-rs verify
--digests` of one warm file: one thread per file) beside coreutils' `sha256sum`.

    .venv/bin/python bench/verify.py [--size-gb 2] [--files 4] [--runs 5] [--json out.json]
                                     [--before DIR --before-name NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the checkpoint and the page-cache helpers)

ROWS = ["ours", "ours+verify", "oms+safetensors", "oms+ours"]
SETTLE_SECONDS = bench.SETTLE_SECONDS


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def oms_verify(model: str, signature: str, public: str) -> None:
    import model_signing
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(model, signature)


def worker(row: str, model: str, signature: str, public: str) -> dict[str, Any]:
    """One timed load in this (fresh) process; imports before the clock."""
    import torch  # noqa: F401
    import fastsafetensors_rs as fst
    import model_signing  # noqa: F401
    from safetensors.torch import load_file
    files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
    nbytes = sum(os.path.getsize(f) for f in files)
    cpu0, start = cpu_seconds(), time.perf_counter()
    if row == "ours":
        tensors = fst.load(model)
    elif row.startswith("ours+verify"):
        tensors = fst.load(model, verify=fst.Signature(signature, public_key=public))
    elif row == "oms+safetensors":
        oms_verify(model, signature, public)
        tensors = {k: v for f in files for k, v in load_file(f).items()}
    elif row == "oms+ours":
        oms_verify(model, signature, public)
        tensors = fst.load(model)
    else:
        raise ValueError(row)
    checksum = bench.touch(tensors.values())
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    return {"seconds": seconds, "cpu": cpu, "bytes": nbytes, "checksum": checksum}


def spawn(row: str, model: Path, signature: Path, public: Path, before: Path | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if row.endswith(")") and before is not None:  # the earlier build's row
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before.resolve()), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, "--worker", row, str(model), str(signature), str(public)],
                          capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip()[-1500:]}
    return json.loads(lines[-1])


def sign(model: Path, keys: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = keys / "key.pem", keys / "key.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    signature = keys / "model.sig"
    subprocess.run([str(Path(sys.executable).parent / "model_signing"), "sign", "key", str(model),
                    "--private_key", str(private), "--signature", str(signature)], check=True,
                   capture_output=True)
    return signature, public


def hash_rates(path: Path) -> dict[str, float]:
    """GB/s of one core hashing one warm file, best of three: this package's sha256 (the op
    behind `fastsafetensors-rs verify --digests`, one thread per file; timed around the op
    alone) and coreutils' sha256sum (its process)."""
    import fastsafetensors_rs as fst
    from fastsafetensors_rs import ops
    bench.prewarm([path])
    size = path.stat().st_size
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    spec = json.dumps(fst.Digests({path.name: digest})._spec())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / path.name).symlink_to(path)
        timings: dict[str, list[float]] = {"ours sha256": [], "sha256sum": []}
        for _ in range(3):
            start = time.perf_counter()
            lines = ops.verify_tree(tmp, spec)
            timings["ours sha256"].append(time.perf_counter() - start)
            assert lines == [f"ok\t{path.name}\t"], lines
            start = time.perf_counter()
            subprocess.run(["sha256sum", str(path)], check=True, capture_output=True)
            timings["sha256sum"].append(time.perf_counter() - start)
    return {name: size / min(t) / 1e9 for name, t in timings.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default=str(Path(__file__).resolve().parents[1] / "bench-data"))
    p.add_argument("--json", help="also write every sample and the medians here")
    p.add_argument("--before", type=Path, help="an earlier build of this package installed in this directory: "
                                              "its verified load gets a row of its own")
    p.add_argument("--before-name", default="before", help="what that row is called")
    p.add_argument("--worker", nargs=4, metavar=("ROW", "MODEL", "SIG", "KEY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0

    rows = ROWS + [f"ours+verify ({args.before_name})"] * (args.before is not None)
    files, _ = bench.ensure_checkpoint(Path(args.dir), args.size_gb, args.files)
    model = files[0].parent
    # The signature covers the weights: the bench's own manifest.json is moved aside.
    keys = Path(tempfile.mkdtemp(prefix="fst-verify-bench-"))
    aside = keys / "manifest.json"
    (model / "manifest.json").rename(aside)
    try:
        signature, public = sign(model, keys)
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for mode in ("cold", "warm"):
            for run in range(args.runs):
                order = rows[:]
                random.Random(run).shuffle(order)
                for row in order:
                    if mode == "cold":
                        bench.evict(files)
                        time.sleep(SETTLE_SECONDS)
                    else:
                        bench.prewarm(files)
                    res = spawn(row, model, signature, public, args.before)
                    samples.setdefault((row, mode), []).append(res)
                    shown = res.get("error") or f"{res['bytes'] / res['seconds'] / 1e9:.2f} GB/s"
                    print(f"  {mode} run {run + 1}/{args.runs}  {row:<16} {shown}", flush=True)
        rates = hash_rates(files[0])
    finally:
        aside.rename(model / "manifest.json")
    medians: dict[str, dict[str, Any]] = {}
    sums = set()
    for (row, mode), runs in samples.items():
        ok = [r for r in runs if "error" not in r]
        sums |= {r["checksum"] for r in ok}
        if ok:
            gb = ok[0]["bytes"] / 1e9
            medians.setdefault(row, {})[mode] = {
                "gbps": gb / statistics.median(r["seconds"] for r in ok),
                "cpu_s_per_gb": statistics.median(r["cpu"] for r in ok) / gb,
                "errors": len(runs) - len(ok)}
    size = sum(f.stat().st_size for f in files) / 1e9
    print(f"\nverified loads: {size:.2f} GB in {len(files)} files, median of {args.runs}, "
          "rows rotated, fresh process each")
    width = max(18, max(map(len, rows)) + 2)
    print(f"{'row':<{width}}{'cold GB/s':>10}{'CPU s/GB':>10}{'warm GB/s':>11}{'CPU s/GB':>10}")
    for row in rows:
        cells = []
        for mode in ("cold", "warm"):
            m = medians.get(row, {}).get(mode)
            cells += [f"{m['gbps']:.2f}", f"{m['cpu_s_per_gb']:.2f}"] if m else ["-", "-"]
        print(f"{row:<{width}}{cells[0]:>10}{cells[1]:>10}{cells[2]:>11}{cells[3]:>10}")
    ratio = {}
    for mode in ("cold", "warm"):
        get = lambda r: medians.get(r, {}).get(mode, {}).get("gbps")  # noqa: E731
        if all(get(r) for r in ROWS):
            ratio[mode] = {"vs unverified": get("ours+verify") / get("ours"),
                           "vs oms+safetensors": get("ours+verify") / get("oms+safetensors"),
                           "vs oms+ours": get("ours+verify") / get("oms+ours")}
            if args.before is not None and get(rows[-1]):
                ratio[mode][f"vs {rows[-1]}"] = get("ours+verify") / get(rows[-1])
            print(f"{mode}: ours+verify = " + ", ".join(f"{v:.2f}x {k}" for k, v in ratio[mode].items()))
    print("hash rate, one core, warm file: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    if len(sums) > 1:
        print(f"error: the rows loaded different bytes (checksums {sorted(sums)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": {f"{r}/{m}": s for (r, m), s in samples.items()},
                                               "medians": medians, "ratios": ratio, "hash_rates": rates},
                                              indent=1))
    errors = any(m.get("errors") for r in medians.values() for m in r.values())
    return 1 if errors or len(sums) > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
