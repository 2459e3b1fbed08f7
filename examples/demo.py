"""What fastsafetensors_rs is for, in under a minute: a ~1 GB checkpoint loaded cold (its pages
evicted from the page cache, so the bytes come from the disk) and warm (already in memory), by
this package and by safetensors, beside the rate the disk itself gives.

Run with `make demo` (it builds the package first). The checkpoint is generated once into
demo-data/. Every load is timed up to having read one byte of every page of every tensor: a
lazily mapped tensor is not loaded until it is read.
"""

import os
import statistics
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import fastsafetensors_rs

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo-data", "llama-1gb")
FILES = 4
HIDDEN = 2048
LAYERS = 12  # 12 layers of 2048 x (4 x 2048 + 3 x 4096) bf16: ~1.0 GB
ROUNDS = 3


def generate() -> list:
    """A Llama-shaped bf16 checkpoint of ~1 GB in 4 shards, of random bits (a loader that read
    the wrong bytes could not match), flushed to disk so that its pages can be evicted."""
    os.makedirs(DIR, exist_ok=True)
    paths = [os.path.join(DIR, f"model-{i + 1:05d}-of-{FILES:05d}.safetensors") for i in range(FILES)]
    if all(os.path.exists(p) for p in paths):
        return paths
    gen = torch.Generator().manual_seed(0)
    inter = 4096
    per_file = LAYERS // FILES
    for i, path in enumerate(paths):
        shapes = {}
        for layer in range(i * per_file, (i + 1) * per_file):
            p = f"model.layers.{layer}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[p + f"self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
            shapes[p + "mlp.gate_proj.weight"] = (inter, HIDDEN)
            shapes[p + "mlp.up_proj.weight"] = (inter, HIDDEN)
            shapes[p + "mlp.down_proj.weight"] = (HIDDEN, inter)
            shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        tensors = {k: torch.randint(-2**15, 2**15, s, generator=gen, dtype=torch.int16).view(torch.bfloat16)
                   for k, s in shapes.items()}
        tmp = path + ".tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return paths


def evict(paths) -> None:
    """Drops the files' pages from the page cache (no root needed for clean pages)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass


def touch(tensors: dict) -> None:
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def disk(paths) -> None:
    """The disk's own rate: `dd iflag=direct`, file after file."""
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"], check=True)


LOADERS = {
    "fastsafetensors_rs.load": lambda paths: touch(fastsafetensors_rs.load(paths)),
    "safetensors load_file": lambda paths: touch({k: v for p in paths for k, v in st_load_file(p).items()}),
}


def seconds(fn, paths, cold: bool) -> float:
    (evict if cold else warm)(paths)
    time.sleep(0.5 if cold else 0)  # let the disk settle after the last run's reads
    start = time.perf_counter()
    fn(paths)
    return time.perf_counter() - start


def main() -> int:
    start = time.perf_counter()
    paths = generate()
    nbytes = sum(os.path.getsize(p) for p in paths)
    print(f"checkpoint: {FILES} files, {nbytes / 1e9:.2f} GB in {os.path.relpath(DIR)} "
          f"(ready in {time.perf_counter() - start:.0f} s)")

    # Bit for bit the same tensors as safetensors loads.
    ours, ref = fastsafetensors_rs.load(paths), {k: v for p in paths for k, v in st_load_file(p).items()}
    same = ours.keys() == ref.keys() and all(torch.equal(ours[k].view(torch.int16), ref[k].view(torch.int16))
                                             for k in ref)
    print(f"identical tensors: {same} ({len(ours)} tensors)")
    del ours, ref

    # Rounds alternate the loaders (and the disk), so that drift in the disk's rate hits all alike.
    times = {name: {"cold": [], "warm": []} for name in LOADERS}
    times["disk (dd iflag=direct)"] = {"cold": []}
    for r in range(ROUNDS):
        order = list(LOADERS.items()) if r % 2 == 0 else list(reversed(LOADERS.items()))
        for name, fn in order:
            times[name]["cold"].append(seconds(fn, paths, cold=True))
        times["disk (dd iflag=direct)"]["cold"].append(seconds(disk, paths, cold=True))
        for name, fn in order:
            times[name]["warm"].append(seconds(fn, paths, cold=False))

    rate = {name: {mode: nbytes / statistics.median(s) / 1e9 for mode, s in modes.items()}
            for name, modes in times.items()}
    print(f"\n{'GB/s, median of ' + str(ROUNDS):<26}{'cold':>8}{'warm':>8}")
    for name, modes in rate.items():
        print(f"{name:<26}{modes['cold']:>8.2f}" + (f"{modes['warm']:>8.2f}" if "warm" in modes else f"{'-':>8}"))
    ours, st, dd = rate["fastsafetensors_rs.load"], rate["safetensors load_file"], rate["disk (dd iflag=direct)"]
    print(f"\nCold, where a model server starts: {ours['cold'] / st['cold']:.2f}x safetensors, "
          f"{ours['cold'] / dd['cold']:.2f}x what the disk gives one reader; warm, both map the page cache "
          f"({ours['warm'] / st['warm']:.2f}x). (`make bench` measures more carefully: fresh processes, more runs.)")
    print(f"demo took {time.perf_counter() - start:.0f} s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
