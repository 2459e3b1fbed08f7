"""Servers on 127.0.0.1 for the remote-source tests: Garage (a real S3 server, built into
build/garage by `make garage`), an HTTP file server with range and If-Match support, and an
HTTP proxy that injects faults (503s, slow responses) between the loader and either of them,
and a TCP proxy that adds round-trip time and a bandwidth cap (DelayProxy). Nothing here reaches beyond the loopback interface.

`python remote_servers.py serve DIR PORT_FILE [DELAY_S]` runs the file server in its own
process (so that a test can kill it mid-transfer); it writes its port to PORT_FILE.
`python remote_servers.py proxy UPSTREAM_PORT RTT_MS PORT_FILE` runs a DelayProxy in its own
process (the bench's, so that its threads share no interpreter lock with the clients)."""

from __future__ import annotations

import base64
import datetime
import email.utils
import gzip
import hashlib
import hmac
import http.client
import os
import queue
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GARAGE_ENV = "FST_GARAGE"
REGION = "garage"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


# ------------------------------------------------------------------------------ HTTP files
class _FileHandler(BaseHTTPRequestHandler):
    """GET/HEAD of the files under the server's root with single byte ranges, an ETag per
    file version and Last-Modified (each can be left out), If-Match and If-Unmodified-Since;
    counts the body bytes it sends."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _file(self) -> Path | None:
        """The file the request names; with `?v=N` in its query, the file's version N (the
        file `NAME.vN` beside it) where there is one."""
        parts = urllib.parse.urlsplit(self.path)
        rel = urllib.parse.unquote(parts.path).lstrip("/")
        path = (self.server.root / rel).resolve()
        version = urllib.parse.parse_qs(parts.query).get("v")
        if version and path.with_name(f"{path.name}.v{version[0]}").is_file():
            path = path.with_name(f"{path.name}.v{version[0]}")
        if not path.is_relative_to(self.server.root) or not path.is_file():
            return None
        return path

    def _authorized(self) -> bool:
        """With a `secret`, only requests whose query carries `sig=<secret>` (as a presigned
        URL carries its signature) are served; with `basic_auth` (user, password), only those
        that carry them as HTTP Basic authorization."""
        if self.server.basic_auth is not None:
            token = base64.b64encode(":".join(self.server.basic_auth).encode()).decode()
            if self.headers.get("Authorization") != f"Basic {token}":
                return False
        if self.server.secret is None:
            return True
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        return query.get("sig") == [self.server.secret]

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _reply(self, status: int, headers: dict, body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self) -> str | None:
        """Where this request is sent on, if the server redirects it (see FileServer)."""
        srv = self.server
        host = self.headers.get("Host", "")
        if srv.redirect_hops:
            parts = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(parts.query)
            hop = int(query.get("hop", ["0"])[0])
            if hop < srv.redirect_hops:
                query["hop"] = [str(hop + 1)]
                return f"http://{host}{parts.path}?{urllib.parse.urlencode(query, doseq=True)}"
        if srv.redirect_to and (srv.redirect_host is None or host.rsplit(":", 1)[0] == srv.redirect_host):
            return srv.redirect_to + self.path
        return None

    def _serve(self, body: bool) -> None:
        self.server.requests.append((self.command, self.path, self.headers.get("Range")))
        self.server.headers_seen.append({k.title(): v for k, v in self.headers.items()})
        if not self._authorized():
            return self._reply(403, {}, b"<Error><Code>AccessDenied</Code></Error>")
        if self.server.redirect_bare:
            return self._reply(self.server.redirect_status, {}, b"moved")
        location = self._redirect()
        if location is not None:
            return self._reply(self.server.redirect_status, {"Location": location}, b"moved")
        path = self._file()
        if path is None:
            return self._reply(404, {}, b"not found")
        st = path.stat()
        etag = f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'
        common = {"Accept-Ranges": "bytes"}
        if self.server.etag:
            common["ETag"] = etag
        if self.server.last_modified:
            common["Last-Modified"] = self.date_time_string(int(st.st_mtime))
        if_match = None if self.server.ignore_conditions else self.headers.get("If-Match")
        if if_match is not None and if_match != "*" and etag not in [t.strip() for t in if_match.split(",")]:
            return self._reply(412, common, b"precondition failed")
        since = None if self.server.ignore_conditions else self.headers.get("If-Unmodified-Since")
        if since is not None and int(st.st_mtime) > email.utils.parsedate_to_datetime(since).timestamp():
            return self._reply(412, common, b"precondition failed")
        size = st.st_size
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng and not self.server.whole_body:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m:
                return self._reply(416, common)
            a, b = m.groups()
            if a == "":
                start, end = max(0, size - int(b)), size
            else:
                start, end = int(a), size if b == "" else min(size, int(b) + 1)
            if start >= size:
                return self._reply(416, {**common, "Content-Range": f"bytes */{size}"})
            status = 206
            if self.server.range_shift and start >= self.server.shift_from:
                start, end = min(start + self.server.range_shift, size - 1), min(end + self.server.range_shift, size)
            common["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if self.server.encoding == "gzip" and start >= self.server.encoding_from:
            with open(path, "rb") as f:
                f.seek(start)
                data = gzip.compress(f.read(end - start))
            return self._reply(status, {**common, "Content-Encoding": "gzip"}, data if body else b"")
        self.send_response(status)
        for k, v in common.items():
            self.send_header(k, v)
        lie = self.server.length_error if body else 0
        self.send_header("Content-Length", str(end - start + lie))
        if lie:
            # Says a wrong length, sends the real body, then hangs up (keeping the connection
            # would leave the client waiting for bytes that never come, or reading stray ones).
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if not body:
            return
        pieces = self.server.write_sizes
        if pieces:
            # Each piece its own segment, so that the client's reads end at odd places.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with open(path, "rb") as f:
            f.seek(start)
            left, k = end - start, 0
            while left:
                at = end - left
                chunk = f.read(min(left, pieces[k % len(pieces)] if pieces else 1 << 20))
                k += 1
                if not chunk:
                    break
                if self.server.lie_on_rereads:
                    chunk = self.server.reread(path, start, at, chunk)
                if self.server.delay and start >= self.server.delay_from:
                    time.sleep(self.server.delay)
                self.wfile.write(chunk)
                self.server.count(len(chunk))
                left -= len(chunk)


class _LoopbackServer(ThreadingHTTPServer):
    """A threaded HTTP server on 127.0.0.1, served from a background thread while in a `with`."""

    def __init__(self, port: int, handler):
        super().__init__(("127.0.0.1", port), handler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class FileServer(_LoopbackServer):
    """Serves `root` on 127.0.0.1 in a background thread. `sent` counts body bytes."""

    daemon_threads = True

    def __init__(self, root: Path, port: int = 0, delay: float = 0.0, etag: bool = True, last_modified: bool = True,
                 secret: str | None = None, basic_auth: tuple | None = None, encoding: str | None = None):
        super().__init__(port, _FileHandler)
        self.root = Path(root).resolve()
        self.delay = delay
        self.delay_from = 0  # answers for ranges starting before this byte are not delayed
        # Which validators the answers carry, and the signature a request's query must hold.
        self.etag, self.last_modified, self.secret, self.basic_auth = etag, last_modified, secret, basic_auth
        # "gzip": every answer's body compressed, with Content-Encoding, whatever was asked for
        # (from `encoding_from` on: answers for ranges starting before that byte are not).
        self.encoding = encoding
        self.encoding_from = 0
        # Redirects, as a Hugging Face `resolve/` URL or a CDN answers: every request (or those
        # whose Host header names `redirect_host`) is sent to `redirect_to` + its path with
        # `redirect_status`; with `redirect_hops` = N, each request first goes through a chain
        # of N redirects to this server itself (`?hop=1` ... `?hop=N`). `redirect_to` = own URL
        # is a loop.
        self.redirect_to: str | None = None
        self.redirect_host: str | None = None
        self.redirect_status = 302
        self.redirect_hops = 0
        self.redirect_bare = False  # redirects with no Location header
        # Broken servers: `whole_body` answers a Range request with 200 and the whole file (a
        # server that ignores Range); `length_error` = n says a Content-Length n bytes off the
        # body it sends (then closes the connection).
        self.whole_body = False
        self.length_error = 0
        # `range_shift` = n: a request for a range starting at or after `shift_from` is answered
        # with the bytes n further on, its Content-Range saying so truthfully (a cache keyed
        # wrongly, a proxy that miscounts).
        self.range_shift = 0
        self.shift_from = 0
        # A server (or a cache in front of it) that ignores If-Match and If-Unmodified-Since:
        # whatever version a request asks for, it answers with the file as it is now.
        self.ignore_conditions = False
        # Bodies written in pieces of these sizes in turn (each sent at once), not 1 MiB writes.
        self.write_sizes: list[int] = []
        # A server answering a second request for the same bytes differently: bytes already sent
        # for a request starting before this one's start come back with every bit flipped
        # (`lies` counts them).
        self.lie_on_rereads = False
        self.lies = 0
        self._sent_ranges: dict = {}  # path -> [(first byte, end, the request's start)]
        self.headers_seen: list = []  # every request's headers, as a dict (names Title-Cased)
        self.sent = 0
        self.requests: list = []
        self._lock = threading.Lock()

    def handle_error(self, request, client_address):
        # A client that hangs up mid-answer (a load that failed, a lying Content-Length) is
        # expected here: no traceback for it.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def count(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def reread(self, path, request_start: int, at: int, chunk: bytes) -> bytes:
        """`chunk`, file bytes from `at` on answering a request that starts at
        `request_start`, with the bytes an earlier-starting request was sent flipped."""
        with self._lock:
            sent = self._sent_ranges.setdefault(str(path), [])
            lie = bytearray(len(chunk))
            for a, b, first in sent:
                lo, hi = max(a, at), min(b, at + len(chunk))
                if first < request_start and lo < hi:
                    lie[lo - at:hi - at] = b"\xff" * (hi - lo)
            sent.append((at, at + len(chunk), request_start))
            lies = lie.count(0xFF)
            if not lies:
                return chunk
            self.lies += lies
            n = len(chunk)
            return (int.from_bytes(chunk, "little") ^ int.from_bytes(lie, "little")).to_bytes(n, "little")

    def reset(self) -> None:
        with self._lock:
            self.sent = 0
            self.requests.clear()
            self.headers_seen.clear()


# ------------------------------------------------------------------------------ fault proxy
class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _forward(self):
        p = self.server
        with p.lock:
            p.seen += 1
            fail = p.fail_next > 0
            if fail:
                p.fail_next -= 1
                p.failed += 1
                p.failed_at.append(time.monotonic())
        if fail:
            body = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(body)
            return
        if p.delay:
            time.sleep(p.delay)
        length = int(self.headers.get("Content-Length") or 0)
        payload = self.rfile.read(length) if length else None
        conn = http.client.HTTPConnection("127.0.0.1", p.upstream, timeout=60)
        # The Host header goes on as the client sent (and signed) it.
        headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
        conn.request(self.command, self.path, body=payload, headers=headers, encode_chunked=False)
        resp = conn.getresponse()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "keep-alive"):
                self.send_header(k, v)
        data = resp.read()
        if resp.getheader("Content-Length") is None:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class FaultProxy(_LoopbackServer):
    """An HTTP proxy on 127.0.0.1 to `upstream` (a port on 127.0.0.1) that answers the next
    `fail_next` requests with 503 SlowDown and holds each other request `delay` seconds."""

    daemon_threads = True

    def __init__(self, upstream: int):
        super().__init__(0, _ProxyHandler)
        self.upstream = upstream
        self.fail_next = 0
        self.failed = 0
        self.failed_at: list = []  # when each failed request came (time.monotonic())
        self.seen = 0
        self.delay = 0.0
        self.lock = threading.Lock()


# ------------------------------------------------------------------------------ delay proxy
class DelayProxy:
    """A TCP proxy on 127.0.0.1 to `upstream` (a port on 127.0.0.1) that adds round-trip time
    without netem (this kernel has none): every byte is forwarded `delay` seconds after it
    arrived, in each direction, so a request and its answer gain `2 * delay` (the RTT). Bytes
    keep their order; both directions run at once (full duplex); each connection has its own
    threads (one reader and one writer per direction), so connections never wait on each
    other. With `rate` (bytes/s), each direction of each connection is also paced to at most
    that many bytes a second.

    What it does not model: TCP's own acknowledgements and window still run at loopback speed
    between the client and the proxy, so it is as if the link had an unbounded window; a
    connection's setup (SYN, SYN-ACK) is not delayed, its first bytes are. A half-close (EOF)
    is forwarded after the same delay; a reset closes both sides.

        with DelayProxy(server_port, delay=0.04) as proxy:   # 80 ms RTT
            load(f"http://127.0.0.1:{proxy.port}/model.safetensors")

    `connections` counts the connections accepted; `forwarded` the bytes sent on, both ways."""

    CHUNK = 64 << 10

    def __init__(self, upstream: int, delay: float = 0.0, rate: float | None = None):
        self.upstream, self.delay, self.rate = upstream, delay, rate
        self.connections = 0
        self.forwarded = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._sockets: list = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True, name="delay-proxy-accept").start()
        return self

    def __exit__(self, *exc):
        self._stopped.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                chunks: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(src, chunks), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, src, chunks), daemon=True).start()

    def _read(self, src: socket.socket, chunks: queue.Queue) -> None:
        """Stamps each chunk with the time it may leave; None for the end of the stream."""
        while True:
            try:
                data = src.recv(self.CHUNK)
            except OSError:
                data = b""
            chunks.put((time.monotonic() + self.delay, data or None))
            if not data:
                return

    def _write(self, dst: socket.socket, src: socket.socket, chunks: queue.Queue) -> None:
        free_at = 0.0  # with a rate: when the paced link can take the next byte
        while True:
            due, data = chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if data is None:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                if self.rate:
                    # Slices of 1/100 s of the rate, each sent when the link is free again.
                    step = max(1, int(self.rate / 100))
                    for i in range(0, len(data), step):
                        piece = data[i:i + step]
                        now = time.monotonic()
                        if free_at > now:
                            time.sleep(free_at - now)
                        free_at = max(free_at, now) + len(piece) / self.rate
                        dst.sendall(piece)
                else:
                    dst.sendall(data)
            except OSError:
                for s in (src, dst):  # the other side is gone: end both
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self._lock:
                self.forwarded += len(data)


# ------------------------------------------------------------------------------ Garage
def garage_binary() -> Path | None:
    found = os.environ.get(GARAGE_ENV) or str(REPO / "build" / "garage" / "bin" / "garage")
    return Path(found) if Path(found).is_file() else shutil.which("garage") and Path(shutil.which("garage"))


class Garage:
    """A single-node Garage on 127.0.0.1 with its data under `root`: one key, buckets made on
    demand, objects put with a small SigV4 signer (no client library needed)."""

    def __init__(self, binary: Path, root: Path):
        self.binary, self.root = binary, Path(root)
        self.s3_port, self.rpc_port, self.admin_port = free_port(), free_port(), free_port()
        self.config = self.root / "garage.toml"
        self.config.write_text(f"""
metadata_dir = "{self.root}/meta"
data_dir = "{self.root}/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:{self.rpc_port}"
rpc_public_addr = "127.0.0.1:{self.rpc_port}"
rpc_secret = "{secrets.token_hex(32)}"

[s3_api]
s3_region = "{REGION}"
api_bind_addr = "127.0.0.1:{self.s3_port}"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:{self.admin_port}"
""")
        self.log = open(self.root / "garage.log", "wb")
        self.proc = subprocess.Popen([str(binary), "-c", str(self.config), "server"],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "RUST_LOG": "warn"})
        try:
            wait_for_port(self.rpc_port)
            node = self._node_id()
            self.cli("layout", "assign", "-z", "dc1", "-c", "1G", node)
            self.cli("layout", "apply", "--version", "1")
            self.key_id = "GK" + secrets.token_hex(12)
            self.secret = secrets.token_hex(32)
            self.cli("key", "import", "--yes", "-n", "fst-test", self.key_id, self.secret)
            wait_for_port(self.s3_port)
        except BaseException:
            self.stop()
            raise

    def cli(self, *args: str) -> str:
        proc = subprocess.run([str(self.binary), "-c", str(self.config), *args],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"garage {' '.join(args)} failed: {proc.stderr or proc.stdout}")
        return proc.stdout

    def _node_id(self) -> str:
        deadline = time.monotonic() + 30
        while True:
            try:
                out = self.cli("node", "id", "-q")
                return out.strip().split("@")[0]
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def bucket(self, name: str) -> None:
        self.cli("bucket", "create", name)
        self.cli("bucket", "allow", "--read", "--write", "--owner", name, "--key", self.key_id)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self, endpoint: str | None = None) -> dict:
        """What a client needs in its environment to reach this server."""
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_REGION": REGION, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def request(self, method: str, bucket: str, key: str, body: bytes = b"",
                extra: dict | None = None) -> http.client.HTTPResponse:
        """One signed (SigV4, unsigned payload) path-style request; `extra` headers unsigned."""
        path = "/" + urllib.parse.quote(f"{bucket}/{key}".rstrip("/"), safe="/-_.~")
        host = f"127.0.0.1:{self.s3_port}"
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": host, "x-amz-content-sha256": "UNSIGNED-PAYLOAD", "x-amz-date": amz_date}
        signed = ";".join(sorted(headers))
        canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "",
                               signed, "UNSIGNED-PAYLOAD"])
        scope = f"{day}/{REGION}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key_bytes = ("AWS4" + self.secret).encode()
        for part in (day, REGION, "s3", "aws4_request"):
            key_bytes = hmac.new(key_bytes, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key_bytes, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.key_id}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={signature}")
        conn = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=120)
        conn.request(method, path, body=body, headers={**headers, **(extra or {})})
        resp = conn.getresponse()
        resp.data = resp.read()
        conn.close()
        return resp

    def put(self, bucket: str, key: str, data: bytes) -> None:
        resp = self.request("PUT", bucket, key, data)
        if resp.status != 200:
            raise RuntimeError(f"PUT {bucket}/{key}: {resp.status} {resp.data[:300]!r}")

    def upload(self, bucket: str, prefix: str, directory: Path) -> None:
        for f in sorted(Path(directory).iterdir()):
            if f.is_file():
                self.put(bucket, f"{prefix}{f.name}", f.read_bytes())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _serve_main(argv: list[str]) -> None:
    root, port_file = Path(argv[0]), Path(argv[1])
    delay = float(argv[2]) if len(argv) > 2 else 0.0
    with FileServer(root, delay=delay) as server:
        port_file.write_text(str(server.server_address[1]))
        while True:
            time.sleep(3600)


def _proxy_main(argv: list[str]) -> None:
    upstream, rtt_ms, port_file = int(argv[0]), float(argv[1]), Path(argv[2])
    with DelayProxy(upstream, delay=rtt_ms / 2000) as proxy:
        port_file.write_text(str(proxy.port))
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _serve_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "proxy":
        _proxy_main(sys.argv[2:])
    else:
        sys.exit(__doc__)
