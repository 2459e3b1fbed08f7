"""The receive path of remote loads: whatever the part size, the number of GETs in flight and
where the server's writes end, every byte of the file is asked for once, after the first GET,
and lands in its place (bit-exact against the local file), for whole loads, filtered loads
whose extents end on 1-byte tensors, and streams."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs as fst
import fst_testutils as U
from remote_servers import FileServer

REMOTE_ENV = ("FASTSAFETENSORS_REMOTE_PART_SIZE", "FASTSAFETENSORS_REMOTE_CONCURRENCY",
              "FASTSAFETENSORS_REMOTE_TIMEOUT", "FASTSAFETENSORS_REMOTE_RETRIES")
FIRST_GET = 1 << 20  # the bytes an object's opening GET asks for


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 3 MB file whose tensors have sizes that divide no part size: 1-byte tensors between
    the others and one at the very end of the file, odd lengths around them."""
    root = tmp_path_factory.mktemp("receive")
    g = torch.Generator().manual_seed(11)
    tensors = {
        "a_first": torch.tensor([7], dtype=torch.uint8),
        "b": torch.randn(300_007, generator=g),                      # 1,200,028 bytes
        "c_middle": torch.tensor([201], dtype=torch.uint8),
        "d": torch.randint(0, 255, (1_000_003,), generator=g, dtype=torch.uint8),
        "e": torch.randn(300_001, generator=g).to(torch.bfloat16),   # 600,002 bytes
        "f_last": torch.tensor([99], dtype=torch.uint8),
    }
    # Laid out by dtype (widest first), then name: b, e, a_first, c_middle, d, f_last.
    U.write_checkpoint(root / "model.safetensors", tensors)
    return root, st_load_file(str(root / "model.safetensors"))


@pytest.fixture
def server(served):
    with FileServer(served[0]) as s:
        # Writes of 1 byte, a few bytes, a page less one, a part and one: reads end anywhere.
        s.write_sizes = [1, 7, 4093, 65537, 3]
        yield s


def _data_gets(server) -> list:
    """The ranges of the GETs after each opening one, as (start, end) with end exclusive."""
    out = []
    for method, _path, rng in server.requests:
        if method == "GET" and rng and not rng.startswith("bytes=0-"):
            a, b = rng.removeprefix("bytes=").split("-")
            out.append((int(a), int(b) + 1))
    return sorted(out)


@pytest.mark.parametrize("part,concurrency", [("64K", "1"), ("100K", "3"), ("1M", None), ("192K", "64")])
def test_every_byte_is_asked_for_once_and_lands_in_place(served, server, monkeypatch, part, concurrency):
    root, ref = served
    for k in REMOTE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", part)
    if concurrency:
        monkeypatch.setenv("FASTSAFETENSORS_REMOTE_CONCURRENCY", concurrency)
    url = f"{server.url}/model.safetensors"
    size = os.path.getsize(root / "model.safetensors")

    U.assert_same_dict(fst.load_file(url), ref)
    # The data past the first GET, in parts of the size set (the last one shorter), each once.
    gets = _data_gets(server)
    step = int(part[:-1]) << (10 if part.endswith("K") else 20)
    assert gets == [(a, min(a + step, size)) for a in range(FIRST_GET, size, step)], gets

    # A filtered load: extents that start and end on the 1-byte tensors, the file's last byte.
    picked = fst.load_file(url, tensor_filter=["c_middle", "f_last", "a_first", "e"])
    U.assert_same_dict(picked, {k: ref[k] for k in ("a_first", "c_middle", "e", "f_last")})

    # A stream within a budget smaller than the file, its tensors compared as they come.
    seen = {}
    for name, t in fst.stream(url, max_memory="2M"):
        seen[name] = t.clone()
    U.assert_same_dict(seen, ref)

