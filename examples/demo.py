"""Generates a small multi-file checkpoint (if absent) and loads it with fastsafetensors.

Run with `make demo`. Prints what was loaded, how each file was read, and how fast, next to
safetensors' own loader, and checks that both loaded the same bytes.
"""

import os
import sys
import time

import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import fastsafetensors_rs

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo-data")
FILES = 4
HIDDEN = 1024
LAYERS_PER_FILE = 2


def generate() -> list:
    """A Llama-shaped bf16 checkpoint of ~270 MB in 4 shards."""
    os.makedirs(DIR, exist_ok=True)
    paths = []
    gen = torch.Generator().manual_seed(0)
    for i in range(FILES):
        path = os.path.join(DIR, f"model-{i + 1:05d}-of-{FILES:05d}.safetensors")
        paths.append(path)
        if os.path.exists(path):
            continue
        tensors = {}
        for layer in range(i * LAYERS_PER_FILE, (i + 1) * LAYERS_PER_FILE):
            p = f"model.layers.{layer}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                tensors[p + f"self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
            for name, shape in (("gate_proj", (4 * HIDDEN, HIDDEN)), ("up_proj", (4 * HIDDEN, HIDDEN)), ("down_proj", (HIDDEN, 4 * HIDDEN))):
                tensors[p + f"mlp.{name}.weight"] = shape
            tensors[p + "input_layernorm.weight"] = (HIDDEN,)
        tensors = {k: torch.randn(s, generator=gen, dtype=torch.float32).to(torch.bfloat16) for k, s in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return paths


def touch(tensors: dict) -> None:
    """Reads one byte per page: a lazily mapped tensor is not loaded until it is read."""
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    touch(out if isinstance(out, dict) else out[0])
    return out, time.perf_counter() - start


def main() -> int:
    paths = generate()
    nbytes = sum(os.path.getsize(p) for p in paths)
    print(f"checkpoint: {len(paths)} files, {nbytes / 1e6:.0f} MB in {os.path.relpath(DIR)}")

    ours, ours_s = timed(lambda: fastsafetensors_rs.ops.load_with_report(paths))
    tensors, read_paths = ours
    print(f"fastsafetensors_rs.load: {len(tensors)} tensors in {ours_s * 1e3:.1f} ms "
          f"({nbytes / ours_s / 1e9:.2f} GB/s); files read with: {', '.join(read_paths)}")

    ref, ref_s = timed(lambda: {k: v for p in paths for k, v in st_load_file(p).items()})
    print(f"safetensors load_file: {len(ref)} tensors in {ref_s * 1e3:.1f} ms ({nbytes / ref_s / 1e9:.2f} GB/s)")
    print("(both timed up to having read every page, from a warm page cache; `make bench` measures cold and warm properly)")

    same = ref.keys() == tensors.keys() and all(torch.equal(ref[k], tensors[k]) for k in ref)
    print("identical tensors:", same)
    for name in list(tensors)[:3]:
        t = tensors[name]
        print(f"  {name}: {t.dtype} {tuple(t.shape)}")

    as_f32 = fastsafetensors_rs.load(paths[:1], dtype=torch.float32)
    print(f"with dtype=torch.float32: {next(iter(as_f32.values())).dtype}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
