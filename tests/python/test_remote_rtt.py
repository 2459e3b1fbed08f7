"""Round-trip time without netem: the delaying TCP proxy (remote_servers.DelayProxy) adds the
RTT it is configured with (measured here, within 20%), caps a connection's rate, does not
serialize connections; and loads behind 80 ms of RTT, from the HTTP file server and from
Garage (S3: test_remote.py, beside its server), complete bit-exact within the loader's
timeout settings."""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time

import pytest
import torch

import fastsafetensors_rs as fst
import fst_testutils as U
from remote_servers import DelayProxy, FileServer

REMOTE_ENV = ("FASTSAFETENSORS_REMOTE_PART_SIZE", "FASTSAFETENSORS_REMOTE_CONCURRENCY",
              "FASTSAFETENSORS_REMOTE_TIMEOUT", "FASTSAFETENSORS_REMOTE_RETRIES")
ONE_WAY = 0.040  # s: 80 ms of RTT


class _Echo:
    """A TCP echo server on 127.0.0.1: every byte received is sent straight back."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def close(self):
        self.listener.close()


@pytest.fixture
def echo():
    server = _Echo()
    yield server
    server.close()


def _round_trips(port: int, n: int) -> list:
    """The time of each of `n` one-byte request/answer exchanges on one connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(n):
            start = time.monotonic()
            s.sendall(bytes([i % 256]))
            assert s.recv(1) == bytes([i % 256])
            times.append(time.monotonic() - start)
        return times


def test_the_proxy_adds_the_rtt_it_is_set_to(echo):
    direct = statistics.median(_round_trips(echo.port, 10))
    with DelayProxy(echo.port, delay=ONE_WAY) as proxy:
        rtts = _round_trips(proxy.port, 10)
    added = statistics.median(rtts) - direct
    assert abs(added - 2 * ONE_WAY) <= 0.2 * 2 * ONE_WAY, (added, rtts)
    assert min(rtts) >= 2 * ONE_WAY, rtts  # a byte never overtakes its delay


def test_the_proxy_keeps_order_runs_both_ways_at_once_and_connections_in_parallel(echo):
    payload = os.urandom(3 << 20)
    with DelayProxy(echo.port, delay=ONE_WAY) as proxy:
        # Four connections at once, each sending 3 MiB while reading its echo: about one RTT
        # each if they run in parallel and full duplex, not four in a row.
        got = [None] * 4

        def one(i):
            with socket.create_connection(("127.0.0.1", proxy.port)) as s:
                sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
                sender.start()
                chunks = []
                while data := s.recv(1 << 16):
                    chunks.append(data)
                sender.join()
                got[i] = b"".join(chunks)

        start = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        took = time.monotonic() - start
        assert proxy.connections == 4
    assert all(g == payload for g in got), "bytes lost or reordered through the proxy"
    assert 2 * ONE_WAY <= took < 4 * 2 * ONE_WAY + 1.0, took


def test_the_proxy_caps_the_rate(echo):
    rate = 4 << 20  # 4 MiB/s
    payload = os.urandom(1 << 20)
    with DelayProxy(echo.port, delay=0.0, rate=rate) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            start = time.monotonic()
            sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
            sender.start()
            received = 0
            while data := s.recv(1 << 16):
                received += len(data)
            took = time.monotonic() - start
            sender.join()
    assert received == len(payload)
    # Both directions are paced, one after the other by at most a slice: 1 MiB at 4 MiB/s.
    assert abs(took - len(payload) / rate) <= 0.2 * len(payload) / rate + 0.05, took


# ------------------------------------------------------------------------------ loads behind 80 ms
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple:
    """A 6 MiB checkpoint in several tensors: parts of 1 MiB make several GETs."""
    root = tmp_path_factory.mktemp("rtt")
    g = torch.Generator().manual_seed(80)
    tensors = {"a": torch.randn(512, 1024, generator=g),
               "b": torch.randn(1000, 1024, generator=g).to(torch.bfloat16),
               "c": torch.randint(0, 255, (1 << 20,), generator=g, dtype=torch.uint8)}
    U.write_checkpoint(root / "model.safetensors", tensors)
    return root, tensors


@pytest.fixture
def rtt_env(monkeypatch):
    """A client with timeouts that 80 ms of RTT must fit in: 5 s a request, 1 retry."""
    for k in list(os.environ):
        if k.startswith("AWS_") or k in REMOTE_ENV:
            monkeypatch.delenv(k)
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "1M")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "5")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "1")


def test_an_http_load_behind_80ms_completes_bit_exact(checkpoint, rtt_env):
    root, tensors = checkpoint
    with FileServer(root) as server, DelayProxy(server.server_address[1], delay=ONE_WAY) as proxy:
        start = time.monotonic()
        got = fst.load_file(f"{proxy.url}/model.safetensors")
        took = time.monotonic() - start
        gets = [r for r in server.requests if r[0] == "GET"]
    U.assert_same_dict(got, tensors)
    # The open, then the parts (in parallel): at least two round trips, each through the proxy.
    assert took >= 2 * 2 * ONE_WAY, took
    assert len(gets) >= 2 and proxy.forwarded >= (root / "model.safetensors").stat().st_size
