"""Redirects and broken answers from HTTP servers, as a Hugging Face `resolve/` URL and some
CDNs behave: 301/302/303/307/308 to another port or another host name are followed for ranged
GETs (at most 10), with Range and If-Match kept and the credentials left behind; a loop, too
many redirects, a `200` with the whole body for a Range request, a Content-Length that lies,
and a compressed answer each fail the load in one line naming the URL and the problem, soon,
never a wrong tensor."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
import torch

import fastsafetensors_rs as fst
import fst_testutils as U
from remote_servers import FileServer

REMOTE_ENV = ("FASTSAFETENSORS_REMOTE_PART_SIZE", "FASTSAFETENSORS_REMOTE_CONCURRENCY",
              "FASTSAFETENSORS_REMOTE_TIMEOUT", "FASTSAFETENSORS_REMOTE_RETRIES")
USER, PASSWORD = "user", "pa55-SECRET"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple:
    """A 1.6 MB checkpoint (larger than the first GET, so that parts follow it)."""
    root = tmp_path_factory.mktemp("redirects")
    g = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randn(300_000, generator=g), "b": torch.randn(100_000, generator=g).to(torch.bfloat16)}
    U.write_checkpoint(root / "model.safetensors", tensors)
    return root, tensors


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    """64 KiB parts (many ranged GETs), a short timeout and one retry: a failure is quick."""
    for k in REMOTE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "64K")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "5")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "1")


def _with_credentials(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@")


def _ranged_gets(server) -> list:
    return [h for h in server.headers_seen if "Range" in h]


def _fails_in_one_line(url: str, *words: str) -> str:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        fst.load_file(url)
    message = str(e.value)
    assert time.monotonic() - start < 10, "the failure took too long"
    assert message.startswith(url.split("?")[0].replace(f"{USER}:{PASSWORD}@", "") + ": "), message
    assert "\n" not in message and "Traceback" not in message and PASSWORD not in message, message
    for word in words:
        assert word in message, message
    return message


# ------------------------------------------------------------------------------ followed
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_host_and_port_is_followed_without_the_credentials(served, status):
    root, tensors = served
    with FileServer(root, basic_auth=(USER, PASSWORD)) as origin, FileServer(root) as target:
        target_port = target.server_address[1]
        origin.redirect_to, origin.redirect_status = f"http://localhost:{target_port}", status
        got = fst.load_file(_with_credentials(f"{origin.url}/model.safetensors"))
        U.assert_same_dict(got, tensors)
        # The origin checked the credentials of every request (it answers 403 without them) ...
        assert origin.headers_seen and all(h.get("Authorization") == BASIC for h in origin.headers_seen)
        # ... and the other host got none, but every ranged GET came with its Range, and each
        # after the first conditional on the version the first one saw.
        assert not any("Authorization" in h for h in target.headers_seen), target.headers_seen
        ranged = _ranged_gets(target)
        assert len(ranged) >= 3 and all(h["Host"] == f"localhost:{target_port}" for h in ranged)
        etag = next(h for h in ranged[1:] if "If-Match" in h)["If-Match"]
        assert all(h.get("If-Match") == etag for h in ranged[1:]), ranged


def test_a_redirect_to_another_host_name_on_the_same_port_leaves_the_credentials_behind(served):
    """127.0.0.1 and localhost are one server, but two hosts to the client."""
    root, tensors = served
    with FileServer(root) as server:
        port = server.server_address[1]
        server.redirect_to, server.redirect_host = f"http://localhost:{port}", "127.0.0.1"
        U.assert_same_dict(fst.load_file(_with_credentials(f"{server.url}/model.safetensors")), tensors)
        by_host = {}
        for h in server.headers_seen:
            by_host.setdefault(h["Host"], []).append(h.get("Authorization"))
    assert set(by_host) == {f"127.0.0.1:{port}", f"localhost:{port}"}, by_host
    assert set(by_host[f"127.0.0.1:{port}"]) == {BASIC}
    assert set(by_host[f"localhost:{port}"]) == {None}


def test_ten_redirects_on_the_same_host_are_followed_with_the_credentials(served):
    root, tensors = served
    with FileServer(root, basic_auth=(USER, PASSWORD)) as server:
        server.redirect_hops = 10
        U.assert_same_dict(fst.load_file(_with_credentials(f"{server.url}/model.safetensors")), tensors)
        hops = {h for (_, path, _) in server.requests for h in [path.partition("hop=")[2]]}
    assert hops == {"", *map(str, range(1, 11))}, hops


# ------------------------------------------------------------------------------ refused
def test_a_redirect_loop_fails_in_one_line(served):
    root, _ = served
    with FileServer(root) as server:
        server.redirect_to = server.url
        message = _fails_in_one_line(f"{server.url}/model.safetensors", "redirect")
        # Not retried: a loop stays a loop.
        assert len(server.requests) <= 11, len(server.requests)
    assert "more than 10" in message, message


def test_more_than_ten_redirects_fail_in_one_line(served):
    root, _ = served
    with FileServer(root) as server:
        server.redirect_hops = 11
        _fails_in_one_line(f"{server.url}/model.safetensors", "more than 10", "redirect")


def test_a_redirect_without_a_location_fails_in_one_line(served):
    root, _ = served
    with FileServer(root) as server:
        server.redirect_bare = True
        _fails_in_one_line(f"{server.url}/model.safetensors", "redirect", "Location")


def test_a_whole_body_for_a_range_request_is_refused_in_one_line(served):
    """A server that ignores Range (200 and the whole object) is never read as if its body
    were the part asked for."""
    root, _ = served
    with FileServer(root) as server:
        server.whole_body = True
        _fails_in_one_line(f"{server.url}/model.safetensors", "200", "Range")


def test_a_whole_body_on_a_later_part_is_refused_in_one_line(served):
    root, _ = served
    with FileServer(root) as server:
        U.assert_same_dict(fst.load_file(f"{server.url}/model.safetensors"), served[1])
        server.whole_body = True  # the same URL, opened again: the first GET already gets 200
        _fails_in_one_line(f"{server.url}/model.safetensors", "200", "Range")


@pytest.mark.parametrize("shift_from", [0, 1], ids=["first-get", "later-part"])
def test_an_answer_for_other_bytes_than_asked_is_refused_in_one_line(served, shift_from):
    """The server answers 206 for bytes 4 KiB further on than the range asked for, and says
    so in its Content-Range: on the first GET, or only on the parts after it. Those bytes are
    never put where the asked-for ones belong."""
    root, _ = served
    with FileServer(root) as server:
        server.range_shift, server.shift_from = 4096, shift_from
        _fails_in_one_line(f"{server.url}/model.safetensors", "other bytes than the range asked for")
        if shift_from:
            assert any(r[2] and not r[2].startswith("bytes=0-") for r in server.requests), server.requests


@pytest.mark.parametrize("error", [-1, -1000, +1, +1000])
def test_a_content_length_that_lies_fails_in_one_line(served, error):
    """Less than the range: the body ends early, cleanly, which no retry mends. More: the
    connection closes before the body is complete, a cut like any other, retried first."""
    root, _ = served
    with FileServer(root) as server:
        server.length_error = error
        words = ["Content-Length is shorter"] if error < 0 else ["end of file", "after 1 retries"]
        _fails_in_one_line(f"{server.url}/model.safetensors", *words)
        assert len([r for r in server.requests if r[0] == "GET"]) == (1 if error < 0 else 2), server.requests


def test_a_compressed_later_part_is_refused_in_one_line(served):
    """Only the answers after the first GET are compressed: each part is checked, not only
    the first."""
    root, _ = served
    with FileServer(root, encoding="gzip") as server:
        server.encoding_from = 1
        _fails_in_one_line(f"{server.url}/model.safetensors", "Content-Encoding: gzip")
        assert any(r[2] and not r[2].startswith("bytes=0-") for r in server.requests), server.requests
