"""keep=True: weights kept by a keeper process between the processes that load them.

Each test has a keeper directory of its own (FASTSAFETENSORS_KEEP_DIR) and stops its keeper at
the end. Loads that must run in a fresh process (a restart, two servers at once, one killed)
run in subprocesses that print what they got.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import fst_testutils as U
import fastsafetensors_rs as fst
from fastsafetensors_rs import keep

F_GET_SEALS = 1034
F_SEAL_WRITE = 0x0008


@pytest.fixture
def keep_dir(monkeypatch):
    """A keeper directory of the test's own (a short path: socket addresses hold 107 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="fstk-", dir="/tmp"))
    directory = base / "k"
    monkeypatch.setenv("FASTSAFETENSORS_KEEP_DIR", str(directory))
    monkeypatch.setenv("FASTSAFETENSORS_KEEP_IDLE", "60")
    monkeypatch.delenv("FASTSAFETENSORS_KEEP_MEMORY", raising=False)
    yield directory
    found = keep.status()
    keep.stop()
    if found is not None:
        _wait_gone(found["pid"])
    shutil.rmtree(base, ignore_errors=True)


def _wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


def _kill_keeper() -> int:
    pid = keep.status()["pid"]
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    return pid


@pytest.fixture
def model(tmp_path):
    """A two-file checkpoint of a few MB; (directory, tensors)."""
    shards = [
        {"embed": U.random_tensor(torch.bfloat16, (512, 1024), 1), "norm": U.random_tensor(torch.float32, (1024,), 2)},
        {"lm_head": U.random_tensor(torch.bfloat16, (512, 1024), 3), "ids": U.random_tensor(torch.int64, (7,), 4),
         "empty": torch.zeros((0, 3), dtype=torch.float16)},
    ]
    d = tmp_path / "model"
    d.mkdir()
    for i, shard in enumerate(shards):
        U.write_checkpoint(d / f"model-0000{i + 1}-of-00002.safetensors", shard)
    return d, {k: v for shard in shards for k, v in shard.items()}


def _load_report(path, **kwargs):
    """A kept load through the op: (tensors, how each file was read)."""
    files = [str(p) for p in sorted(Path(path).glob("*.safetensors"))] if Path(path).is_dir() else [str(path)]
    names, tensors, read_paths = fst.ops.load_kept(files, "cpu", None, None, None, kwargs.get("tensor_filter"),
                                                   "glob", -1)
    return dict(zip(names, tensors)), read_paths


# A fresh process loading with keep=True: prints how each file was read, and a checksum of
# every tensor's bytes.
LOADER = """
    import json, sys, time, zlib
    import fastsafetensors_rs as fst
    files = sys.argv[1].split(",")
    start = time.perf_counter()
    names, tensors, read_paths = fst.ops.load_kept(files, "cpu", None, None, None, None, "glob", -1)
    took = time.perf_counter() - start
    sums = {n: zlib.crc32(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
            for n, t in zip(names, tensors)}
    print(json.dumps({"read_paths": read_paths, "sums": sums, "seconds": took}), flush=True)
    if len(sys.argv) > 2:  # hold the tensors until told to go
        sys.stdin.readline()
"""


def _crcs(tensors: dict) -> dict:
    import zlib
    return {n: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for n, t in tensors.items()}


def _files(d: Path) -> str:
    return ",".join(str(p) for p in sorted(d.glob("*.safetensors")))


def _run_loader(d: Path) -> dict:
    return json.loads(U.check_output(U.run_python(LOADER, _files(d), timeout=120)).splitlines()[-1])


def test_attach_is_bit_exact_and_reads_nothing(keep_dir, model):
    d, expected = model
    first, how = _load_report(d)
    assert "kept" not in how, how
    U.assert_same_dict(first, expected)
    # A restarted process: every file attached, the bytes the same.
    got = _run_loader(d)
    assert got["read_paths"] == ["kept", "kept"], got
    assert got["sums"] == _crcs(expected)
    # Through the Python API too (dtype casts run on the attached bytes).
    U.assert_same_dict(fst.load_file(d, keep=True), expected)
    cast = fst.load_file(d, keep=True, dtype=torch.float32)
    U.assert_same_tensor(cast["embed"], expected["embed"].float())
    [entry] = keep.entries()
    assert entry["attaches"] == 3 and entry["device"] == "cpu" and entry["verified"] is None, entry
    assert entry["files"] == [str(p.resolve()) for p in sorted(d.glob("*.safetensors"))]


def _open_files(pid: int) -> dict:
    """Process `pid`'s descriptors: /proc/PID/fd/N -> what it points to."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[f"/proc/{pid}/fd/{fd}"] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
    return out


def _keeper_memfds(pid: int) -> list:
    return [fd for fd, target in _open_files(pid).items() if target.startswith("/memfd:fastsafetensors-keep")]


def test_the_entry_cannot_be_written(keep_dir, model):
    d, _ = model
    fst.load_file(d, keep=True)
    [memfd] = _keeper_memfds(keep.status()["pid"])
    fd = os.open(memfd, os.O_RDWR)
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
        assert seals & F_SEAL_WRITE, seals
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 4096)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        # A private mapping works, and its writes stay private.
        m = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        before = m[8:16]
        m[8:16] = b"\xff" * 8
        again = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ)
        assert again[8:16] == before
    finally:
        os.close(fd)


def test_writes_into_attached_tensors_stay_private(keep_dir, model):
    d, expected = model
    a = fst.load_file(d, keep=True)
    b = fst.load_file(d, keep=True)
    assert a["embed"].data_ptr() != b["embed"].data_ptr()
    a["embed"].add_(1)  # weight post-processing writes in place
    b["norm"].zero_()
    assert not torch.equal(a["embed"], expected["embed"])
    U.assert_same_tensor(b["embed"], expected["embed"])
    U.assert_same_tensor(a["norm"], expected["norm"])
    # Another process sees the bytes as kept.
    got = _run_loader(d)
    assert got["read_paths"] == ["kept", "kept"] and got["sums"] == _crcs(expected)


def test_two_processes_at_once_read_once(keep_dir, model):
    d, expected = model
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOADER), _files(d)], env=U.subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    got = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    assert sorted(g["read_paths"] == ["kept", "kept"] for g in got) == [False, True], got
    assert all(g["sums"] == _crcs(expected) for g in got)
    [entry] = keep.entries()
    assert entry["attaches"] == 1, entry


def _socket_inodes(pid: int) -> set:
    """The inodes of the sockets process `pid` has open."""
    return {int(t[len("socket:["):-1]) for t in _open_files(pid).values() if t.startswith("socket:[")}


def _network_socket_inodes(pid: int) -> set:
    """The inodes of every TCP, UDP and raw socket in process `pid`'s network namespace."""
    found = set()
    for table in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        found.update(int(line.split()[9]) for line in lines)
    return found


def test_the_keeper_has_a_session_of_its_own_a_log_and_no_network_socket(keep_dir, model):
    """Started by a server's load, the keeper runs in a session of its own: a Ctrl-C of the
    server (SIGINT to its process group) ends the server, not the keeper, and the next load
    attaches. It writes its messages to keeper.log in its directory, and holds Unix sockets
    only: none of its sockets is a TCP, UDP or raw one."""
    d, expected = model
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOADER), _files(d), "hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=U.subprocess_env(),
                              start_new_session=True)
    try:
        assert json.loads(server.stdout.readline())["read_paths"] != ["kept", "kept"]
        pid = keep.status()["pid"]
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid, (os.getsid(pid), os.getpgid(pid))
        assert os.getsid(server.pid) == server.pid != pid
        log = keep_dir / "keeper.log"
        assert log.is_file() and log.stat().st_uid == os.getuid(), log
        sockets = _socket_inodes(pid)
        unix = {int(line.split()[6]) for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]}
        assert sockets and sockets <= unix, (sockets, unix)
        assert not sockets & _network_socket_inodes(pid)
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(timeout=30) != 0
    finally:
        server.kill()
        server.wait()
    os.kill(pid, 0)  # still running
    assert keep.status()["pid"] == pid
    assert _load_report(d)[1] == ["kept", "kept"]


def test_keeper_killed_while_clients_hold_entries(keep_dir, model):
    d, expected = model
    held = fst.load_file(d, keep=True)
    attached = fst.load_file(d, keep=True)
    _kill_keeper()
    # The tensors stay valid: their mappings hold the memory.
    U.assert_same_dict(held, expected)
    U.assert_same_dict(attached, expected)
    # The next load reads again (a new keeper starts), and the one after attaches to that.
    again, how = _load_report(d)
    assert "kept" not in how, how
    U.assert_same_dict(again, expected)
    assert _load_report(d)[1] == ["kept", "kept"]


def test_keeper_killed_while_filling(keep_dir, tmp_path, monkeypatch, capfd):
    from remote_servers import FileServer

    tensors = {"w": U.random_tensor(torch.float32, (4 << 20,), 5)}  # 16 MiB
    U.write_checkpoint(tmp_path / "m.safetensors", tensors)
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "1M")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_CONCURRENCY", "1")
    with FileServer(tmp_path, delay=0.1) as server:
        url = f"{server.url}/m.safetensors"
        fst.load_file(str(tmp_path / "m.safetensors"), keep=True)  # a keeper is running
        killed = []

        def kill_mid_fill():
            while server.sent < 3 << 20:
                time.sleep(0.01)
            killed.append(_kill_keeper())

        killer = threading.Thread(target=kill_mid_fill)
        killer.start()
        got = fst.load_file(url, keep=True)
        killer.join(timeout=60)
    assert killed, "the keeper was killed during the fill"
    U.assert_same_dict(got, tensors)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "keep:" in line]
    assert len(lines) == 1 and "the keeper went away" in lines[0] and "loading without keeping" in lines[0], err


def test_objects_are_kept_by_their_version_and_only_with_one(keep_dir, tmp_path, capfd):
    """docs/keep.md: an object is kept by its ETag; one whose server names no version (no ETag,
    no version id: a Last-Modified date alone, or nothing) is not kept, and the load reads,
    saying so in one line."""
    from remote_servers import FileServer

    tensors = {"w": U.random_tensor(torch.float32, (1024,), 6)}
    U.write_checkpoint(tmp_path / "m.safetensors", tensors)
    with FileServer(tmp_path) as server:
        url = f"{server.url}/m.safetensors"
        for _ in range(2):
            U.assert_same_dict(fst.load_file(url, keep=True), tensors)
        [entry] = keep.entries()
        assert entry["attaches"] == 1 and entry["files"] == [url], entry
    assert keep.drop(server.url) == 1 and keep.entries() == []  # by the URL's prefix
    capfd.readouterr()
    for etag, last_modified in ((False, True), (False, False)):
        with FileServer(tmp_path, etag=etag, last_modified=last_modified) as server:
            url = f"{server.url}/m.safetensors"
            U.assert_same_dict(fst.load_file(url, keep=True), tensors)
        lines = [line for line in capfd.readouterr().err.splitlines() if "keep:" in line]
        assert len(lines) == 1 and "names no version of it" in lines[0], lines
        assert keep.entries() == []


def test_a_client_killed_while_attached_leaks_nothing(keep_dir, model):
    d, _ = model
    fst.load_file(d, keep=True)  # kept, and let go of at once
    pid = keep.status()["pid"]
    _wait_unheld()
    time.sleep(0.3)  # the listing's own connection closed
    fds_before = _keeper_fds(pid)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOADER), _files(d), "hold"],
                              env=U.subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(holder.stdout.readline())["read_paths"] == ["kept", "kept"]
    [entry] = keep.entries()
    assert holder.pid in entry["holders"], entry
    holder.kill()
    holder.wait()
    _wait_unheld()
    # Its connection closed, no memory file added (the commands' own connections close as
    # their threads end).
    deadline = time.monotonic() + 10
    while _keeper_fds(pid) != fds_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _keeper_fds(pid) == fds_before
    assert keep.drop(str(d)) == 1 and keep.entries() == []
    assert _keeper_memfds(pid) == [], "the dropped entry's memory is let go of"


def _keeper_fds(pid: int) -> list:
    """The keeper's descriptors (sockets counted, not named: command connections come and go)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}").split("[")[0])
        except OSError:
            pass
    return sorted(found)


def _wait_unheld(timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(e["holders"] for e in keep.entries()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(e["holders"] for e in keep.entries()), keep.entries()


def test_a_stale_socket_is_replaced(keep_dir, model):
    d, expected = model
    keep_dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(keep_dir / "keeper.sock"))
    stale.close()  # the file stays, nobody listens: a keeper that was killed
    U.assert_same_dict(fst.load_file(d, keep=True), expected)
    assert keep.status() is not None
    assert _load_report(d)[1] == ["kept", "kept"]


def test_a_full_budget_reads_and_says_so(keep_dir, model, monkeypatch, capfd):
    d, expected = model
    monkeypatch.setenv("FASTSAFETENSORS_KEEP_MEMORY", "1M")
    got, how = _load_report(d)
    U.assert_same_dict(got, expected)
    assert "kept" not in how
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "do not fit FASTSAFETENSORS_KEEP_MEMORY" in err, err
    assert keep.entries() == []


def test_changed_files_are_never_attached(keep_dir, model):
    d, expected = model
    fst.load_file(d, keep=True)
    path = sorted(d.glob("*.safetensors"))[1]
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # other bytes, same size, the modification time put back
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    got, how = _load_report(d)
    assert "kept" not in how, how
    assert U.as_bytes(got["empty"]).numel() == 0
    assert not torch.equal(got["ids"], expected["ids"]) or not torch.equal(got["lm_head"], expected["lm_head"])
    [entry] = keep.entries()  # the stale one dropped, the new one kept
    assert entry["attaches"] == 0


def test_dropping_an_entry_leaves_its_tensors_valid(keep_dir, model):
    """docs/keep.md: dropping an entry never invalidates a tensor. Tensors attached to an entry
    (and the filling load's) keep their bytes after `keep.drop`, and the next load reads."""
    d, expected = model
    filled = fst.load_file(d, keep=True)
    attached = fst.load_file(d, keep=True)
    [entry] = keep.entries()
    assert entry["attaches"] == 1, entry
    keep.drop(str(d))
    assert keep.entries() == []
    for tensors in (filled, attached):
        U.assert_same_dict(tensors, expected)
    _, how = _load_report(d)
    assert "kept" not in how, how


@pytest.mark.parametrize("variable,value", [("FASTSAFETENSORS_KEEP_MEMORY", "lots"),
                                            ("FASTSAFETENSORS_KEEP_DEVICE_MEMORY", "-1G"),
                                            ("FASTSAFETENSORS_KEEP_IDLE", "soon")])
def test_a_malformed_setting_fails_the_load_naming_it(keep_dir, model, monkeypatch, variable, value):
    """docs/keep.md: a malformed keep setting fails the load that reads it, naming it, and
    starts no keeper."""
    d, _ = model
    monkeypatch.setenv(variable, value)
    with pytest.raises(Exception) as e:
        fst.load_file(d, keep=True)
    message = str(e.value)
    assert "\n" not in message and variable in message and value in message, message
    assert keep.status() is None


def test_a_directory_others_can_enter_is_refused(keep_dir, model, capfd):
    d, expected = model
    keep_dir.mkdir(mode=0o755)
    os.chmod(keep_dir, 0o755)
    U.assert_same_dict(fst.load_file(d, keep=True), expected)
    err = capfd.readouterr().err
    assert "must be yours alone" in err and "mode 0755" in err, err
    assert keep.status() is None


def test_a_directory_of_another_owner_or_a_link_is_refused(keep_dir, model, tmp_path, capfd):
    """docs/keep.md: the keeper's directory must be the user's own, mode 0700. A 0700 directory
    of another user (which root could enter, and whose socket another user's keeper would
    answer on), or a link to a directory of one's own, is refused: the load reads, saying so."""
    d, expected = model
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    keep_dir.symlink_to(mine)
    U.assert_same_dict(fst.load_file(d, keep=True), expected)
    err = capfd.readouterr().err
    assert "not a directory" in err and str(keep_dir) in err, err
    assert keep.status() is None and not any(mine.iterdir())
    if os.geteuid() != 0:
        return  # giving a directory to another user takes root
    keep_dir.unlink()
    keep_dir.mkdir(mode=0o700)
    os.chown(keep_dir, 65534, 65534)
    U.assert_same_dict(fst.load_file(d, keep=True), expected)
    err = capfd.readouterr().err
    assert "must be yours alone" in err and "owner uid 65534" in err, err
    assert keep.status() is None and not any(keep_dir.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_users_process_is_refused(keep_dir, model, tmp_path):
    d, _ = model
    fst.load_file(d, keep=True)
    # The directory keeps others out; past it (a link to the socket elsewhere), the keeper
    # still refuses them by their credentials.
    public = Path(tempfile.mkdtemp(prefix="fstk-pub-", dir="/tmp"))
    try:
        os.chmod(public, 0o755)
        os.chmod(keep_dir / "keeper.sock", 0o777)
        os.link(keep_dir / "keeper.sock", public / "s")
        code = """
            import json, os, socket, sys
            os.setgid(65534); os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(sys.argv[1])
            s.send(b"\\0" + json.dumps({"request": "list"}).encode())
            print(s.recv(1 << 16)[1:].decode())
        """
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(public / "s")], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["reply"] == "refused" and "runs as uid 65534" in reply["why"], reply
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_verified_entries_attach_only_for_the_same_digests(keep_dir, model):
    import hashlib

    d, expected = model
    files = sorted(d.glob("*.safetensors"))
    digests = {p.name: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    verified = fst.Digests(digests)
    U.assert_same_dict(fst.load_file(d, keep=True, verify=verified), expected)
    plain_files = [str(p) for p in files]
    handle = fst.ops.open_handle(plain_files, None, json.dumps({"digests": digests}))
    try:
        names, tensors, how = fst.ops.load_kept(plain_files, "cpu", None, None, None, None, "glob", handle)
    finally:
        fst.ops.close_handle(handle)
    assert how == ["kept", "kept"]
    U.assert_same_dict(dict(zip(names, tensors)), expected)
    # Unverified, it is another entry.
    assert _load_report(d)[1] != ["kept", "kept"]
    listed = keep.entries()
    assert sorted(bool(e["verified"]) for e in listed) == [False, True], listed
    # Other digests: refused before any attach (the file is not what they say).
    wrong = dict(digests, **{files[0].name: "sha256:" + "0" * 64})
    with pytest.raises(RuntimeError, match="digest mismatch"):
        fst.load_file(d, keep=True, verify=fst.Digests(wrong))


def test_stream_and_selection_keep(keep_dir, model):
    d, expected = model
    streamed = dict(fst.stream(d, keep=True))
    U.assert_same_dict(streamed, expected)
    assert dict(fst.stream(d, keep=True)).keys() == expected.keys()
    picked = fst.load_file(d, keep=True, tensor_filter="embed")
    assert list(picked) == ["embed"]
    U.assert_same_tensor(picked["embed"], expected["embed"])
    assert _load_report(d, tensor_filter=["embed"])[1] == ["kept", "none"]
    with pytest.raises(ValueError, match="keep=True loads without process_group"):
        fst.load_file(d, keep=True, process_group=object())
    with pytest.raises(TypeError, match="keep must be True or False"):
        fst.load_file(d, keep="yes")


def test_torchscript_calls_the_kept_load(keep_dir, model):
    d, expected = model

    @torch.jit.script
    def kept(files: list[str]) -> list[torch.Tensor]:
        return torch.ops.fastsafetensors.load_kept(files)[1]

    files = [str(p) for p in sorted(d.glob("*.safetensors"))]
    first = kept(files)
    second = kept(files)
    assert all(torch.equal(U.as_bytes(a), U.as_bytes(b)) for a, b in zip(first, second))
    assert keep.entries()[0]["attaches"] == 1


def test_the_command_line(keep_dir, model):
    d, _ = model
    fst.load_file(d, keep=True)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "keep", *args], env=U.subprocess_env(),
                              capture_output=True, text=True, timeout=60)

    listed = cli("--list")
    assert listed.returncode == 0 and str(d.resolve()) in listed.stdout and "2 files" in listed.stdout, listed
    as_json = json.loads(cli("--list", "--json").stdout)
    assert len(as_json["keeper"]["entries"]) == 1
    dropped = cli("--drop", str(d))
    assert dropped.returncode == 0 and "dropped 1 entry" in dropped.stdout, dropped
    assert keep.entries() == []
    pid = keep.status()["pid"]
    assert "keeper stopped" in cli("--stop").stdout
    _wait_gone(pid)
    assert "no keeper is running" in cli("--list").stdout


def test_serve_runs_the_keeper_in_the_foreground(keep_dir, model):
    d, expected = model
    server = subprocess.Popen([sys.executable, "-m", "fastsafetensors_rs", "keep", "--serve"],
                              env=U.subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        assert "serving" in line and str(keep_dir) in line, line
        assert keep.status()["pid"] == server.pid
        U.assert_same_dict(fst.load_file(d, keep=True), expected)
        assert _load_report(d)[1] == ["kept", "kept"]
        # A second one finds it running and says so.
        again = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "keep", "--serve"],
                               env=U.subprocess_env(), capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and f"(pid {server.pid}) already serves" in again.stderr, again.stderr
    finally:
        keep.stop()
        server.wait(timeout=30)


def test_weights_iterator_and_the_compatible_loader_keep(keep_dir, model):
    from fastsafetensors_rs import SafeTensorsFileLoader, SingleGroup, weights_iterator

    d, expected = model
    files = [str(p) for p in sorted(d.glob("*.safetensors"))]
    U.assert_same_dict(dict(weights_iterator(files, keep=True)), expected)
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", keep=True)
    loader.add_filenames({0: files})
    buffer = loader.copy_files_to_device()
    U.assert_same_dict({n: buffer.get_tensor(n) for n in expected}, expected)
    [entry] = keep.entries()
    assert entry["attaches"] == 1, entry


def test_the_vllm_plugin_takes_keep_in_its_extra_config(keep_dir, model):
    from fastsafetensors_rs import vllm_plugin

    assert vllm_plugin.parse_options({"keep": True})["keep"] is True
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['keep'\].*true or false"):
        vllm_plugin.parse_options({"keep": "yes"})


def test_from_pretrained_under_the_patch_keeps_the_weights(keep_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64)
    torch.manual_seed(3)
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory), max_shard_size="20KB")
    shards = len(list(directory.glob("*.safetensors")))
    assert shards > 1
    stock = transformers.LlamaForCausalLM.from_pretrained(str(directory))
    for _ in range(2):
        with fst.patched_transformers(keep=True):
            ours = transformers.LlamaForCausalLM.from_pretrained(str(directory))
        U.assert_same_dict(ours.state_dict(), stock.state_dict())
    listed = keep.entries()
    assert len(listed) == shards and all(e["attaches"] == 1 for e in listed), listed
