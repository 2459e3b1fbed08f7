"""Concurrency, resource use across many loads, the host-memory cap, and files that change."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import fastsafetensors_rs


def write(path, seed: int, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    save_file({f"s{seed}.w{i}": torch.randn(256, 129, generator=gen).to(torch.bfloat16) for i in range(n)}, str(path))
    return str(path)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_many_threads_load_the_same_and_different_files(tmp_path):
    files = [write(tmp_path / f"{i}.safetensors", i) for i in range(4)]
    expected = {f: st_load_file(f) for f in files}
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    failures, errors_seen = [], []

    def worker(t: int):
        try:
            for round_ in range(15):
                reader = ("auto", "direct", "mmap")[(t + round_) % 3]
                if t == 0:  # one thread keeps failing; the others must not notice
                    with pytest.raises(RuntimeError, match="bad.safetensors"):
                        fastsafetensors_rs.load_file(bad, reader=reader)
                    errors_seen.append(round_)
                    continue
                f = files[(t + round_) % len(files)]
                if not same(fastsafetensors_rs.load_file(f, reader=reader), expected[f]):
                    failures.append((t, f, reader))
                both = fastsafetensors_rs.load(files[:2], reader=reader)
                if not same(both, {**expected[files[0]], **expected[files[1]]}):
                    failures.append((t, "pair", reader))
        except BaseException as e:  # surfaced below: a thread's exception is otherwise lost
            failures.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a load hung"
    assert failures == []
    assert len(errors_seen) == 15


def test_the_op_releases_the_gil(tmp_path):
    """A Python thread keeps running while another thread is inside a load."""
    f = write(tmp_path / "big.safetensors", 7, n=64)
    ticks, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            ticks[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        before = ticks[0]
        for _ in range(20):
            fastsafetensors_rs.load_file(f, reader="direct")
        during = ticks[0] - before
    finally:
        done.set()
        spinner.join()
    assert during > 1000, f"the spinning thread barely ran ({during} ticks) during the loads"


RESOURCE_SCRIPT = textwrap.dedent("""
    import gc, os, sys, psutil, torch, fastsafetensors_rs
    path = sys.argv[1]
    proc = psutil.Process()
    def snapshot():
        gc.collect()
        maps = sum(1 for _ in open("/proc/self/maps"))
        return dict(fds=len(os.listdir("/proc/self/fd")), threads=proc.num_threads(), maps=maps, rss=proc.memory_info().rss)
    def cycle(i):
        reader = ("auto", "direct", "mmap")[i % 3]
        t = fastsafetensors_rs.load_file(path, reader=reader)
        with fastsafetensors_rs.safe_open(path) as f:
            f.get_tensor(f.keys()[0])
        del t
    for i in range(30):
        cycle(i)
    before = snapshot()
    for i in range(1000):
        cycle(i)
    after = snapshot()
    print(before, after)
    assert after["fds"] == before["fds"], ("file descriptors leaked", before, after)
    assert after["threads"] == before["threads"], ("threads leaked", before, after)
    assert after["maps"] <= before["maps"] + 8, ("mappings leaked", before, after)
    assert after["rss"] - before["rss"] < 64 << 20, ("memory leaked", before, after)
""")


def test_no_leaks_across_a_thousand_loads(tmp_path):
    f = write(tmp_path / "r.safetensors", 3, n=8)
    done = subprocess.run([sys.executable, "-c", RESOURCE_SCRIPT, f], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_host_memory_cap(tmp_path, monkeypatch):
    f = write(tmp_path / "cap.safetensors", 5, n=16)  # ~1 MB
    monkeypatch.setenv("FASTSAFETENSORS_MAX_HOST_MEMORY", "64K")
    with pytest.raises(RuntimeError, match="host memory.*FASTSAFETENSORS_MAX_HOST_MEMORY"):
        fastsafetensors_rs.load_file(f, reader="direct")
    # Zero-copy mappings are page cache, not allocations: not capped.
    assert same(fastsafetensors_rs.load_file(f, reader="mmap"), st_load_file(f))
    monkeypatch.setenv("FASTSAFETENSORS_MAX_HOST_MEMORY", "16M")
    assert same(fastsafetensors_rs.load_file(f, reader="direct"), st_load_file(f))
    monkeypatch.setenv("FASTSAFETENSORS_MAX_HOST_MEMORY", "a lot")
    with pytest.raises(RuntimeError, match="FASTSAFETENSORS_MAX_HOST_MEMORY"):
        fastsafetensors_rs.load_file(f, reader="direct")


def test_a_load_beyond_available_memory_fails_cleanly(tmp_path):
    """A sparse file bigger than RAM with a valid header: refused before any allocation."""
    import json
    import struct

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = total * 2
    header = json.dumps({"huge": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + n)
    with pytest.raises(RuntimeError, match="host memory"):
        fastsafetensors_rs.load_file(path, reader="direct")


def test_safe_open_of_a_file_truncated_after_open_raises(tmp_path):
    f = write(tmp_path / "t.safetensors", 9)
    handle = fastsafetensors_rs.safe_open(f)
    os.truncate(f, 1000)
    with pytest.raises(RuntimeError, match="t.safetensors"):
        handle.get_tensor(handle.keys()[0])
