"""Cost of one `get_slice(name)[0:2]` on an open handle, by the file's tensor count.

transformers' tensor-parallel loading slices every tensor of a checkpoint through one
`safe_open` handle: a slice whose cost grows with the tensor count makes that quadratic.
Prints ms per call for fastsafetensors_rs and safetensors on files of 100, 2,000 and 20,000
small tensors (2,000 slices each, names in a fixed random order, files warm in the page cache).

    .venv/bin/python bench/slices.py [--calls 2000] [--counts 100,2000,20000] [--reader auto]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import save_file

import fastsafetensors_rs


def write_file(directory: Path, count: int) -> Path:
    path = directory / f"tensors-{count}.safetensors"
    save_file({f"model.layers.{i}.weight": torch.full((8, 16), float(i)) for i in range(count)}, str(path))
    return path


def ms_per_call(open_handle, names) -> float:
    with open_handle() as f:
        f.get_slice(names[0])[0:2]  # the first call pays for imports and lazy setup
        start = time.perf_counter()
        for name in names:
            f.get_slice(name)[0:2]
        return (time.perf_counter() - start) * 1e3 / len(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--counts", default="100,2000,20000")
    parser.add_argument("--reader", default=None, help="auto, direct or mmap (default: the loader's)")
    args = parser.parse_args()
    print(f"{'tensors':>8} {'ours ms/call':>13} {'safetensors ms/call':>20}")
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(c) for c in args.counts.split(",")):
            path = write_file(Path(tmp), count)
            rng = random.Random(count)
            names = [f"model.layers.{rng.randrange(count)}.weight" for _ in range(args.calls)]
            ours = ms_per_call(lambda: fastsafetensors_rs.safe_open(path, reader=args.reader), names)
            theirs = ms_per_call(lambda: st_safe_open(str(path), "pt"), names)
            print(f"{count:>8} {ours:>13.3f} {theirs:>20.3f}", flush=True)


if __name__ == "__main__":
    main()
