"""Streaming, selection, memory, transformers and many-small-tensor measurements.

`bench.py` runs these after its throughput table, in the same run, each measurement in a
fresh interpreter (`bench.py --worker scenario:...`), cold runs after evicting the files and
two idle seconds. Every scenario compares fastsafetensors' streaming path with safetensors'
`safe_open` + `get_tensor` loop and with fastsafetensors' batch `load`, and reports the ratio
its target is stated in (see `bench/README.md`).
"""
from __future__ import annotations

import json
import os
import re
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import bench as B

MiB = 1 << 20
# The stream budget of the memory scenario.
MEMORY_BUDGET = 256 * MiB
# Slack allowed over budget + largest tensor (allocator, Python objects, page tables).
MEMORY_SLACK = 64 * MiB
SCENARIOS = ("streaming", "selection", "memory", "transformers", "moe", "fanout")  # fanout: bench/fanout.py


# ------------------------------------------------------------------ checkpoints


def layer_of(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def last_layers_filter(files: list[str], count: int = 2) -> list[str]:
    """Glob patterns selecting the last `count` decoder layers of a Llama-shaped checkpoint."""
    import torch

    layers = {layer_of(n) for f in files for n in torch.ops.fastsafetensors.describe(f)[0]} - {None}
    return [f"model.layers.{i}.*" for i in sorted(layers)[-count:]]


def ensure_moe_checkpoint(root: Path, files: int = 4) -> tuple[list[Path], bool]:
    """A MoE-shaped checkpoint of about 16k small tensors in `files` shards: 32 layers of 168
    experts (gate, up, down: 32x64 bf16 each) plus attention and norms. Cached like the
    Llama one."""
    import torch
    from safetensors.torch import save_file

    ckpt = root / f"moe-16k-{files}f"
    manifest = ckpt / "manifest.json"
    if manifest.exists():
        sizes: dict[str, int] = json.loads(manifest.read_text())
        if all((ckpt / f).exists() and (ckpt / f).stat().st_size == n for f, n in sizes.items()):
            return [ckpt / name for name in sizes], False
    ckpt.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    layers, experts, sizes = 32, 168, {}
    per_file = layers // files
    for k in range(files):
        tensors = {}
        for layer in range(k * per_file, (k + 1) * per_file):
            p = f"model.layers.{layer}."
            for proj in "qkvo":
                tensors[f"{p}self_attn.{proj}_proj.weight"] = torch.randn(64, 64, generator=gen).bfloat16()
            tensors[p + "input_layernorm.weight"] = torch.ones(64).bfloat16()
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(64).bfloat16()
            for e in range(experts):
                for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                    tensors[f"{p}mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=gen).bfloat16()
        path = ckpt / f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())
        sizes[path.name] = path.stat().st_size
    manifest.write_text(json.dumps(sizes, indent=1))
    return [ckpt / name for name in sizes], True


def ensure_hf_checkpoint(root: Path, size_gb: float, shards: int) -> tuple[Path, bool]:
    """A transformers Llama checkpoint (`save_pretrained`, bf16, sharded) of about `size_gb`,
    shaped as `bench.llama_shapes` chooses, with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = root / f"hf-llama-{size_gb:g}gb-{shards}f"
    manifest = d / "manifest.json"
    if manifest.exists():
        sizes: dict[str, int] = json.loads(manifest.read_text())
        if all((d / f).exists() and (d / f).stat().st_size == n for f, n in sizes.items()):
            return d, False
    shapes = dict(B.llama_shapes(int(size_gb * 1e9)))
    vocab, hidden = shapes["model.embed_tokens.weight"]
    inter = shapes["model.layers.0.mlp.up_proj.weight"][0]
    layers = 1 + max(layer_of(n) for n in shapes if layer_of(n) is not None)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            bits = torch.randint(-2**15, 2**15, p.shape, dtype=torch.int32, generator=gen).to(torch.int16)
            p.copy_(bits.view(torch.bfloat16).nan_to_num(0.0))
    total = sum(p.nbytes for p in model.parameters())
    model.save_pretrained(str(d), max_shard_size=f"{total // shards // 1_000_000 + 1}MB")
    # A tiny model of the same architecture, loaded untimed first so that transformers' lazy
    # imports are done before the clock starts.
    tiny = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(tiny).to(torch.bfloat16).save_pretrained(str(d / "tiny"))
    sizes = {p.name: p.stat().st_size for p in sorted(d.glob("*.safetensors"))}
    for name in sizes:
        with open(d / name, "rb+") as fh:
            os.fsync(fh.fileno())
    manifest.write_text(json.dumps(sizes, indent=1))
    return d, True


# ------------------------------------------------------------------ in the worker


def read_bytes() -> int:
    """Bytes this process caused to be read from storage (`/proc/self/io`)."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("read_bytes")).split()[1])


def rss() -> int:
    with open("/proc/self/status") as fh:
        return 1024 * int(next(line for line in fh if line.startswith("VmRSS:")).split()[1])


def reset_peak() -> bool:
    """Resets the peak RSS (VmHWM) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak() -> int:
    with open("/proc/self/status") as fh:
        return 1024 * int(next(line for line in fh if line.startswith("VmHWM:")).split()[1])


def params_for(files: list[str], selected=None) -> dict[str, Any]:
    """Preallocated, pre-faulted destination tensors, as a model's parameters are."""
    import torch

    from fastsafetensors_rs._dtypes import DTYPES, torch_shape

    out = {}
    for f in files:
        names, dtypes, shapes, *_ = torch.ops.fastsafetensors.describe(f)
        for n, d, s in zip(names, dtypes, shapes):
            if selected is None or n in selected:
                out[n] = torch.zeros(torch_shape(d, s), dtype=DTYPES[d][0])
    return out


def worker(name: str, args: list[str]) -> dict[str, Any]:
    """One measurement named `scenario:<kind>:<variant>`."""
    import torch

    import fastsafetensors_rs

    _, kind, variant = name.split(":", 2)
    files = args
    nbytes = sum(os.path.getsize(f) for f in files)
    out: dict[str, Any] = {"bytes": nbytes}

    if kind == "moe":
        return moe_worker(variant, files, out)
    if kind == "hf":
        return hf_worker(variant, files[0], out)

    described = [torch.ops.fastsafetensors.describe(f)[:3] for f in files]
    out["largest"] = max(_nbytes(d, s) for names, dtypes, shapes in described for d, s in zip(dtypes, shapes))
    selected = None
    if kind == "select":
        patterns = last_layers_filter(files)
        selected = set(torch.ops.fastsafetensors.selected(files, patterns, "glob"))
        out["selected_bytes"] = sum(_nbytes(d, s) for names, dtypes, shapes in described
                                    for n, d, s in zip(names, dtypes, shapes) if n in selected)
    params = params_for(files) if kind == "consume" else {}
    if kind == "consume" and variant == "alone":
        # The consumer alone: the tensors are in memory already (read, untimed).
        tensors = fastsafetensors_rs.load(files, reader="direct")
        B.touch(tensors.values())
        start = time.perf_counter()
        for n, t in tensors.items():
            params[n].copy_(t)
        out["seconds"] = time.perf_counter() - start
        return out

    base = rss()
    resettable = reset_peak()
    io_before = read_bytes()
    start = time.perf_counter()
    checksum = 0
    if kind == "consume":
        if variant == "stream":
            for n, t in fastsafetensors_rs.stream(files):
                params[n].copy_(t)
        elif variant == "stream-only":
            for n, t in fastsafetensors_rs.stream(files):
                pass
        elif variant == "batch":
            for n, t in fastsafetensors_rs.load(files).items():
                params[n].copy_(t)
        elif variant == "safetensors":
            from safetensors import safe_open

            for f in files:
                with safe_open(f, framework="pt") as fh:
                    for n in fh.keys():
                        params[n].copy_(fh.get_tensor(n))
    elif kind == "select":
        patterns = last_layers_filter(files)
        if variant == "ours":
            checksum = B.touch(fastsafetensors_rs.load(files, tensor_filter=patterns).values())
        elif variant == "stream":
            checksum = B.touch(t for _, t in fastsafetensors_rs.stream(files, tensor_filter=patterns))
        elif variant == "whole":
            checksum = B.touch(fastsafetensors_rs.load(files).values())
        elif variant == "safetensors":
            from safetensors import safe_open

            got = []
            for f in files:
                with safe_open(f, framework="pt") as fh:
                    got += [fh.get_tensor(n) for n in fh.keys() if n in selected]
            checksum = B.touch(got)
    elif kind == "memory":
        if variant == "stream":
            for _, t in fastsafetensors_rs.stream(files, max_memory=MEMORY_BUDGET):
                checksum += B.touch([t])
                del t
        elif variant == "batch":
            tensors = fastsafetensors_rs.load(files)
            checksum = B.touch(tensors.values())
        elif variant == "safetensors":
            from safetensors.torch import load_file

            for f in files:
                checksum += B.touch(load_file(f).values())
    else:
        raise ValueError(f"unknown scenario {name}")
    out["seconds"] = time.perf_counter() - start
    out["read_bytes"] = read_bytes() - io_before
    out["peak_delta"] = (peak() if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    if kind == "consume" and variant != "stream-only":
        checksum = B.touch(params.values())  # what was copied, untimed
    out["checksum"] = checksum
    return out


def _nbytes(dtype: str, shape) -> int:
    from fastsafetensors_rs._dtypes import nbytes

    return nbytes(dtype, shape)


def moe_worker(variant: str, files: list[str], out: dict[str, Any]) -> dict[str, Any]:
    """Warm loads of many small tensors: one untimed load, then the median of five."""
    import gc

    import torch

    import fastsafetensors_rs

    def run() -> int:
        if variant == "op":
            return len(torch.ops.fastsafetensors.load(files)[0])
        if variant == "load":
            return len(fastsafetensors_rs.load(files))
        if variant == "load_file":
            return sum(len(fastsafetensors_rs.load_file(f)) for f in files)
        if variant == "stream":
            return sum(1 for _ in fastsafetensors_rs.stream(files))
        if variant == "safetensors":
            from safetensors.torch import load_file

            return sum(len(load_file(f)) for f in files)
        raise ValueError(variant)

    out["tensors"] = run()
    times = []
    for _ in range(5):
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    out["seconds"] = statistics.median(times)
    return out


def hf_worker(variant: str, directory: str, out: dict[str, Any]) -> dict[str, Any]:
    """`from_pretrained` (bf16, every parameter touched), stock or patched."""
    import torch
    from transformers import AutoModelForCausalLM

    import fastsafetensors_rs

    out["bytes"] = sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(os.path.join(directory, "tiny"), dtype=torch.bfloat16)  # imports
    start = time.perf_counter()
    if variant == "ours":
        with fastsafetensors_rs.patched_transformers():
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    out["checksum"] = B.touch(p.data for p in model.parameters())
    out["seconds"] = time.perf_counter() - start
    return out


# ------------------------------------------------------------------ the driver


def measure(plan: list[tuple[str, str, list[Path], str]], runs: int) -> dict[tuple[str, str], list[dict]]:
    """Runs every (label, worker name, files, mode) `runs` times, interleaved and in a seeded
    shuffled order per round, as the throughput table is; returns the samples per label."""
    import random

    samples: dict[tuple[str, str], list[dict]] = {}
    for run in range(runs):
        order = plan[:]
        random.Random(1000 + run).shuffle(order)
        for label, name, files, mode in order:
            data_files = [f for p in files for f in (sorted(p.glob("*.safetensors")) if p.is_dir() else [p])]
            if mode == "cold":
                B.evict(data_files)
                time.sleep(B.SETTLE_SECONDS)
            else:
                B.prewarm(data_files)
            res = B.spawn("worker", name, files)
            samples.setdefault((label, mode), []).append(res)
            shown = res.get("error") or f"{res['seconds']:.3f} s"
            print(f"  {mode} run {run + 1}/{runs}  {label:<26}{shown}", flush=True)
    return samples


def median(samples: list[dict], key: str = "seconds") -> float | None:
    ok = [s[key] for s in samples if "error" not in s and key in s]
    return statistics.median(ok) if ok else None


def run(args, llama_files: list[Path]) -> tuple[list[str], bool, dict]:
    """Measures the selected scenarios; returns (verdict lines, all runs sound, results)."""
    chosen = [s for s in args.scenarios.split(",") if s]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))} (known: {', '.join(SCENARIOS)})")
    plan: list[tuple[str, str, list[Path], str]] = []
    generated: list[Path] = []
    if "streaming" in chosen:
        for variant in ("stream", "stream-only", "batch", "safetensors", "alone"):
            mode = "warm" if variant == "alone" else "cold"
            plan.append((f"consume:{variant}", f"scenario:consume:{variant}", llama_files, mode))
    if "selection" in chosen:
        for variant in ("ours", "stream", "safetensors", "whole"):
            plan.append((f"select:{variant}", f"scenario:select:{variant}", llama_files, "cold"))
    if "memory" in chosen:
        for variant in ("stream", "batch", "safetensors"):
            plan.append((f"memory:{variant}", f"scenario:memory:{variant}", llama_files, "cold"))
    if "transformers" in chosen:
        start = time.perf_counter()
        hf_dir, fresh = ensure_hf_checkpoint(args.dir, args.size_gb, args.files)
        if fresh:
            generated.append(hf_dir)
        shards = len(list(hf_dir.glob("*.safetensors")))
        print(f"transformers checkpoint: {shards} shards, {hf_dir} "
              f"({'generated in %.1f s' % (time.perf_counter() - start) if fresh else 'cached'})")
        for variant in ("stock", "ours"):
            for mode in ("cold", "warm"):
                plan.append((f"hf:{variant}", f"scenario:hf:{variant}", [hf_dir], mode))
    if "fanout" in chosen:
        chosen.remove("fanout")  # measured by bench/fanout.py
    if "moe" in chosen:
        moe_files, fresh = ensure_moe_checkpoint(args.dir)
        if fresh:
            generated.append(moe_files[0].parent)
        for variant in ("op", "load", "load_file", "stream", "safetensors"):
            plan.append((f"moe:{variant}", f"scenario:moe:{variant}", moe_files, "warm"))
    print(f"\nscenarios: {', '.join(chosen)} ({len(plan)} measurements x {args.runs} runs)")
    samples = measure(plan, args.runs)
    verdicts, results = report(samples)
    sound = not any("error" in s for ss in samples.values() for s in ss)
    # Every loader of one scenario reads the same bytes: the touch checksums must agree.
    for prefix in ("select:", "memory:", "consume:", "hf:"):
        sums = {s["checksum"] for (label, _), ss in samples.items() if label.startswith(prefix)
                and label not in ("select:whole", "consume:stream-only") for s in ss if "checksum" in s}
        if len(sums) > 1:
            print(f"  error: {prefix} checksums differ between loaders: {sorted(sums)}")
            sound = False
    return verdicts, sound, {"samples": {f"{k[0]}/{k[1]}": v for k, v in samples.items()}, "results": results,
                             "generated": [str(g) for g in generated]}


def report(samples: dict[tuple[str, str], list[dict]]) -> tuple[list[str], dict]:
    """Prints each scenario's table and ratios; returns the verdict lines and the numbers."""
    def get(label: str, mode: str, key: str = "seconds") -> float | None:
        return median(samples.get((label, mode), []), key)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    checks: list[tuple[str, float | None, float, str]] = []  # label, value, bound (<0: upper), fmt
    results: dict[str, Any] = {}

    if any(k[0].startswith("consume:") for k in samples):
        print("\nstreaming (cold; consumer copies each tensor into a preallocated parameter):")
        rows = [("consume:stream", "stream + copy"), ("consume:stream-only", "stream, no consumer"),
                ("consume:batch", "batch load + copy"), ("consume:safetensors", "safetensors safe_open + copy"),
                ("consume:alone", "copy alone (warm, in memory)")]
        for label, text in rows:
            mode = "warm" if label == "consume:alone" else "cold"
            print(f"  {text:<34}{B.cell(get(label, mode), '{:.3f} s')}")
        both = get("consume:stream", "cold")
        bound = max(filter(None, [get("consume:stream-only", "cold"), get("consume:alone", "warm")]), default=None)
        value = ratio(both, bound)
        results["streaming"] = {"ratio": value, "vs_batch": ratio(get("consume:batch", "cold"), both),
                                "vs_safetensors": ratio(get("consume:safetensors", "cold"), both)}
        print(f"  stream+copy / max(stream alone, copy alone) = {B.cell(value, '{:.2f}')};"
              f"  batch+copy / stream+copy = {B.cell(results['streaming']['vs_batch'], '{:.2f}x')};"
              f"  safetensors / stream+copy = {B.cell(results['streaming']['vs_safetensors'], '{:.2f}x')}")
        checks.append(("streaming: load+consume <= 1.15 x max(load, consume), cold", value, -1.15, "{:.2f}"))

    if any(k[0].startswith("select:") for k in samples):
        print("\nselection (cold; the last 2 decoder layers):")
        selected = get("select:ours", "cold", "selected_bytes")
        whole = get("select:whole", "cold")
        for label, text in (("select:ours", "ours load(tensor_filter)"), ("select:stream", "ours stream(tensor_filter)"),
                            ("select:safetensors", "safetensors safe_open + get_tensor"),
                            ("select:whole", "ours load, everything")):
            t, rb = get(label, "cold"), get(label, "cold", "read_bytes")
            print(f"  {text:<38}{B.cell(t, '{:.3f} s'):>9}  read {B.cell(rb and rb / MiB, '{:.0f} MiB'):>9}"
                  f"  = {B.cell(ratio(rb, selected), '{:.2f}'):>5} x selected")
        if selected:
            print(f"  selected: {selected / MiB:.0f} MiB")
        read_ratio = ratio(get("select:ours", "cold", "read_bytes"), selected)
        time_ratio = ratio(get("select:ours", "cold"), whole)
        results["selection"] = {"read_ratio": read_ratio, "time_ratio": time_ratio, "selected_bytes": selected,
                                "stream_read_ratio": ratio(get("select:stream", "cold", "read_bytes"), selected),
                                "safetensors_read_ratio": ratio(get("select:safetensors", "cold", "read_bytes"),
                                                                selected)}
        checks.append(("selection: read <= 1.2 x selected bytes, cold", read_ratio, -1.2, "{:.2f}"))
        checks.append(("selection: time <= 0.2 x whole load, cold", time_ratio, -0.2, "{:.3f}"))

    if any(k[0].startswith("memory:") for k in samples):
        print(f"\nmemory (cold; peak RSS over the post-import baseline; stream max_memory={MEMORY_BUDGET // MiB} MiB):")
        largest = get("memory:stream", "cold", "largest")
        for label, text in (("memory:stream", "ours stream (iterator)"), ("memory:batch", "ours load (batch)"),
                            ("memory:safetensors", "safetensors load_file")):
            d = get(label, "cold", "peak_delta")
            print(f"  {text:<30}{B.cell(d and d / MiB, '{:.0f} MiB'):>10}   {B.cell(get(label, 'cold'), '{:.3f} s')}")
        bound = MEMORY_BUDGET + (largest or 0) + MEMORY_SLACK
        value = get("memory:stream", "cold", "peak_delta")
        results["memory"] = {"stream_peak": value, "batch_peak": get("memory:batch", "cold", "peak_delta"),
                             "bound": bound, "ratio": ratio(value, bound)}
        print(f"  bound: max_memory + largest tensor ({B.cell(largest and largest / MiB, '{:.0f}')} MiB) + 64 MiB"
              f" = {bound / MiB:.0f} MiB; stream peak / bound = {B.cell(ratio(value, bound), '{:.2f}')}")
        checks.append((f"memory: stream peak <= max_memory + largest + 64 MiB = {bound / MiB:.0f} MiB",
                       ratio(value, bound), -1.0, "{:.2f} of the bound"))

    if any(k[0].startswith("hf:") for k in samples):
        print("\ntransformers from_pretrained (bf16, every parameter touched):")
        for mode in ("cold", "warm"):
            stock, ours = get("hf:stock", mode), get("hf:ours", mode)
            print(f"  {mode}: stock {B.cell(stock, '{:.2f} s')}, patched {B.cell(ours, '{:.2f} s')}, "
                  f"speed-up {B.cell(ratio(stock, ours), '{:.2f}x')}")
            results[f"transformers_{mode}"] = ratio(stock, ours)
        checks.append(("transformers: patched >= 2x stock, cold", results["transformers_cold"], 2.0, "{:.2f}x"))
        checks.append(("transformers: patched never slower, warm", results["transformers_warm"], 1.0, "{:.2f}x"))

    if any(k[0].startswith("moe:") for k in samples):
        print("\nmany small tensors (MoE-shaped, warm; median of 5 loads per process):")
        count = get("moe:load", "warm", "tensors")
        for label, text in (("moe:load", "fastsafetensors_rs.load(files)"), ("moe:op", "torch.ops...load(files) (Dict)"),
                            ("moe:load_file", "load_file per file"), ("moe:stream", "stream(files)"),
                            ("moe:safetensors", "safetensors load_file per file")):
            t = get(label, "warm")
            print(f"  {text:<34}{B.cell(t and t * 1e3, '{:.1f} ms'):>10}"
                  f"  {B.cell(t and count and t / count * 1e6, '{:.2f} us/tensor'):>15}")
        per_tensor = ratio(get("moe:load", "warm"), count)
        results["moe"] = {"tensors": count, "us_per_tensor": per_tensor and per_tensor * 1e6,
                          "op_us_per_tensor": (ratio(get("moe:op", "warm"), count) or 0) * 1e6 or None}
        checks.append((f"many small tensors: load <= 2 us per tensor ({count and int(count)} tensors)",
                       per_tensor and per_tensor * 1e6, -2.0, "{:.2f} us"))

    verdicts = []
    for label, value, bound, fmt in checks:
        ok = value is not None and (value >= bound if bound > 0 else value <= -bound)
        verdict = "SKIP" if value is None else "PASS" if ok else "MISS"
        verdicts.append(f"[{verdict}] {label}  (measured: {B.cell(value, fmt)})")
    return verdicts, results


def add_arguments(ap) -> None:
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="comma-separated scenarios after the throughput table: " + ", ".join(SCENARIOS)
                    + " ('' for none)")
