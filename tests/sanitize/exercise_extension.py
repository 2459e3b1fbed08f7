"""Drives the torch extension through its CPU paths, for a run under AddressSanitizer.

`make sanitize-cpp` builds the extension (csrc/ops.cpp and the Rust staticlib) with ASan
into target/asan-ext/ and runs this script with that build first on the path. Every op and
reader is exercised, with results checked against the reference `safetensors` package:
tensors that outlive the dict and the other tensors of their file, casts, slices, several
threads at once, and hostile files that must raise. A memory error aborts the process with
ASan's report; otherwise the script prints its tally and exits 0.
"""

import gc
import json
import os
import struct
import sys
import tempfile
import threading

import torch
from safetensors.torch import load_file as reference_load_file
from safetensors.torch import save_file

import fastsafetensors_rs
from fastsafetensors_rs import load, load_file, ops, safe_open

passed = 0
failed = []


def check(name, fn):
    global passed
    try:
        fn()
        passed += 1
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the run fails
        failed.append(f"{name}: {type(e).__name__}: {e}")


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        f"m{seed}.weight": torch.randn(64, 33, generator=g),
        f"m{seed}.bias": torch.randn(33, generator=g).to(torch.bfloat16),
        f"m{seed}.ids": torch.randint(-(2**40), 2**40, (17,), generator=g),
        f"m{seed}.mask": torch.rand(5, 3, generator=g) > 0.5,
        f"m{seed}.half": torch.randn(3, 7, generator=g).half(),
        f"m{seed}.empty": torch.zeros(0, 4),
        f"m{seed}.scalar": torch.tensor(3.5, dtype=torch.float64),
        f"m{seed}.f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
    }


def as_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(got, want):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(as_bytes(got[k]), as_bytes(v)), k


def file_bytes(header, data=b""):
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def raises(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - any clean exception is the expected outcome
        return
    raise AssertionError("no exception")


def main():
    print(f"fastsafetensors_rs extension: {fastsafetensors_rs.LIBRARY_PATH}")
    with tempfile.TemporaryDirectory() as d:
        files = []
        for i in range(3):
            path = os.path.join(d, f"model-{i}.safetensors")
            save_file(tensors(i), path, metadata={"format": "pt", "index": str(i)})
            files.append(path)
        want = {}
        for path in files:
            want.update(reference_load_file(path))

        for reader in ("auto", "mmap", "direct"):
            check(f"load {reader}", lambda r=reader: same(load(files, reader=r), want))
            check(f"op load {reader}", lambda r=reader: same(dict(zip(*ops.load(files, "cpu", None, r, None))), want))
        check("load_file", lambda: same(load_file(files[0]), reference_load_file(files[0])))

        def survivors():
            # One tensor keeps its file's buffer alive after everything else is gone.
            loaded = load(files, reader="direct")
            keep = loaded["m1.weight"]
            del loaded
            gc.collect()
            _ = [load(files) for _ in range(3)]
            assert torch.equal(keep, want["m1.weight"])
            keep.fill_(7)  # writable, and private: the file keeps its bytes
            assert bool((keep == 7).all())
            same(load(files, reader="mmap"), want)

        check("tensor outlives its dict", survivors)

        def cast():
            got = load(files, dtype=torch.float16)
            assert got["m0.weight"].dtype == torch.float16
            assert torch.equal(got["m0.weight"], want["m0.weight"].half())
            assert got["m0.ids"].dtype == torch.int64

        check("dtype cast", cast)

        def header_ops():
            names, dtypes, shapes, meta_keys, meta_values = ops.describe(files[2])
            assert sorted(names) == sorted(tensors(2)) and dict(zip(meta_keys, meta_values))["index"] == "2"
            assert ops.keys(files[2]) == sorted(tensors(2))
            assert dict(zip(*ops.metadata(files[0])))["format"] == "pt"

        check("keys, metadata, describe", header_ops)

        def handle():
            with safe_open(files[1], framework="pt") as f:
                for k in f.keys():
                    assert torch.equal(as_bytes(f.get_tensor(k)), as_bytes(want[k])), k
                assert torch.equal(f.get_slice("m1.weight")[2:5, ::3], want["m1.weight"][2:5, ::3])

        check("safe_open", handle)

        def threads():
            errors = []

            def work(n):
                try:
                    for _ in range(5):
                        same(load(files[n % 3 :] + files[: n % 3], reader=("mmap", "direct")[n % 2]), want)
                except Exception as e:  # noqa: BLE001 - collected and re-raised below
                    errors.append(e)

            workers = [threading.Thread(target=work, args=(n,)) for n in range(6)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            assert not errors, errors

        check("six threads", threads)

        good = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        hostile = {
            "empty": b"",
            "header past end": struct.pack("<Q", 1 << 20) + b"{}",
            "not utf-8": file_bytes(b'{"\xff":1}'),
            "overlap": file_bytes({"a": good, "b": {**good, "data_offsets": [4, 12]}}, bytes(12)),
            "out of bounds": file_bytes({"a": {**good, "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}, bytes(8)),
            "shape overflow": file_bytes({"a": {**good, "shape": [1 << 32, 1 << 32]}}, bytes(8)),
            "truncated data": file_bytes({"a": good}, bytes(5)),
            "deep json": file_bytes(b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"),
        }
        for name, content in hostile.items():
            path = os.path.join(d, name.replace(" ", "-") + ".safetensors")
            with open(path, "wb") as f:
                f.write(content)
            for reader in ("mmap", "direct"):
                check(f"hostile {name} ({reader})", lambda p=path, r=reader: raises(lambda: load([files[0], p], reader=r)))
            check(f"hostile {name} (describe)", lambda p=path: raises(lambda: ops.describe(p)))
        check("directory", lambda: raises(lambda: load([d])))
        check("missing file", lambda: raises(lambda: load([os.path.join(d, "missing")])))
        check("duplicate across files", lambda: raises(lambda: load([files[0], files[0]])))

    for line in failed:
        print("FAILED", line)
    print(f"{passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
