"""Shared helpers for the fastsafetensors test suite: checkpoint builders, byte-exact
comparison, page-cache control and subprocess runners."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent

# Every dtype torch can store through safetensors, with its on-disk name.
DTYPES: list[tuple[torch.dtype, str]] = [
    (torch.float64, "F64"),
    (torch.float32, "F32"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int64, "I64"),
    (torch.int32, "I32"),
    (torch.int16, "I16"),
    (torch.int8, "I8"),
    (torch.uint8, "U8"),
    (torch.uint16, "U16"),
    (torch.uint32, "U32"),
    (torch.uint64, "U64"),
    (torch.bool, "BOOL"),
    (torch.complex64, "C64"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    (torch.float8_e8m0fnu, "F8_E8M0"),
    (torch.float4_e2m1fn_x2, "F4"),
]
DTYPE_NAME = {dt: name for dt, name in DTYPES}
PACKED = {torch.float4_e2m1fn_x2}

READERS = ["auto", "direct", "mmap"]
READ_PATHS = {"mmap", "direct", "buffered"}
ENV_READER = "FASTSAFETENSORS_READER"


def dtype_id(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """A tensor of `dtype` and `shape` filled with random bytes (0/1 for bool).

    Random bytes exercise every bit pattern, NaN and inf encodings included; results are
    compared byte for byte, never by value."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def finite_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Normally distributed finite values of a floating or complex dtype."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(tuple(shape), generator=gen, dtype=dtype)
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * 4).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` in row-major order, as a 1-D uint8 tensor (works for scalars,
    empty tensors and dtypes without equality such as float8/float4)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert isinstance(actual, torch.Tensor), f"{name}: got {type(actual)!r}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.device.type == "cpu", f"{name}: device {actual.device}"
    assert torch.equal(as_bytes(actual), as_bytes(expected)), f"{name}: bytes differ"


def assert_same_dict(actual: dict, expected: dict) -> None:
    assert isinstance(actual, dict), f"got {type(actual)!r}"
    assert sorted(actual) == sorted(expected)
    for name, t in expected.items():
        assert_same_tensor(actual[name], t, name)


# The ops as dicts, for the tests that compare what they return: `load` gives names beside
# tensors, `load_with_report` those and how each file was read, `metadata` keys beside values
# (None for none): the schemas LibTorch's stable ABI can express (no Dict returns).
def op_load(*args, **kwargs) -> dict[str, torch.Tensor]:
    names, tensors = torch.ops.fastsafetensors.load(*args, **kwargs)
    return dict(zip(names, tensors))


def op_load_with_report(*args, **kwargs) -> tuple[dict[str, torch.Tensor], list[str]]:
    names, tensors, read_paths = torch.ops.fastsafetensors.load_with_report(*args, **kwargs)
    return dict(zip(names, tensors)), read_paths


def op_metadata(path) -> dict[str, str] | None:
    keys, values = torch.ops.fastsafetensors.metadata(str(path))
    return None if keys is None else dict(zip(keys, values))


def all_dtype_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor per dtype of a few shapes, plus zero-sized and scalar tensors."""
    out: dict[str, torch.Tensor] = {}
    for i, (dt, _) in enumerate(DTYPES):
        tag = dtype_id(dt)
        out[f"{tag}.matrix"] = random_tensor(dt, (5, 7), seed + i)
        out[f"{tag}.cube"] = random_tensor(dt, (2, 3, 4), seed + 100 + i)
        out[f"{tag}.empty"] = random_tensor(dt, (0,), seed)
        out[f"{tag}.empty2d"] = random_tensor(dt, (3, 0), seed)
        if dt not in PACKED:  # a packed pair of fp4 values has no scalar form
            out[f"{tag}.scalar"] = random_tensor(dt, (), seed + 200 + i)
    return out


def write_checkpoint(path, tensors: dict, metadata: dict | None = None) -> Path:
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    return path


def header_bytes(header) -> bytes:
    if isinstance(header, bytes):
        return header
    if isinstance(header, str):
        return header.encode()
    return json.dumps(header, separators=(",", ":")).encode()


def write_raw(path, header, data: bytes = b"", length: int | None = None) -> Path:
    """Writes `[u64 LE length][header][data]` exactly as given (no padding).

    `header` may be a dict (serialised compactly), str or bytes; `length` overrides the
    length prefix."""
    path = Path(path)
    hb = header_bytes(header)
    n = len(hb) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


def layout(entries, start: int = 0):
    """Builds a header dict and the data bytes from (name, tensor) pairs laid out
    back to back in the given order. Returns (header, data, offsets by name)."""
    header = {}
    chunks = []
    offsets = {}
    pos = start
    for name, t in entries:
        raw = as_bytes(t).numpy().tobytes()
        shape = list(t.shape)
        if t.dtype in PACKED:
            shape[-1] *= 2
        header[name] = {
            "dtype": DTYPE_NAME[t.dtype],
            "shape": shape,
            "data_offsets": [pos, pos + len(raw)],
        }
        offsets[name] = pos
        chunks.append(raw)
        pos += len(raw)
    return header, b"".join(chunks), offsets


# ---------------------------------------------------------------- page cache control

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path) -> float:
    """Fraction of the file's pages present in the page cache (mincore)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def make_cold(path) -> None:
    """Evicts the file from the page cache and checks that it worked."""
    for _ in range(3):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if resident_fraction(path) < 0.01:
            return
    raise AssertionError(f"could not evict {path}: {resident_fraction(path):.2%} resident")


def make_warm(path, minimum: float = 0.99) -> None:
    """Reads the whole file so (nearly) every page is in the page cache."""
    for _ in range(3):
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass
        frac = resident_fraction(path)
        if frac >= minimum:
            return
    raise AssertionError(f"{path} only {frac:.2%} resident after reading it")


def supports_o_direct(directory) -> bool:
    """Whether files in `directory` can be read with O_DIRECT."""
    probe = Path(directory) / ".o_direct_probe"
    probe.write_bytes(b"\0" * 8192)
    try:
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned
            return os.preadv(fd, [buf], 0) == 4096
        except OSError:
            return False
        finally:
            os.close(fd)
    finally:
        probe.unlink()


def expected_direct_path(directory) -> str:
    """The read path the "direct" reader must report for files in `directory`."""
    return "direct" if supports_o_direct(directory) else "buffered"


# ---------------------------------------------------------------- subprocesses

def _package_parent() -> str | None:
    spec = importlib.util.find_spec("fastsafetensors_rs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def subprocess_env(extra: dict | None = None, drop=(ENV_READER,)) -> dict:
    env = dict(os.environ)
    for k in drop:
        env.pop(k, None)
    paths = [str(HERE)]
    parent = _package_parent()
    if parent:
        paths.append(parent)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if extra:
        env.update(extra)
    return env


def run_python(code: str, *args, env: dict | None = None, timeout: float = 300,
               cwd=None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter; returns the completed process (text output)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=subprocess_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def check_output(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"subprocess exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


def exit_worker(status: int) -> None:
    """Ends a rank worker once its results are saved, without finalizing the interpreter:
    gloo's worker thread may still be letting go of the last collective's tensors (a barrier
    holds the all-gather before it), and a Python object released while the interpreter
    finalizes aborts the process (`ProcessGroupGloo::runLoop` -> `decref_pyobject` ->
    `take_gil` -> `pthread_exit` through a noexcept destructor: "terminate called without an
    active exception"), which would fail a rank that did everything right."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_rank_workers(worker: str, d: Path, mode: str, world: int, timeout: float, env_of=lambda rank: {}) -> list:
    """Runs `python WORKER MODE D RANK WORLD INIT_FILE` once per rank, joined in one gloo group
    (file:// rendezvous, loopback only); returns each rank's results, which the worker saves
    to `D/MODE.wWORLD.rankR.pt` (with an "error" entry if it failed). `env_of(rank)`: extra
    environment of that rank. A rank left waiting past `timeout` seconds fails them all."""
    init_file = Path(d) / f"init.{mode}.w{world}.{time.monotonic_ns()}"
    procs = [
        subprocess.Popen(
            [sys.executable, worker, mode, str(d), str(r), str(world), str(init_file)],
            env=subprocess_env({"GLOO_SOCKET_IFNAME": "lo", **env_of(r)}),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out = p.communicate()[0] + "\n[timed out: a rank was left waiting in a collective]"
        outputs.append(out)
    results = []
    for r, p in enumerate(procs):
        path = Path(d) / f"{mode}.w{world}.rank{r}.pt"
        got = torch.load(path, weights_only=False) if path.exists() else {}
        assert p.returncode == 0 and "error" not in got, (
            f"rank {r} of {world} failed (exit {p.returncode}):\n{got.get('error', '')}\n{outputs[r][-4000:]}"
        )
        results.append(got)
    return results


def vllm_weights_iterator(hf_weights_files):
    """The body of vLLM's (and SGLang's) fastsafetensors_weights_iterator, as they wrote it
    for fastsafetensors 0.5 but with the device made "cpu": the names it uses must exist."""
    from fastsafetensors_rs import SafeTensorsFileLoader, SingleGroup

    if torch.distributed.is_initialized():
        pg = torch.distributed.group.WORLD
    else:
        pg = SingleGroup()
    device = torch.device("cpu")
    weight_files_sub_lists = [
        hf_weights_files[i : i + pg.size()] for i in range(0, len(hf_weights_files), pg.size())
    ]
    for f_list in weight_files_sub_lists:
        loader = SafeTensorsFileLoader(pg, device)
        rank_file_map = {i: [f] for i, f in enumerate(f_list)}
        loader.add_filenames(rank_file_map)
        try:
            fb = loader.copy_files_to_device()
            try:
                keys = list(fb.key_to_rank_lidx.keys())
                for k in keys:
                    t = fb.get_tensor(k)
                    yield k, t
            finally:
                fb.close()
        finally:
            loader.close()
