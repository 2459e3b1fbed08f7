"""Validates the CUDA paths on a machine with a GPU: `make gpu-check`.

Every check prints one row of a single table — PASS, FAIL, or NOT RUN with the reason (a
second GPU, the nvidia-fs driver, compute-sanitizer) — then the throughput table. Exits 1 if
any check failed, 0 otherwise (also on machines without CUDA, where nothing can be checked).

  correctness   every path (staged O_DIRECT, staged through the page cache, auto, GDS where
                nvidia-fs is loaded) bit-exact for every dtype; misaligned tensors; a dtype
                cast on the device; the path each file took
  large file    a >= 1 GiB file of position-derived bytes, bit-compared on the device, with 1
                and 16 I/O threads, through each staged path (the staging ring reused many
                times over)
  ordering      a load into memory that a queued kernel still writes (freed while the kernel
                waits behind a sleep on torch's current stream, whose pool the memory returns
                to) is exact, with the default stream current and with another one current
                (torch.cuda.stream(s): the stream the library looks up through torch's C shim);
                a kernel left running on another stream does not delay the load (no
                device-wide synchronization)
  devices       the caller's current device, context and new allocations are unchanged by a
                load to another GPU; a load of no files touches only the requested GPU;
                threads loading different files at once, on one GPU and on two
  errors        a file truncated mid-load: a RuntimeError, device memory back to baseline,
                and the next load and torch.cuda.synchronize() succeed; again under
                compute-sanitizer (memcheck) when it is installed
  memory        device buffers counted by torch.cuda.memory_allocated() and freed with their
                tensors; with dtype=, memory held equals the returned tensors' sizes
  staging       pinned staging buffers kept between loads and released on request; 20 small
                loads timed with the pool and with re-allocation each time
  GDS           nogds=False never reports "gds" where cuFile runs in compatibility mode; with
                nvidia-fs: a > 512 MiB file into a fragmented allocator, to each GPU, with the
                nvidia-fs read counters checked
  fan-out       a load shared over an NCCL group (process_group=): its pieces read into
                device memory through the staging ring and all-gathered by NCCL, bit-exact
                with a cast and a filter; a world of one on one GPU, and of 2 ranks (torchrun)
                where there are two GPUs
  remote        an http:// URL (the tests' HTTP range server, on this machine's loopback)
                loaded and streamed to the GPU through the staging ring, bit-exact
  keep          keep=True to the GPU: a first process fills kept device memory, a second
                attaches (bytes equal, nothing read, the attach time), an in-place write into
                an attached tensor fails in its own process, and the keeper killed with a
                client attached leaves that client's tensors valid (the next load reads again)
  throughput    cold and warm, each path against safetensors' safe_open(device="cuda") and
                the limits (dd iflag=direct, pinned host-to-device), outputs compared

Needs only torch, safetensors and the built package: on a machine without cargo, build the
extension elsewhere and run `PYTHONPATH=python python tests/gpu/gpu_check.py`. Checks that need
a process of their own run this file again as a child (`--child NAME`).
"""

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import fastsafetensors_rs

ops = torch.ops.fastsafetensors
DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
]
NVFS_STATS = "/proc/driver/nvidia-fs/stats"
STAGED = [("staged-direct", dict(reader="direct", nogds=True), "direct"),
          ("staged-buffered", dict(reader="mmap", nogds=True), "buffered")]
ROWS = []  # (section, status, check, detail)


def row(section: str, ok, check: str, detail: str = "") -> None:
    """One row of the table. `ok` is True, False, or a string: why the check did not run."""
    status = "PASS" if ok is True else "FAIL" if ok is False else "NOT RUN"
    if isinstance(ok, str):
        detail = ok + (f"; {detail}" if detail else "")
    ROWS.append((section, status, check, detail))
    print(f"  {status:<8}{check}" + (f"  ({detail})" if detail else ""), flush=True)


def guarded(section: str, check: str):
    """Runs a check; an exception is its failure, not the end of the run."""
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                row(section, False, check, f"{type(e).__name__}: {e}"[:300])
        return run
    return wrap


def gpus() -> int:
    return torch.cuda.device_count()


def nvidia_fs() -> bool:
    return os.path.exists(NVFS_STATS)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (compared on a's device)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b).to(a.device))


def load(files, device="cuda", **kwargs):
    """The op itself, so that the path each file took is known: the tensors by name, and how
    each file was read."""
    files = [files] if isinstance(files, str) else files
    names, tensors, read_paths = ops.load_with_report(files, device, kwargs.get("dtype"), kwargs.get("reader"),
                                                      kwargs.get("nogds"))
    return dict(zip(names, tensors)), read_paths


def evict(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def warm(files) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


# ---------------------------------------------------------------- files


def all_dtypes_file(path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        raw = torch.randint(0, 256, (37, 64), dtype=torch.uint8, generator=gen)
        if dtype == torch.bool:
            raw = raw % 2
        tensors[f"t{i}"] = raw.view(dtype) if dtype != torch.bool else raw.bool()
    tensors["finite"] = torch.randn(1000, 3, generator=gen)
    tensors["empty"] = torch.empty(0, 5)
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    save_file(tensors, path)


def misaligned_file(path: str) -> dict:
    """A header of 7 mod 8 bytes: every multi-byte tensor is misaligned in memory."""
    data = {"a": torch.arange(100, dtype=torch.float32), "b": torch.arange(9, dtype=torch.int64)}
    header, blob, offset = {}, b"", 0
    for name, t in data.items():
        raw = t.numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blob += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    while (8 + len(text)) % 8 != 7:
        text += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + blob)
    return data


PATTERN_PARTS = 4


def pattern_file(path: str, gib: float) -> None:
    """`gib` GiB in PATTERN_PARTS int64 tensors; word i of the data section holds i."""
    words = int(gib * (1 << 30)) // 8 // PATTERN_PARTS
    save_file({f"part{k}": torch.arange(k * words, (k + 1) * words, dtype=torch.int64)
               for k in range(PATTERN_PARTS)}, path)


def pattern_exact(tensors: dict) -> bool:
    """Compares on the device: no host copy of a gigabyte."""
    words = tensors["part0"].numel()
    for k in range(PATTERN_PARTS):
        t = tensors[f"part{k}"]
        expected = torch.arange(k * words, (k + 1) * words, dtype=torch.int64, device=t.device)
        if not torch.equal(t, expected):
            return False
    return True


# ---------------------------------------------------------------- children


def run_child(name: str, *args, env=None, timeout=180, prefix=()) -> dict:
    """Runs `--child name args` in a fresh process; returns its JSON result."""
    here = os.path.dirname(os.path.abspath(fastsafetensors_rs.__file__))
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(here), os.environ.get("PYTHONPATH")]))
    child_env.update(env or {})
    cmd = [*prefix, sys.executable, os.path.abspath(__file__), "--child", name, *map(str, args)]
    try:
        # In the temp dir: cuFile writes its cufile.log into the working directory.
        done = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: {' | '.join(tail)}", "output": done.stdout + done.stderr}
    result = json.loads(lines[-1][len("RESULT "):])
    result["output"] = done.stdout + done.stderr
    return result


def child_pattern(path: str) -> dict:
    """Loads the pattern file through each staged path (cold); threads come from the env."""
    out = {}
    for label, kwargs, expected in STAGED:
        evict([path])
        start = time.perf_counter()
        tensors, taken = load(path, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out[label] = {"taken": taken, "expected": expected, "exact": pattern_exact(tensors), "seconds": seconds}
        del tensors
    return out


def child_truncate(path: str, pattern: str) -> dict:
    """Truncates `path` (a copy of the pattern file) while it loads cold."""
    torch.cuda.init()
    baseline = torch.cuda.memory_allocated()
    error = None
    for delay in (0.15, 0.05, 0.01, 0.0):
        shutil.copyfile(pattern, path)
        evict([path])
        timer = threading.Timer(delay, lambda: os.truncate(path, os.path.getsize(path) // 2))
        timer.start()
        try:
            tensors, _ = load(path, reader="direct", nogds=True)
            del tensors
        except RuntimeError as e:
            error = str(e)
        timer.join()
        if error:
            break
    gc.collect()
    left = torch.cuda.memory_allocated() - baseline
    tensors, taken = load(pattern, reader="direct", nogds=True)
    next_ok = pattern_exact(tensors)
    del tensors
    torch.cuda.synchronize()
    return {"error": error and error[:200], "left": left, "next_ok": next_ok, "taken": taken, "synced": True}


def child_gds_compat(path: str) -> dict:
    tensors, taken = None, None
    try:
        tensors, taken = load(path, nogds=False)
    except RuntimeError as e:
        return {"refused": str(e)[:200]}
    return {"taken": taken, "exact": pattern_exact(tensors)}


def child_no_files(path: str) -> dict:
    """With two GPUs: current device 1, a load of nothing and of a file to "cuda"."""
    torch.cuda.set_device(1)
    empty, _ = load([], "cuda")
    tensors, _ = load(path, "cuda")
    return {"empty": len(empty), "on": sorted({t.device.index for t in tensors.values()}),
            "gpu0_context": bool(torch._C._cuda_hasPrimaryContext(0))}


def child_fanout(path: str) -> dict:
    """One rank of a shared load over NCCL (torchrun's environment, or a world of one): the
    shared path itself, even for one rank, compared with safetensors on every rank."""
    import torch.distributed as dist

    from fastsafetensors_rs import distributed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    try:
        ref = st_load_file(path)
        evict([path])
        results = {}
        for label, dtype, patterns in [("whole", None, None), ("cast+filter", torch.float16, ["*"])]:
            shared = distributed.SharedLoad([path], f"cuda:{torch.cuda.current_device()}", dtype, None, patterns,
                                            "glob", dist.group.WORLD, None, False)
            got = dict(pair for buffer in shared.buffers() for pair in buffer)
            torch.cuda.synchronize()
            castable = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
            want = {k: (v.to(dtype) if dtype is not None and v.dtype in castable else v) for k, v in ref.items()}
            results[label] = sorted(got) == sorted(want) and all(same(got[k], want[k]) for k in want)
        # Verified: each file hashed once in the group, from a host copy of the device buffer the
        # tensors are views of; a wrong digest fails every rank. Timed beside the unverified load.
        import hashlib

        from fastsafetensors_rs import Digests
        from fastsafetensors_rs.verify import spec

        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        name = os.path.basename(path)
        device = f"cuda:{torch.cuda.current_device()}"
        seconds = {}
        for label, digests in [("unverified", None), ("verified", {name: digest}), ("wrong", {name: "0" * 64})]:
            evict([path])
            dist.barrier()
            got = None
            start = time.perf_counter()
            try:
                shared = distributed.SharedLoad([path], device, None, None, None, "glob", dist.group.WORLD, None,
                                                False, verify=None if digests is None else spec(Digests(digests),
                                                                                                 [path]))
                got = dict(pair for buffer in shared.buffers() for pair in buffer)
                torch.cuda.synchronize()
                seconds[label] = time.perf_counter() - start
                results[label] = sorted(got) == sorted(ref) and all(same(got[k], ref[k]) for k in ref)
            except RuntimeError as e:
                results[label] = f"{name}: digest mismatch" in str(e) and label == "wrong"
            del got
        size = os.path.getsize(path)
        results["rates"] = {k: size / v / 1e9 for k, v in seconds.items()}
        return {"rank": rank, "world": dist.get_world_size(), **results}
    finally:
        dist.destroy_process_group()


def child_keep(path: str, write: str = "") -> dict:
    """A kept load of `path` to the GPU in a fresh process (FASTSAFETENSORS_KEEP_DIR from the
    parent): how each file came, the time until the tensors were returned, a checksum of their
    bytes; with `write`, then an in-place write into one of them."""
    torch.cuda.init()
    start = time.perf_counter()
    names, tensors, taken = ops.load_kept([path], "cuda")
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    out = {"taken": list(taken), "seconds": seconds,
           "sum": int(sum(as_bytes(t).sum(dtype=torch.int64).item() for t in tensors)),
           "torch_allocated": torch.cuda.memory_allocated()}
    if write:
        try:
            tensors[0].view(-1)[:16].zero_()
            torch.cuda.synchronize()
            out["write"] = "succeeded"
        except RuntimeError as e:
            out["write"] = f"failed: {e}".splitlines()[0][:200]
    return out


CHILDREN = {"pattern": child_pattern, "truncate": child_truncate, "gds_compat": child_gds_compat,
            "no_files": child_no_files, "fanout": child_fanout, "keep": child_keep}


# ---------------------------------------------------------------- checks


def correctness(tmp: str) -> None:
    print("correctness")
    path = os.path.join(tmp, "all.safetensors")
    all_dtypes_file(path)
    ref = st_load_file(path)
    paths = [(label, kw, exp) for label, kw, exp in STAGED] + [("auto", {}, None)]
    if nvidia_fs():
        paths.append(("gds", dict(nogds=False), "gds"))
    for label, kwargs, expected in paths:
        got, taken = load(path, **kwargs)
        exact = got.keys() == ref.keys() and all(same(got[k], ref[k]) for k in ref)
        on_cuda = all(t.is_cuda for t in got.values())
        row("correctness", exact and on_cuda, f"{label}: all dtypes bit-exact on cuda", f"path {taken}")
        if expected:
            row("correctness", taken == [expected], f"{label}: took the {expected} path", f"took {taken}")
    bad = os.path.join(tmp, "misaligned.safetensors")
    expected = misaligned_file(bad)
    got = fastsafetensors_rs.load_file(bad, device="cuda")
    row("correctness", all(same(got[k], v) for k, v in expected.items()), "misaligned tensors bit-exact")
    row("correctness", all(got[k].data_ptr() % got[k].element_size() == 0 for k in got), "misaligned tensors realigned")
    got = fastsafetensors_rs.load_file(path, device="cuda", dtype=torch.float16)
    # Random bytes viewed as float32 hold NaNs, whose payloads a cast need not keep: compare
    # values, NaN equal to NaN, and a finite tensor exactly.
    cast_ok = (got["t1"].dtype == torch.float16 and got["t1"].is_cuda
               and torch.equal(got["finite"].cpu(), ref["finite"].half())
               and torch.allclose(got["t1"].cpu().float(), ref["t1"].half().float(), rtol=0, atol=0, equal_nan=True))
    row("correctness", cast_ok, "dtype cast on the device")


def large_file(pattern: str) -> None:
    print("large file")
    size = os.path.getsize(pattern) / (1 << 30)
    for threads in (1, 16):
        result = run_child("pattern", pattern, env={"FASTSAFETENSORS_THREADS": str(threads)})
        if "error" in result:
            row("large file", False, f"{size:.1f} GiB pattern, {threads} I/O thread(s)", result["error"])
            continue
        for label, r in result.items():
            if label == "output":
                continue
            ok = r["exact"] and r["taken"] == [r["expected"]]
            row("large file", ok, f"{size:.1f} GiB pattern, {threads} I/O thread(s), {label}: bit-exact",
                f"path {r['taken']}, {size * (1 << 30) / r['seconds'] / 1e9:.2f} GB/s cold")


def sleep_cycles_per_second() -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / (time.perf_counter() - start)


def ordering_reuse(path: str, cycles: float) -> None:
    check = "a load into memory a queued kernel still writes"
    guarded("ordering", check)(ordering_reuse_on)(path, cycles, check)
    side = torch.cuda.Stream()
    check = "the same with another stream current (torch.cuda.stream)"
    with torch.cuda.stream(side):
        guarded("ordering", check)(ordering_reuse_on)(path, cycles, check)
    side.synchronize()


def ordering_reuse_on(path: str, cycles: float, check: str) -> None:
    """On torch's current stream, whichever it is: the allocator's pools are per stream."""
    tensors, _ = load(path, nogds=True)
    alloc = tensors["part0"].untyped_storage().nbytes()  # the file's whole buffer
    del tensors
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    stale = torch.empty(alloc, dtype=torch.uint8, device="cuda")
    address = stale.data_ptr()
    torch.cuda._sleep(int(cycles * 0.5))  # on torch's current stream: the fill waits
    stale.fill_(0xAB)
    del stale  # the block goes back to the cache with its kernels still queued
    tensors, taken = load(path, nogds=True)
    reused = tensors["part0"].untyped_storage().data_ptr() == address
    exact = pattern_exact(tensors)
    if not reused:
        row("ordering", False, check, "setup: the caching allocator did not hand the freed block back")
    else:
        row("ordering", exact, check + ": bit-exact", f"path {taken}")


@guarded("ordering", "a kernel running on another stream does not delay the load")
def ordering_unrelated(path: str, cycles: float) -> None:
    warm([path])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(cycles * 3))  # about 3 s
    start = time.perf_counter()
    tensors, _ = load(path, nogds=True)
    seconds = time.perf_counter() - start
    still_running = not side.query()
    exact = pattern_exact(tensors)
    side.synchronize()
    row("ordering", still_running and seconds < 2.5 and exact,
        "a kernel running on another stream does not delay the load",
        f"load took {seconds:.2f} s beside a 3 s kernel, which was {'still' if still_running else 'no longer'} running")


def libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def current_context() -> int:
    ctx = ctypes.c_void_p()
    libcuda().cuCtxGetCurrent(ctypes.byref(ctx))
    return ctx.value or 0


@guarded("devices", "a load to cuda:1 leaves the caller on cuda:0")
def devices_current(path: str) -> None:
    check = "set_device(0), load to cuda:1: current device, context and new tensors stay on 0"
    if gpus() < 2:
        row("devices", "needs 2 GPUs", check)
        return
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    before = current_context()
    tensors, _ = load(path, "cuda:1")
    where = {t.device.index for t in tensors.values()}
    after = current_context()
    fresh = torch.empty(1, device="cuda").device.index
    ok = torch.cuda.current_device() == 0 and fresh == 0 and after == before and where == {1} and pattern_exact(tensors)
    row("devices", ok, check, f"current {torch.cuda.current_device()}, new tensor on {fresh}, "
        f"context {'unchanged' if after == before else 'CHANGED'}, loaded to {sorted(where)}")


@guarded("devices", "a load of no files touches only the requested GPU")
def devices_no_files(path: str) -> None:
    check = 'current device 1: load([]) and load(file) to "cuda" leave GPU 0 without a context'
    if gpus() < 2:
        row("devices", "needs 2 GPUs", check)
        return
    r = run_child("no_files", path)
    if "error" in r:
        row("devices", False, check, r["error"])
        return
    row("devices", r["empty"] == 0 and r["on"] == [1] and not r["gpu0_context"], check,
        f"loaded to {r['on']}, GPU 0 context {'created' if r['gpu0_context'] else 'none'}")


def devices_threads(files: list, spread: int) -> None:
    check = f"{len(files)} threads loading different files at once to {spread} GPU(s)"
    if gpus() < spread:
        row("devices", f"needs {spread} GPUs", check)
        return
    results = [None] * len(files)

    def work(i: int) -> None:
        try:
            torch.cuda.set_device(0)
            tensors, _ = load(files[i], f"cuda:{i % spread}")
            results[i] = (pattern_exact(tensors) and {t.device.index for t in tensors.values()} == {i % spread}
                          and torch.cuda.current_device() == 0)
        except Exception as e:  # noqa: BLE001
            results[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(files))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row("devices", all(r is True for r in results), check, "" if all(r is True for r in results) else str(results))


@guarded("errors", "a file truncated mid-load")
def errors_truncated(tmp: str, pattern: str, small_pattern: str) -> None:
    target = os.path.join(tmp, "truncated.safetensors")
    r = run_child("truncate", target, pattern)
    report_truncation(r, "a file truncated mid-load")
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    check = "the same under compute-sanitizer memcheck: no errors"
    if not os.path.exists(sanitizer):
        row("errors", "compute-sanitizer not installed", check)
        return
    r = run_child("truncate", target, small_pattern, timeout=300,
                  prefix=(sanitizer, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "0"))
    summary = [ln for ln in r.get("output", "").splitlines() if "ERROR SUMMARY" in ln]
    clean = bool(summary) and summary[-1].split("ERROR SUMMARY:")[1].strip().startswith("0 ")
    report_truncation(r, "a file truncated mid-load, under compute-sanitizer")
    errors = [ln for ln in r.get("output", "").splitlines() if ln.startswith("========= ") and "Error" in ln][:3]
    row("errors", clean, check, (summary[-1] if summary else "no summary") + ("; " + " | ".join(errors) if errors else ""))


def report_truncation(r: dict, check: str) -> None:
    if "error" in r and "left" not in r:
        row("errors", False, check, r["error"])
        return
    # Truncated (a read came back short) or changed (the reads were done, the size check caught it).
    caught = bool(r["error"]) and ("truncated" in r["error"] or "changed" in r["error"])
    row("errors", caught, f"{check}: RuntimeError", r["error"] or "no error")
    row("errors", r["left"] == 0, f"{check}: memory back to baseline", f"{r['left']} bytes left")
    row("errors", r["next_ok"] and r["synced"], f"{check}: next load exact, synchronize() fine", f"path {r['taken']}")


@guarded("memory", "device memory accounting")
def memory_accounting(tmp: str) -> None:
    path = os.path.join(tmp, "mem.safetensors")
    save_file({f"w{i}": torch.empty(64 << 20, dtype=torch.uint8) for i in range(4)}, path)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tensors = fastsafetensors_rs.load_file(path, device="cuda")
    during = torch.cuda.memory_allocated()
    size = os.path.getsize(path)
    row("memory", during - before >= size, "memory_allocated counts the file's buffer",
        f"grew {(during - before) >> 20} MiB for a {size >> 20} MiB file")
    del tensors
    gc.collect()
    after = torch.cuda.memory_allocated()
    row("memory", after - before < (1 << 20), "memory_allocated back to baseline when the tensors die",
        f"{after - before} bytes left")


def allocator_size(nbytes: int) -> int:
    return (nbytes + 511) // 512 * 512


@guarded("memory", "with dtype=, memory held equals the returned tensors")
def memory_cast(tmp: str) -> None:
    files = []
    for i in range(2):
        f = os.path.join(tmp, f"cast-{i}.safetensors")
        save_file({f"w{i}": torch.randn(32 << 20), f"b{i}": torch.randn(4096), f"steps{i}": torch.arange(7)}, f)
        files.append(f)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    tensors, _ = load(files, dtype=torch.bfloat16)
    held = torch.cuda.memory_allocated() - before
    expected = sum(allocator_size(t.numel() * t.element_size()) for t in tensors.values())
    ref = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for f in files for k, v in st_load_file(f).items()}
    exact = all(same(tensors[k], ref[k]) for k in ref)
    # Within the caching allocator's rounding; a file buffer kept alive would be 128 MiB.
    row("memory", abs(held - expected) < (2 << 20) and exact,
        "fp32 files with an integer tensor, dtype=bfloat16: memory held = tensors",
        f"held {held} bytes, tensors {expected} bytes")


def fanout(tmp: str, pattern: str) -> None:
    """Shared loads over NCCL: a world of one, and two ranks where there are two GPUs."""
    result = run_child("fanout", pattern)
    ok = "error" not in result and result.get("whole") is True and result.get("cast+filter") is True
    row("fan-out", ok, "a world of one over NCCL: pieces staged to the GPU, all-gathered, bit-exact",
        result.get("error", ""))
    rates = result.get("rates", {})
    ok = "error" not in result and result.get("verified") is True and result.get("wrong") is True
    row("fan-out", ok, "verified over NCCL: bit-exact, a wrong digest refused naming the file",
        result.get("error", "") or ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    if gpus() < 2:
        row("fan-out", "one GPU", "2 ranks over NCCL on 2 GPUs")
        return
    result = run_child("fanout", pattern, prefix=(sys.executable, "-m", "torch.distributed.run",
                                                   "--nproc-per-node", "2", "--no-python"))
    ok = "error" not in result and result.get("whole") is True and result.get("cast+filter") is True
    row("fan-out", ok, "2 ranks over NCCL on 2 GPUs: each byte read once, bit-exact on rank 0",
        result.get("error", ""))


@guarded("remote", "remote to cuda")
def remote(tmp: str, pattern: str) -> None:
    """A URL loaded to the GPU: the HTTP range server of the remote-source tests, on this
    machine's loopback, serving the pattern file (the parts land in the pinned staging ring)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pathlib import Path

    from remote_servers import FileServer

    with FileServer(Path(pattern).parent) as server:
        url = f"{server.url}/{os.path.basename(pattern)}"
        torch.cuda.synchronize()
        start = time.perf_counter()
        tensors, paths = load([url])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        ok = paths == ["remote"] and all(t.is_cuda for t in tensors.values()) and pattern_exact(tensors)
        size = os.path.getsize(pattern)
        row("remote", ok, "http:// URL to cuda through the staging ring: bit-exact",
            f"read path {paths}, {size / seconds / 1e9:.2f} GB/s from a Python HTTP server on loopback")
        del tensors
        streamed = dict(fastsafetensors_rs.stream(url, device="cuda", max_memory="128M"))
        row("remote", pattern_exact(streamed), "http:// URL streamed to cuda (max_memory=128M): bit-exact")


@guarded("streaming", "streaming to cuda")
def streaming(tmp: str) -> None:
    """stream(..., device="cuda"), a filter, a dtype, and the device memory a stream holds: for
    a consumer that copies each tensor out and drops it, the groups copied ahead (within
    max_memory) and the group it holds."""
    path = os.path.join(tmp, "all.safetensors")
    if not os.path.exists(path):
        all_dtypes_file(path)
    ref = st_load_file(path)
    got = dict(fastsafetensors_rs.stream(path, device="cuda"))
    row("streaming", got.keys() == ref.keys() and all(same(got[k], ref[k]) and got[k].is_cuda for k in ref),
        "stream to cuda: all dtypes bit-exact")
    picked = dict(fastsafetensors_rs.stream(path, device="cuda", tensor_filter=["t1", "finite"],
                                            tensor_name_match_mode="exact", dtype=torch.float16))
    cast_ok = (sorted(picked) == ["finite", "t1"] and picked["finite"].dtype == torch.float16
               and torch.equal(picked["finite"].cpu(), ref["finite"].half()))
    row("streaming", cast_ok, "stream to cuda: exact filter and dtype cast")
    big = os.path.join(tmp, "stream-mem.safetensors")
    save_file({f"w{i:02d}": torch.full((16 << 20,), i, dtype=torch.uint8) for i in range(32)}, big)  # 512 MiB
    evict([big])
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dest = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    ok = True
    for name, t in fastsafetensors_rs.stream(big, device="cuda", max_memory="64M"):
        dest.copy_(t)
        ok = ok and int(dest[0]) == int(name[1:])
        del t
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - dest.nbytes
    # The groups copied ahead stay within max_memory (one beyond it at most), plus the group held.
    bound = (64 << 20) + 2 * (17 << 20)
    row("streaming", ok and peak <= bound, "stream to cuda: device memory within max_memory",
        f"peak {peak >> 20} MiB over the destination (bound {bound >> 20} MiB), max_memory=64M, 512 MiB file")


@guarded("staging", "pinned staging pool")
def staging(tmp: str) -> None:
    path = os.path.join(tmp, "small.safetensors")
    save_file({"w": torch.randn(256, 1024)}, path)
    warm([path])
    load(path, nogds=True)
    kept = ops.release_staging_buffers()
    none_left = ops.release_staging_buffers()
    row("staging", kept > 0 and none_left == 0, "staging buffers kept after a load, released on request",
        f"released {kept}, then {none_left}")

    def timed(release: bool) -> float:
        times = []
        for _ in range(20):
            if release:
                ops.release_staging_buffers()
            torch.cuda.synchronize()
            start = time.perf_counter()
            tensors, _ = load(path, nogds=True)
            times.append(time.perf_counter() - start)
            del tensors
        return statistics.median(times[1:]) * 1e3

    pooled, fresh = timed(False), timed(True)
    row("staging", pooled < fresh, "20 small loads: pooled staging faster than allocating it each time",
        f"median {pooled:.2f} ms pooled, {fresh:.2f} ms re-allocating")


def nvfs_read_mib() -> tuple:
    """(reads ok, read MiB, read errors) from the nvidia-fs counters."""
    with open(NVFS_STATS) as f:
        for line in f:
            if line.strip().startswith("Reads"):
                fields = dict(kv.split("=") for kv in line.split(":", 1)[1].replace(",", " ").split() if "=" in kv)
                return int(fields.get("ok", 0)), int(fields.get("MiB", fields.get("readMiB", 0))), int(fields.get("err", 0))
    return 0, 0, 0


@guarded("GDS", "GPUDirect Storage")
def gds(tmp: str, pattern: str) -> None:
    check = 'nogds=False where cuFile runs in compatibility mode: refused or "gds-compat", never "gds"'
    if nvidia_fs():
        row("GDS", "nvidia-fs loaded: compatibility mode not expected", check)
    else:
        r = run_child("gds_compat", pattern, timeout=180)
        if "error" in r:
            row("GDS", False, check, r["error"])
        elif "refused" in r:
            row("GDS", True, check, f"refused: {r['refused']}")
        else:
            row("GDS", r["taken"] == ["gds-compat"] and r["exact"], check, f"path {r['taken']}, exact {r['exact']}")
    for device in range(2):
        check = f"> 512 MiB file into a fragmented allocator on cuda:{device}: bit-exact, nvidia-fs counted the reads"
        if not nvidia_fs():
            row("GDS", "nvidia-fs not loaded", check)
            continue
        if device >= gpus():
            row("GDS", "needs 2 GPUs", check)
            continue
        odd = [torch.empty((k * 7919 + 1) * 512, dtype=torch.uint8, device=f"cuda:{device}") for k in range(64)]
        del odd[::2]
        reads, mib, errs = nvfs_read_mib()
        tensors, taken = load(pattern, f"cuda:{device}", nogds=False)
        reads2, mib2, errs2 = nvfs_read_mib()
        exact = pattern_exact(tensors)
        size_mib = os.path.getsize(pattern) >> 20
        row("GDS", exact and taken == ["gds"] and mib2 - mib >= size_mib - 1 and errs2 == errs, check,
            f"path {taken}, nvidia-fs read {mib2 - mib} MiB in {reads2 - reads} reads, {errs2 - errs} errors")
        del tensors, odd


# ---------------------------------------------------------------- throughput


def timed(fn, files, cold: bool, runs: int):
    times, out = [], None
    for _ in range(runs):
        out = None
        gc.collect()
        (evict if cold else warm)(files)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def safetensors_to_cuda(files):
    out = {}
    for f in files:
        with st_safe_open(f, framework="pt", device="cuda") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def dd_bandwidth(files) -> float:
    evict(files)
    start = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    return sum(map(os.path.getsize, files)) / (time.perf_counter() - start)


def h2d_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start)


@guarded("throughput", "throughput")
def throughput(tmp: str, size_gb: float, runs: int) -> None:
    print(f"throughput ({size_gb} GB in 4 files, median of {runs})")
    per_file = int(size_gb * 1e9 / 4)
    files = []
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        f = os.path.join(tmp, f"bench-{i}.safetensors")
        rows = per_file // (4096 * 2) // 8
        save_file({f"layer{i}.w{j}": torch.randint(-30000, 30000, (rows, 4096), dtype=torch.int16, generator=gen)
                   .view(torch.bfloat16) for j in range(8)}, f)
        files.append(f)
    nbytes = sum(map(os.path.getsize, files))
    loaders = {label: (lambda kw=kw: load(files, **kw)[0]) for label, kw, _ in STAGED}
    loaders["auto"] = lambda: load(files)[0]
    if nvidia_fs():
        loaders["gds"] = lambda: load(files, nogds=False)[0]
    loaders["safetensors"] = lambda: safetensors_to_cuda(files)
    reference = safetensors_to_cuda(files)
    results = {}
    for name, fn in loaders.items():
        for temp in ("cold", "warm"):
            seconds, out = timed(fn, files, temp == "cold", runs)
            results[(name, temp)] = nbytes / seconds / 1e9
            if temp == "warm" and name != "safetensors":
                row("throughput", out.keys() == reference.keys() and all(same(out[k], reference[k]) for k in reference),
                    f"{name}: benchmark output identical to safetensors'")
            del out
    del reference
    disk, h2d = dd_bandwidth(files) / 1e9, h2d_bandwidth(1 << 30) / 1e9
    print(f"  limits: disk (dd iflag=direct) {disk:.2f} GB/s, pinned host->device {h2d:.2f} GB/s")
    print(f"  {'loader':<18}{'cold GB/s':>10}{'warm GB/s':>10}{'cold/limit':>11}{'warm/h2d':>9}{'cold/st':>8}{'warm/st':>8}")
    for name in loaders:
        c, w = results[(name, "cold")], results[(name, "warm")]
        print(f"  {name:<18}{c:>10.2f}{w:>10.2f}{c / min(disk, h2d):>11.2f}{w / h2d:>9.2f}"
              f"{c / results[('safetensors', 'cold')]:>8.2f}{w / results[('safetensors', 'warm')]:>8.2f}")
    staged_cold, staged_warm = results[("staged-direct", "cold")], results[("staged-buffered", "warm")]
    print(f"  target staged cold >= 0.9 x min(disk, h2d): {'PASS' if staged_cold >= 0.9 * min(disk, h2d) else 'MISS'}")
    print(f"  target staged warm >= 0.8 x h2d: {'PASS' if staged_warm >= 0.8 * h2d else 'MISS'}")
    best = max(results[(n, 'cold')] for n in loaders if n != "safetensors")
    print(f"  target >= 4.8 x safetensors (cold): {'PASS' if best >= 4.8 * results[('safetensors', 'cold')] else 'MISS'}")


def keep(tmp: str, pattern: str) -> None:
    """keep=True to the GPU, each load in a process of its own, with a keeper of this check's."""
    import signal

    from fastsafetensors_rs import keep as kept
    keep_dir = tempfile.mkdtemp(prefix="fstk-gpu-", dir="/tmp")
    env = {"FASTSAFETENSORS_KEEP_DIR": os.path.join(keep_dir, "k")}
    os.environ.update(env)
    try:
        expected = int(sum(as_bytes(t).sum(dtype=torch.int64).item() for t in st_load_file(pattern).values()))
        first = run_child("keep", pattern, env=env)
        second = run_child("keep", pattern, env=env)
        ok = "error" not in first and "error" not in second
        row("keep", ok and "kept" not in first["taken"] and first["sum"] == expected,
            "the first kept load reads and fills device memory", first.get("error", f"{first.get('taken')}"))
        row("keep", ok and second["taken"] == ["kept"] and second["sum"] == expected,
            "a second process attaches: bytes equal, nothing read",
            second.get("error") or f"attach {second['seconds'] * 1e3:.1f} ms, fill {first['seconds'] * 1e3:.1f} ms; "
            f"torch.cuda.memory_allocated() {second['torch_allocated']} bytes (kept memory is not torch's)")
        wrote = run_child("keep", pattern, "write", env=env)
        row("keep", "error" not in wrote and wrote.get("write", "").startswith("failed"),
            "an in-place write into an attached tensor fails (read-only) in its own process",
            wrote.get("error") or wrote.get("write", ""))
        # Attached here, then the keeper killed: these tensors stay valid.
        names, tensors, taken = ops.load_kept([pattern], "cuda")
        pid = kept.status()["pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        torch.cuda.synchronize()
        held = int(sum(as_bytes(t).sum(dtype=torch.int64).item() for t in tensors))
        again = run_child("keep", pattern, env=env)
        row("keep", list(taken) == ["kept"] and held == expected and "error" not in again
            and "kept" not in again["taken"] and again["sum"] == expected,
            "the keeper killed with a client attached: its tensors stay valid; the next load reads again",
            again.get("error", ""))
        del tensors
    finally:
        kept.stop()
        shutil.rmtree(keep_dir, ignore_errors=True)


def print_table() -> None:
    width = max(len(r[2]) for r in ROWS)
    print("\n" + "=" * (width + 40))
    print(f"{'section':<12}{'status':<9}{'check':<{width}}  detail")
    print("-" * (width + 40))
    for section, status, check, detail in ROWS:
        print(f"{section:<12}{status:<9}{check:<{width}}  {detail}")
    counts = {s: sum(1 for r in ROWS if r[1] == s) for s in ("PASS", "FAIL", "NOT RUN")}
    print("-" * (width + 40))
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['NOT RUN']} not run")


def saving(tmp: str, cycles: float, size_gb: float) -> None:
    """save_file / save from CUDA tensors: the bytes safetensors writes for the same tensors on
    the CPU, copies ordered after the kernels still writing them, mixed devices, and the rate
    (until durable) beside the same save from host tensors."""
    path = os.path.join(tmp, "all.safetensors")
    if not os.path.exists(path):
        all_dtypes_file(path)
    ref = st_load_file(path)
    on_gpu = {k: v.cuda() for k, v in ref.items()}
    on_gpu["transposed"] = torch.randn(64, 48, device="cuda").t()
    cpu_copy = {k: v.cpu().contiguous() for k, v in on_gpu.items()}
    ours, stock = os.path.join(tmp, "saved-gpu.safetensors"), os.path.join(tmp, "saved-cpu.safetensors")
    fastsafetensors_rs.save_file(on_gpu, ours, metadata={"format": "pt"})
    save_file(cpu_copy, stock, metadata={"format": "pt"})
    row("saving", open(ours, "rb").read() == open(stock, "rb").read(),
        "save_file of CUDA tensors (all dtypes, non-contiguous): the bytes safetensors writes from the CPU")
    # A tensor a queued kernel is still writing: the save's copies must come after it.
    late = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(int(cycles * 0.5))
    late.fill_(0x5A)
    fastsafetensors_rs.save_file({"late": late}, ours)
    got = st_load_file(ours)["late"]
    row("saving", bool((got == 0x5A).all()), "save_file after a queued kernel: its bytes, not the ones before")
    mixed = {"gpu": torch.arange(1000, device="cuda"), "cpu": torch.arange(7)}
    fastsafetensors_rs.save_file(mixed, ours)
    back = st_load_file(ours)
    row("saving", torch.equal(back["gpu"], mixed["gpu"].cpu()) and torch.equal(back["cpu"], mixed["cpu"]),
        "save_file of CUDA and CPU tensors together")
    # Rate: a Llama-shaped checkpoint in 4 shards, from the device and from host memory.
    per = int(size_gb * 1e9 / 32)
    host = {f"layer{i}.w": torch.randint(-30000, 30000, (per // 2,), dtype=torch.int16).view(torch.bfloat16)
            for i in range(32)}
    device = {k: v.cuda() for k, v in host.items()}
    nbytes = sum(t.nbytes for t in host.values())
    rates = {}
    for label, tensors in (("cuda", device), ("cpu", host)):
        out = os.path.join(tmp, f"saved-{label}")
        times = []
        for _ in range(3):
            shutil.rmtree(out, ignore_errors=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            fastsafetensors_rs.save(tensors, out, max_shard_size=nbytes // 4 + 1)
            times.append(time.perf_counter() - start)
        rates[label] = nbytes / statistics.median(times) / 1e9
    loaded = fastsafetensors_rs.load(os.path.join(tmp, "saved-cuda"))
    row("saving", all(torch.equal(loaded[k], host[k]) for k in host),
        "save of a checkpoint from CUDA tensors loads back bit-exact",
        f"{nbytes / 1e9:.1f} GB in 4 shards, durable: from cuda {rates['cuda']:.2f} GB/s, "
        f"from host memory {rates['cpu']:.2f} GB/s (median of 3)")
    shutil.rmtree(os.path.join(tmp, "saved-cuda"), ignore_errors=True)
    shutil.rmtree(os.path.join(tmp, "saved-cpu"), ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size for the throughput table")
    parser.add_argument("--pattern-gib", type=float, default=1.0, help="size of the large pattern file")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to write test files (default: a temp dir on disk)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = CHILDREN[args.child[0]](*args.child[1:])
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to validate (run this on a GPU machine)")
        return 0
    started = time.perf_counter()
    built = json.loads(open(os.path.join(os.path.dirname(fastsafetensors_rs.__file__), "_build_info.json")).read())
    print(f"device: {torch.cuda.get_device_name()} x {gpus()}, torch {torch.__version__}, "
          f"GDS (nvidia-fs): {nvidia_fs()}, library: {built.get('abi', 'torch')} ABI, built against torch "
          f"{built['torch']}")
    with tempfile.TemporaryDirectory(dir=args.dir or os.getcwd()) as tmp:
        guarded("correctness", "correctness")(correctness)(tmp)
        pattern = os.path.join(tmp, "pattern.safetensors")
        pattern_file(pattern, args.pattern_gib)
        small_pattern = os.path.join(tmp, "pattern-small.safetensors")
        pattern_file(small_pattern, 0.25)
        guarded("large file", "large file")(large_file)(pattern)
        print("ordering")
        cycles = sleep_cycles_per_second()
        ordering_reuse(small_pattern, cycles)
        ordering_unrelated(small_pattern, cycles)
        print("devices")
        devices_current(small_pattern)
        devices_no_files(small_pattern)
        copies = []
        for i in range(4):
            copies.append(os.path.join(tmp, f"thread-{i}.safetensors"))
            shutil.copyfile(small_pattern, copies[-1])
        guarded("devices", "threads on one GPU")(devices_threads)(copies, 1)
        guarded("devices", "threads on two GPUs")(devices_threads)(copies, 2)
        print("errors")
        errors_truncated(tmp, pattern, small_pattern)
        print("memory")
        memory_accounting(tmp)
        memory_cast(tmp)
        print("streaming")
        streaming(tmp)
        print("fan-out")
        guarded("fan-out", "fan-out")(fanout)(tmp, small_pattern)
        print("remote")
        remote(tmp, small_pattern)
        print("keep")
        guarded("keep", "keep")(keep)(tmp, small_pattern)
        print("staging")
        staging(tmp)
        print("GDS")
        gds(tmp, pattern)
        print("saving")
        guarded("saving", "saving")(saving)(tmp, cycles, args.size_gb)
        throughput(tmp, args.size_gb, args.runs)
    print_table()
    print(f"gpu-check took {time.perf_counter() - started:.0f} s")
    return 1 if any(r[1] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
