"""Remote sources: checkpoints read from a real S3 server (Garage, on 127.0.0.1) and from an
HTTP server with range support, through every entry point, bit-exact; and what happens when
the object changes, the server dies, answers 503 or slowly, or refuses the credentials.

Garage is built by `make garage` (into build/garage); `make test-python` builds it first.
A missing Garage fails these tests: it is never skipped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file

import fastsafetensors_rs as fst
import fst_testutils as U
from remote_servers import DelayProxy, FaultProxy, FileServer, Garage, garage_binary, wait_for_port

BUCKET = "models"
REMOTE_ENV = ("FASTSAFETENSORS_REMOTE_PART_SIZE", "FASTSAFETENSORS_REMOTE_CONCURRENCY",
              "FASTSAFETENSORS_REMOTE_TIMEOUT", "FASTSAFETENSORS_REMOTE_RETRIES")


# ------------------------------------------------------------------------------ fixtures
def _tensors(seed: int, n: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        out[f"layers.{seed}.{i}.weight"] = torch.randn(256, 1024, generator=g).to(torch.bfloat16)  # 512 KiB
        out[f"layers.{seed}.{i}.bias"] = torch.randn(1024, generator=g)
        out[f"layers.{seed}.{i}.scale"] = torch.randint(-128, 127, (333,), generator=g, dtype=torch.int8)
    return out


@pytest.fixture(scope="session")
def local_models(tmp_path_factory) -> Path:
    """The checkpoints the servers hold, written locally:
    single/all.safetensors   every dtype, metadata;
    sharded/                 two shards and their index;
    flat/                    two files, no index;
    big/model.safetensors    a 6 MiB tensor beside 4 MiB ones (reads of many parts);
    bigheader/x.safetensors  a header larger than the first GET."""
    root = tmp_path_factory.mktemp("remote-models")
    (root / "single").mkdir()
    U.write_checkpoint(root / "single" / "all.safetensors", U.all_dtype_tensors(seed=3),
                       metadata={"format": "pt", "source": "remote test"})
    (root / "sharded").mkdir()
    weight_map = {}
    for k in (1, 2):
        name = f"model-0000{k}-of-00002.safetensors"
        tensors = _tensors(k, 6)
        U.write_checkpoint(root / "sharded" / name, tensors, metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / "flat").mkdir()
    U.write_checkpoint(root / "flat" / "a.safetensors", _tensors(3, 2))
    U.write_checkpoint(root / "flat" / "b.safetensors", _tensors(4, 2))
    (root / "big").mkdir()
    g = torch.Generator().manual_seed(9)
    U.write_checkpoint(root / "big" / "model.safetensors", {
        "a": torch.randn(1024, 1024, generator=g),                      # 4 MiB
        "b": torch.randn(1536, 1024, generator=g),                      # 6 MiB
        "c": torch.randint(0, 255, (4 << 20,), generator=g, dtype=torch.uint8),  # 4 MiB
    })
    (root / "bigheader").mkdir()
    many = {f"model.layers.{i}.a.rather.long.tensor.name.that.makes.the.header.big.{i:06d}": torch.full((3,), i)
            for i in range(12000)}
    U.write_checkpoint(root / "bigheader" / "x.safetensors", many)
    assert int.from_bytes((root / "bigheader" / "x.safetensors").read_bytes()[:8], "little") > 1 << 20
    return root


@pytest.fixture(scope="session")
def garage(tmp_path_factory, local_models):
    binary = garage_binary()
    if binary is None:
        pytest.fail("Garage (the S3 server these tests run against) is not built: run `make garage` "
                    "(or `make test-python`, which builds it), or set FST_GARAGE to its binary")
    server = Garage(binary, tmp_path_factory.mktemp("garage"))
    try:
        server.bucket(BUCKET)
        for sub in ("single", "sharded", "flat", "big", "bigheader"):
            server.upload(BUCKET, f"{sub}/", local_models / sub)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def http_server(local_models):
    with FileServer(local_models) as server:
        yield server


@pytest.fixture
def s3_env(garage, monkeypatch):
    """The environment of a client of the Garage server; small parts so that reads split."""
    for k in list(os.environ):
        if k.startswith("AWS_") or k in REMOTE_ENV:
            monkeypatch.delenv(k)
    for k, v in garage.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "1M")
    return garage


@pytest.fixture(params=["s3", "http"])
def remote(request, local_models, monkeypatch):
    """(base URL of the models, local copy) through S3 or HTTP."""
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "1M")
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        return f"s3://{BUCKET}", local_models
    return request.getfixturevalue("http_server").url, local_models


def reference(path: Path) -> dict:
    return st_load_file(str(path))


def reference_dir(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(st_load_file(str(f)))
    return out


# ------------------------------------------------------------------------------ bit-exact
def test_load_file_is_bit_exact(remote):
    base, local = remote
    for rel in ("single/all.safetensors", "big/model.safetensors"):
        U.assert_same_dict(fst.load_file(f"{base}/{rel}"), reference(local / rel))


def test_a_header_larger_than_the_first_get_is_read(remote):
    base, local = remote
    got = fst.load_file(f"{base}/bigheader/x.safetensors")
    U.assert_same_dict(got, reference(local / "bigheader" / "x.safetensors"))


def test_an_index_url_loads_its_shards(remote):
    base, local = remote
    got = fst.load(f"{base}/sharded/model.safetensors.index.json")
    U.assert_same_dict(got, reference_dir(local / "sharded"))


def test_a_prefix_loads_like_a_directory(s3_env, local_models):
    # With an index: the shards it lists; without: every *.safetensors directly under it.
    for sub in ("sharded", "flat"):
        for url in (f"s3://{BUCKET}/{sub}", f"s3://{BUCKET}/{sub}/"):
            U.assert_same_dict(fst.load(url), reference_dir(local_models / sub))


def test_an_http_prefix_cannot_be_listed(http_server):
    with pytest.raises(RuntimeError, match=r"/sharded: .*HTTP server cannot be listed.*index"):
        fst.load(f"{http_server.url}/sharded")


def test_several_urls_and_a_local_file_load_together(remote):
    base, local = remote
    got = fst.load([f"{base}/flat/a.safetensors", str(local / "flat" / "b.safetensors")])
    U.assert_same_dict(got, reference_dir(local / "flat"))


def test_safe_open_reads_keys_metadata_tensors_and_slices(remote):
    base, local = remote
    ref = reference(local / "single" / "all.safetensors")
    with fst.safe_open(f"{base}/single/all.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == sorted(ref)
        assert f.metadata() == {"format": "pt", "source": "remote test"}
        for name in sorted(ref)[::7]:
            U.assert_same_tensor(f.get_tensor(name), ref[name], name)
        matrix = sorted(n for n in ref if n.endswith(".matrix"))[0]
        U.assert_same_tensor(f.get_slice(matrix)[1:4], ref[matrix][1:4], matrix)


def test_streams_and_the_weights_iterator_are_bit_exact(remote):
    base, local = remote
    ref = reference_dir(local / "sharded")
    url = f"{base}/sharded/model.safetensors.index.json"
    got = {n: t.clone() for n, t in fst.stream(url, max_memory="2M")}
    U.assert_same_dict(got, ref)
    shards = [f"{base}/sharded/model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    got = {n: t.clone() for n, t in fst.weights_iterator(shards, max_memory="3M")}
    U.assert_same_dict(got, ref)


def test_the_ibm_api_and_vllms_iterator_take_urls(remote):
    base, local = remote
    shards = [f"{base}/sharded/model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    got = {n: t.clone() for n, t in U.vllm_weights_iterator(shards)}
    U.assert_same_dict(got, reference_dir(local / "sharded"))


def test_the_vllm_plugin_reads_weights_from_a_url(remote):
    from fastsafetensors_rs import vllm_plugin

    base, local = remote
    url = f"{base}/sharded/model.safetensors.index.json"
    assert vllm_plugin.parse_options({"weights": url}) == {"weights": url}
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['weights'\].*a URL or a path"):
        vllm_plugin.parse_options({"weights": 3})
    files = vllm_plugin.weights_files(url)
    assert files == [f"{base}/sharded/model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    got = {n: t.clone() for n, t in fst.weights_iterator(files)}
    U.assert_same_dict(got, reference_dir(local / "sharded"))


def test_a_filter_fetches_only_the_selected_bytes(http_server, local_models, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "1M")
    url = f"{http_server.url}/big/model.safetensors"
    ref = reference(local_models / "big" / "model.safetensors")
    http_server.reset()
    got = fst.load_file(url, tensor_filter=["b"])
    U.assert_same_dict(got, {"b": ref["b"]})
    selected = ref["b"].numel() * 4
    # The first GET of an object (its header) asks for its first MiB, whatever is selected.
    probe = 1 << 20
    assert http_server.sent <= 1.2 * selected + probe, (http_server.sent, selected)
    assert http_server.sent >= selected
    # Every data GET was a range, and the ranges were parts of at most 1 MiB.
    ranges = [r for (_, _, r) in http_server.requests]
    assert all(r and r.startswith("bytes=") for r in ranges), ranges
    assert len(ranges) >= 1 + selected // (1 << 20)


def test_the_cli_inspects_and_verifies_urls(remote):
    base, local = remote
    url = f"{base}/sharded/model.safetensors.index.json"
    for command in ("inspect", "verify"):
        proc = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", command, url, "--json"],
                              capture_output=True, text=True, timeout=300, env=U.subprocess_env())
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["valid"] is True, out
        names = {t["name"] for f in out["files"] for t in f.get("tensors", [])} if command == "inspect" else None
        if names is not None:
            assert names == set(reference_dir(local / "sharded")), names


# ------------------------------------------------------------------------------ consistency
def test_an_object_replaced_after_its_header_was_read_is_an_error(s3_env, local_models):
    url = f"s3://{BUCKET}/replaced/model.safetensors"
    data = (local_models / "big" / "model.safetensors").read_bytes()
    s3_env.put(BUCKET, "replaced/model.safetensors", data)
    with fst.safe_open(url, framework="pt") as f:
        assert f.keys() == ["a", "b", "c"]
        # Same size, other bytes: only the version tells them apart.
        s3_env.put(BUCKET, "replaced/model.safetensors", data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(RuntimeError, match=r"replaced/model.safetensors: the object changed while it was being"):
            f.get_tensor("c")


def test_a_file_replaced_on_an_http_server_is_an_error(http_server, local_models, tmp_path):
    target = local_models / "single" / "replaced.safetensors"
    src = (local_models / "big" / "model.safetensors").read_bytes()
    target.write_bytes(src)
    url = f"{http_server.url}/single/replaced.safetensors"
    with fst.safe_open(url, framework="pt") as f:
        time.sleep(0.01)
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(src)
        tmp.replace(target)  # a new inode: a new ETag
        with pytest.raises(RuntimeError, match=r"replaced.safetensors: the object changed"):
            f.get_tensor("b")
    target.unlink()


def test_a_server_that_ignores_the_version_asked_for_cannot_mix_two(local_models, tmp_path):
    """docs/remote.md: each answer's size, ETag and Last-Modified are compared with the version
    opened, so a server that ignores If-Match and If-Unmodified-Since still cannot hand out
    a mix of two versions; with neither validator, the size is compared."""
    src = (local_models / "big" / "model.safetensors").read_bytes()
    root = tmp_path / "served"
    root.mkdir()
    target = root / "model.safetensors"
    # (ETag, Last-Modified, the new version's bytes): a new ETag (a new inode); a new date;
    # with no validator, a new size.
    for etag, last_modified, new in ((True, True, src), (False, True, src), (False, False, src + b"\0" * 4096)):
        target.write_bytes(src)
        with FileServer(root, etag=etag, last_modified=last_modified) as server:
            server.ignore_conditions = True
            with fst.safe_open(f"{server.url}/model.safetensors", framework="pt") as f:
                tmp = target.with_suffix(".tmp")
                tmp.write_bytes(new)
                later = target.stat().st_mtime + 10
                os.utime(tmp, (later, later))
                tmp.replace(target)
                with pytest.raises(RuntimeError, match=r"model.safetensors: the object changed") as e:
                    f.get_tensor("b")
                assert "\n" not in str(e.value), e.value
        assert any("If-Match" in h or "If-Unmodified-Since" in h for h in server.headers_seen[1:]) == (
            etag or last_modified), server.headers_seen


def test_a_server_killed_mid_load_fails_the_load_promptly(local_models, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "3")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "2")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "1M")
    port_file = tmp_path / "port"
    # 1 s per MiB sent (a part): the 14 MiB file takes long enough to kill the server under it.
    server = subprocess.Popen([sys.executable, str(Path(U.__file__).parent / "remote_servers.py"), "serve",
                               str(local_models), str(port_file), "1.0"])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.05)
        port = int(port_file.read_text())
        wait_for_port(port)
        url = f"http://127.0.0.1:{port}/big/model.safetensors"
        outcome = {}

        def run():
            try:
                outcome["tensors"] = fst.load_file(url)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                outcome["error"] = e

        t = threading.Thread(target=run)
        start = time.monotonic()
        t.start()
        time.sleep(0.5)
        server.send_signal(signal.SIGKILL)
        t.join(timeout=60)
        assert not t.is_alive(), "the load hung after its server was killed"
        assert "error" in outcome, "the load succeeded although its server was killed mid-load"
        message = str(outcome["error"])
        assert message.startswith(url), message
        assert "\n" not in message, message
        assert time.monotonic() - start < 60
    finally:
        server.kill()
        server.wait()


def test_an_s3_load_behind_80ms_of_rtt_completes_bit_exact(s3_env, local_models, monkeypatch):
    """Through the delaying TCP proxy (40 ms each way), within a 5 s request timeout and one
    retry: 14 parts of 1 MiB in parallel, the SigV4 signatures as the client made them."""
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "5")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "1")
    with DelayProxy(s3_env.s3_port, delay=0.040) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        start = time.monotonic()
        got = fst.load_file(f"s3://{BUCKET}/big/model.safetensors")
        took = time.monotonic() - start
        assert proxy.connections >= 1 and proxy.forwarded >= (local_models / "big" / "model.safetensors").stat().st_size
    U.assert_same_dict(got, reference(local_models / "big" / "model.safetensors"))
    assert took >= 2 * 0.080, took  # the open, then the parts: two round trips at least


# ------------------------------------------------------------------------------ faults
@pytest.fixture
def proxy(s3_env, monkeypatch):
    """A fault-injecting proxy in front of Garage, which the client is pointed at."""
    with FaultProxy(s3_env.s3_port) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def test_503s_are_retried(proxy, local_models):
    proxy.fail_next = 3
    got = fst.load_file(f"s3://{BUCKET}/big/model.safetensors")
    U.assert_same_dict(got, reference(local_models / "big" / "model.safetensors"))
    assert proxy.failed == 3


def test_503s_past_the_retries_name_the_url_and_the_status(proxy, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "1")
    proxy.fail_next = 100
    url = f"s3://{BUCKET}/big/model.safetensors"
    with pytest.raises(RuntimeError) as e:
        fst.load_file(url)
    message = str(e.value)
    assert message.startswith(f"{url}: ") and "503 Service Unavailable" in message, message
    assert "after 1 retries" in message, message
    assert "\n" not in message


def test_slow_responses_within_the_timeout_load(proxy, local_models, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "5")
    proxy.delay = 0.2
    got = fst.load_file(f"s3://{BUCKET}/single/all.safetensors")
    U.assert_same_dict(got, reference(local_models / "single" / "all.safetensors"))


def test_responses_slower_than_the_timeout_fail_without_hanging(proxy, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "1")
    proxy.delay = 3
    url = f"s3://{BUCKET}/single/all.safetensors"
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        fst.load_file(url)
    message = str(e.value)
    assert message.startswith(url) and "timed out" in message.lower(), message
    assert time.monotonic() - start < 30


def test_wrong_credentials_are_refused_without_showing_them(s3_env, monkeypatch):
    secret = "0" * 64
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    url = f"s3://{BUCKET}/single/all.safetensors"
    with pytest.raises(RuntimeError) as e:
        fst.load_file(url)
    message = str(e.value)
    assert message.startswith(f"{url}: access denied"), message
    assert secret not in message and s3_env.secret not in message


def test_no_secret_reaches_an_error_or_a_debug_log(s3_env, monkeypatch):
    """docs/remote.md: a store's credentials are used and never shown. A load with the right
    ones and loads with a wrong secret key and a session token, with debug logging on: the
    secrets appear in no error, log line or output."""
    url = f"s3://{BUCKET}/single/all.safetensors"
    script = ("import sys, fastsafetensors_rs as f\n"
              "try:\n    print(sorted(f.load_file(sys.argv[1])))\n"
              "except Exception as e:\n    print('ERROR', e)\n")

    def run(**env):
        out = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "FASTSAFETENSORS_LOG": "debug", **env})
        assert out.returncode == 0, out
        return out

    good = run()
    assert "ERROR" not in good.stdout and "read with" in good.stderr, good
    wrong, token = "W" * 40, "SESSION-TOKEN-SECRET"
    bad = run(AWS_SECRET_ACCESS_KEY=wrong, AWS_SESSION_TOKEN=token)
    assert f"ERROR {url}: access denied" in bad.stdout, bad
    for out in (good, bad):
        for text in (out.stdout, out.stderr):
            for secret in (s3_env.secret, wrong, token):
                assert secret not in text, (secret, text)


def test_a_missing_key_or_bucket_is_named(s3_env):
    url = f"s3://{BUCKET}/single/nothing.safetensors"
    with pytest.raises(RuntimeError, match=rf"^{url}: no such object \(HTTP 404\)"):
        fst.load_file(url)
    url = "s3://no-such-bucket/x.safetensors"
    with pytest.raises(RuntimeError, match=rf"^{url}: no such bucket"):
        fst.load_file(url)
    # A shard the index lists but the bucket lacks: named by the index.
    s3_env.put(BUCKET, "broken/model.safetensors.index.json",
               json.dumps({"weight_map": {"x": "gone.safetensors"}}).encode())
    with pytest.raises(RuntimeError, match=r"broken/model.safetensors.index.json: lists shard gone.safetensors, "
                                           r"which does not exist"):
        fst.load(f"s3://{BUCKET}/broken/model.safetensors.index.json")


def test_missing_credentials_are_named(s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # Where no credentials are set, the instance metadata service is asked: here, nothing.
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "0")
    url = f"s3://{BUCKET}/single/all.safetensors"
    with pytest.raises(RuntimeError, match=rf"^{url}: no credentials found"):
        fst.load_file(url)


def _aws_files(tmp_path, monkeypatch, credentials: str, config: str) -> None:
    """The AWS CLI's two files, written under a fresh HOME, and an environment without AWS_*."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(credentials)
    (tmp_path / ".aws" / "config").write_text(config)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_the_aws_cli_files_give_credentials_region_and_endpoint(s3_env, local_models, tmp_path, monkeypatch):
    """A machine set up with `aws configure --profile garage`: nothing in the environment but
    AWS_PROFILE (then the same through the default profile)."""
    _aws_files(tmp_path, monkeypatch,
               f"[garage]\naws_access_key_id = {s3_env.key_id}\naws_secret_access_key = {s3_env.secret}\n",
               f"[profile garage]\nregion = garage\nendpoint_url = {s3_env.endpoint}\ns3 =\n  addressing_style = path\n")
    monkeypatch.setenv("AWS_PROFILE", "garage")
    url = f"s3://{BUCKET}/single/all.safetensors"
    U.assert_same_dict(fst.load_file(url), reference(local_models / "single" / "all.safetensors"))
    # The environment wins over the files: a wrong key there is what is sent.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "GK" + "0" * 24)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "0" * 64)
    with pytest.raises(RuntimeError, match=rf"^{url}: access denied"):
        fst.load_file(url)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # The default profile, in the files' other spelling.
    monkeypatch.delenv("AWS_PROFILE")
    (tmp_path / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id={s3_env.key_id}\naws_secret_access_key={s3_env.secret}\n")
    (tmp_path / ".aws" / "config").write_text(f"[default]\nregion=garage\nendpoint_url={s3_env.endpoint}\n")
    U.assert_same_dict(fst.load(f"s3://{BUCKET}/flat/"), reference_dir(local_models / "flat"))


@pytest.mark.parametrize("in_env", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_half_a_key_in_the_environment_is_never_paired_with_the_files_other_half(s3_env, tmp_path, monkeypatch,
                                                                                  in_env):
    """The AWS CLI refuses a key id without its secret in the environment (and the reverse)
    rather than take the missing half from its files: a key id from one place and a secret
    from another are no key. Here the files' key is the good one, and so is the half in the
    environment: pairing them would load; the load must fail naming the missing half."""
    _aws_files(tmp_path, monkeypatch,
               f"[default]\naws_access_key_id = {s3_env.key_id}\naws_secret_access_key = {s3_env.secret}\n",
               f"[default]\nregion = garage\nendpoint_url = {s3_env.endpoint}\n")
    monkeypatch.setenv(in_env, s3_env.key_id if in_env == "AWS_ACCESS_KEY_ID" else s3_env.secret)
    missing = {"AWS_ACCESS_KEY_ID": "AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY": "AWS_ACCESS_KEY_ID"}[in_env]
    url = f"s3://{BUCKET}/single/all.safetensors"
    with pytest.raises(RuntimeError) as raised:
        fst.load_file(url)
    message = str(raised.value)
    assert message.startswith(f"{url}: {in_env} is set but {missing} is not: set both"), message
    assert "\n" not in message and s3_env.secret not in message, message


def test_unusable_aws_profiles_are_named_without_their_secrets(s3_env, tmp_path, monkeypatch):
    secret = "do-not-print-" + "9" * 40
    aws = tmp_path / ".aws"
    url = f"s3://{BUCKET}/single/all.safetensors"
    good = f"[default]\naws_access_key_id = {s3_env.key_id}\naws_secret_access_key = {secret}\n"
    cases = [  # (AWS_PROFILE, credentials file, config file, the error)
        ("absent", good, "", rf"^{url}: AWS_PROFILE=absent: no such profile in {aws}/credentials or {aws}/config$"),
        ("assumed", good, "[profile assumed]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = default\n",
         rf"^{url}: the AWS profile 'assumed' gets its credentials through role_arn, which this loader does not "
         rf"follow: export them first"),
        ("default", f"[default]\naws_secret_access_key {secret}\n", "",
         rf"^{url}: {aws}/credentials, line 2: neither a \[section\] nor a key = value line$"),
    ]
    for profile, credentials, config, message in cases:
        shutil.rmtree(aws, ignore_errors=True)
        _aws_files(tmp_path, monkeypatch, credentials, config)
        monkeypatch.setenv("AWS_PROFILE", profile)
        with pytest.raises(RuntimeError, match=message) as raised:
            fst.load_file(url)
        assert secret not in str(raised.value)


def test_malformed_remote_settings_are_named(s3_env, monkeypatch):
    # (Every load checks them: test_settings.py; here, a load of a URL.)
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "tiny")
    with pytest.raises(RuntimeError, match=r"^FASTSAFETENSORS_REMOTE_PART_SIZE='tiny' is not valid"):
        fst.load_file(f"s3://{BUCKET}/single/all.safetensors")


# ------------------------------------------------------------------------------ cache
def _entries(cache: Path, timeout: float = 20.0, want: int | None = None) -> list[Path]:
    """The complete entries of the cache, once the writer threads are done (no partial file
    left) and, with `want`, once there are that many."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(cache.iterdir()) if cache.exists() else []
        done = [f for f in files if f.name.endswith(".safetensors")]
        if not any(".partial." in f.name for f in files) and (want is None or len(done) == want):
            return done
        assert time.monotonic() < deadline, files
        time.sleep(0.05)


@pytest.fixture
def cached(http_server, local_models, tmp_path, monkeypatch):
    """(url, reference tensors, the entry, the file's bytes) after a load that cached it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FASTSAFETENSORS_CACHE_DIR", str(cache))
    url = f"{http_server.url}/big/model.safetensors"
    ref = reference(local_models / "big" / "model.safetensors")
    U.assert_same_dict(fst.load_file(url), ref)
    [entry] = _entries(cache, want=1)
    return url, ref, entry, (local_models / "big" / "model.safetensors").read_bytes()


def test_the_cache_makes_the_next_load_local(cached, http_server):
    url, ref, entry, data = cached
    assert entry.read_bytes() == data
    http_server.reset()
    tensors, read_paths = U.op_load_with_report([url], "cpu", None, None, None)
    U.assert_same_dict(tensors, ref)
    assert read_paths[0] != "remote", read_paths
    # Only the GET that asks for the object's version (with its header) went to the server.
    assert len(http_server.requests) == 1 and http_server.sent <= 1 << 20, http_server.requests
    # safe_open and streams read the entry too.
    with fst.safe_open(url, framework="pt") as f:
        U.assert_same_tensor(f.get_tensor("b"), ref["b"])
    U.assert_same_dict({n: t.clone() for n, t in fst.stream(url, max_memory="4M")}, ref)
    assert len(http_server.requests) == 3


def test_a_stale_cache_entry_is_never_read(http_server, local_models, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FASTSAFETENSORS_CACHE_DIR", str(cache))
    target = local_models / "single" / "cached.safetensors"
    U.write_checkpoint(target, {"x": torch.arange(10_000, dtype=torch.float32)})
    url = f"{http_server.url}/single/cached.safetensors"
    U.assert_same_dict(fst.load_file(url), reference(target))
    [old] = _entries(cache, want=1)
    # The object replaced (same size, other bytes, a new ETag): the old entry is not read,
    # and goes once the new one is complete.
    U.write_checkpoint(target.with_suffix(".tmp"), {"x": torch.arange(10_000, dtype=torch.float32) + 1})
    target.with_suffix(".tmp").replace(target)
    U.assert_same_dict(fst.load_file(url), reference(target))
    [new] = _entries(cache, want=1)
    assert new != old and not old.exists()
    assert new.read_bytes() == target.read_bytes()
    target.unlink()


def test_a_partial_read_leaves_no_entry_and_a_partial_entry_is_never_read(http_server, local_models, tmp_path,
                                                                           monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FASTSAFETENSORS_CACHE_DIR", str(cache))
    url = f"{http_server.url}/flat/a.safetensors"
    ref = reference(local_models / "flat" / "a.safetensors")
    name = sorted(ref)[0]
    U.assert_same_dict(fst.load_file(url, tensor_filter=[name]), {name: ref[name]})
    assert _entries(cache) == []
    # A whole load makes the entry; cut short (as a crash or a full disk leaves it), it is
    # not taken for the object: the next load reads the server.
    U.assert_same_dict(fst.load_file(url), ref)
    [entry] = _entries(cache, want=1)
    entry.write_bytes(entry.read_bytes()[:-100])
    http_server.reset()
    U.assert_same_dict(fst.load_file(url), ref)
    assert http_server.sent >= (local_models / "flat" / "a.safetensors").stat().st_size
    [entry] = _entries(cache, want=1)
    assert entry.read_bytes() == (local_models / "flat" / "a.safetensors").read_bytes()


def test_cache_dir_is_an_argument_of_every_entry_point(http_server, local_models, tmp_path, monkeypatch):
    monkeypatch.delenv("FASTSAFETENSORS_CACHE_DIR", raising=False)
    cache = tmp_path / "by-argument"
    url = f"{http_server.url}/big/model.safetensors"
    ref = reference(local_models / "big" / "model.safetensors")
    U.assert_same_dict(fst.load_file(url, cache_dir=cache), ref)
    [entry] = _entries(cache, want=1)
    assert entry.read_bytes() == (local_models / "big" / "model.safetensors").read_bytes()
    # Each entry point then reads the entry: one GET (the object's version, with its header) each.
    http_server.reset()
    U.assert_same_dict(fst.load(url, cache_dir=str(cache)), ref)
    U.assert_same_dict({n: t.clone() for n, t in fst.stream(url, max_memory="4M", cache_dir=cache)}, ref)
    with fst.safe_open(url, framework="pt", cache_dir=cache) as f:
        U.assert_same_tensor(f.get_tensor("b"), ref["b"])
    assert len(http_server.requests) == 3 and http_server.sent <= 3 << 20, http_server.requests
    # Without the argument (and no variable), nothing is cached: the bytes come again.
    http_server.reset()
    U.assert_same_dict(fst.load_file(url), ref)
    assert http_server.sent >= (local_models / "big" / "model.safetensors").stat().st_size
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match=rf"cache_dir={not_a_dir}: not a usable directory"):
        fst.load_file(url, cache_dir=not_a_dir)
    with pytest.raises(TypeError, match="cache_dir= takes a directory path"):
        fst.load_file(url, cache_dir=3)


# ------------------------------------------------------------------------------ versions and queries
def _same_layout_other_values(path: Path, shift: float) -> dict:
    tensors = {"a": torch.arange(300_000, dtype=torch.float32) + shift,
               "b": torch.arange(500_000, dtype=torch.float32) * 2 + shift}
    U.write_checkpoint(path, tensors)
    return tensors


def test_a_urls_query_string_goes_with_every_request(local_models, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "64K")
    root = tmp_path / "served"
    root.mkdir()
    v1 = _same_layout_other_values(root / "model.safetensors", 0.0)
    v2 = _same_layout_other_values(root / "model.safetensors.v2", 1.0)
    with FileServer(root) as server:
        U.assert_same_dict(fst.load_file(f"{server.url}/model.safetensors"), v1)
        server.reset()
        U.assert_same_dict(fst.load_file(f"{server.url}/model.safetensors?v=2"), v2)
        assert len(server.requests) > 3
        assert all(path.endswith("?v=2") for _, path, _ in server.requests), server.requests
        with fst.safe_open(f"{server.url}/model.safetensors?v=2", framework="pt") as f:
            U.assert_same_tensor(f.get_slice("b")[10:20], v2["b"][10:20])


def test_a_presigned_url_is_sent_as_signed_and_its_signature_never_shown(local_models, tmp_path, monkeypatch):
    root = tmp_path / "served"
    root.mkdir()
    v1 = _same_layout_other_values(root / "model.safetensors", 0.0)
    secret = "c2VjcmV0LXNpZ25hdHVyZQ"
    with FileServer(root, secret=secret) as server:
        url = f"{server.url}/model.safetensors?X-Amz-Expires=60&sig={secret}"
        U.assert_same_dict(fst.load_file(url), v1)
        U.assert_same_dict(dict(fst.stream(url, max_memory="1M")), v1)
        with pytest.raises(RuntimeError) as e:
            fst.load_file(f"{server.url}/model.safetensors?sig=wrong-{secret}")
        assert "model.safetensors" in str(e.value) and secret not in str(e.value), e.value


def test_an_object_without_an_etag_replaced_by_one_of_the_same_size_is_an_error(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "64K")
    root = tmp_path / "served"
    root.mkdir()
    target = root / "model.safetensors"
    v1 = _same_layout_other_values(target, 0.0)
    with FileServer(root, etag=False) as server:
        url = f"{server.url}/model.safetensors"
        U.assert_same_dict(fst.load_file(url), v1)
        with fst.safe_open(url, framework="pt") as f:
            _same_layout_other_values(root / "next", 1.0)
            os.utime(root / "next", (time.time() + 5, time.time() + 5))  # Last-Modified is in seconds
            (root / "next").replace(target)
            with pytest.raises(RuntimeError, match=r"model.safetensors: the object changed"):
                f.get_tensor("b")
        # Neither validator: the load goes on, checking sizes, and says once that it cannot pin it.
        server.last_modified = False
        url = f"{server.url}/model.safetensors?unpinned"
        for _ in range(2):
            fst.load_file(url)
        err = capfd.readouterr().err
        assert err.count("cannot be pinned to one version") == 1, err


# ------------------------------------------------------------------------------ damaged cache entries
def _damage_then_load(cached, http_server, capfd, damage) -> None:
    url, ref, entry, data = cached
    damage(entry, data)
    capfd.readouterr()
    http_server.reset()
    U.assert_same_dict(fst.load_file(url), ref)
    assert http_server.sent >= len(data), "the damaged entry was read instead of the server"
    err = capfd.readouterr().err
    assert "the cache entry" in err and "was discarded" in err, err
    # The object is cached anew, whole, and read from there next.
    [again] = _entries(entry.parent, want=1)
    assert again.read_bytes() == data
    http_server.reset()
    U.assert_same_dict(fst.load_file(url), ref)
    assert http_server.sent <= 1 << 20


def test_a_cache_entry_with_a_flipped_byte_is_discarded_and_fetched_again(cached, http_server, capfd):
    def flip(entry, data):
        body = bytearray(data)
        body[len(body) // 2] ^= 0x40
        entry.write_bytes(body)

    _damage_then_load(cached, http_server, capfd, flip)


def test_a_cache_entry_whose_header_is_not_the_objects_is_discarded(cached, http_server, capfd):
    def retype(entry, data):
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n].replace(b'"F32"', b'"I32"')
        assert len(header) == n and header != data[8:8 + n]
        entry.write_bytes(data[:8] + header + data[8 + n:])

    _damage_then_load(cached, http_server, capfd, retype)


def test_a_zeroed_cache_entry_is_discarded_and_later_loads_work(cached, http_server, capfd):
    _damage_then_load(cached, http_server, capfd, lambda entry, data: entry.write_bytes(bytes(len(data))))


def test_partial_entries_of_a_process_that_is_gone_are_removed(cached, http_server):
    url, ref, entry, _ = cached
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = entry.with_name(entry.name + f".partial.{int(dead.stdout)}")
    ours = entry.with_name("0000000000000000-0000000000000000.safetensors.partial." + str(os.getpid()))
    for f in (stale, ours):
        f.write_bytes(b"x" * 1000)
    U.assert_same_dict(fst.load_file(url), ref)
    assert not stale.exists(), "a partial entry of a dead process was left"
    assert ours.exists(), "a partial entry of a running process was removed"
    ours.unlink()


def test_a_stalled_server_holds_up_only_its_own_loads(local_models, monkeypatch):
    """Many small parts in flight to a server that stops answering hold that server's request
    slots, not the process's: a load from another server goes on at its own pace."""
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "64K")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "8")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "0")
    ref = reference(local_models / "flat" / "a.safetensors")
    with FileServer(local_models) as stalled, FileServer(local_models) as healthy:
        outcome = {}
        with fst.safe_open(f"{stalled.url}/big/model.safetensors", framework="pt") as f:
            stalled.delay = 30.0  # from now on each answer waits past the timeout

            def stall():
                try:
                    f.get_tensor("b")
                except RuntimeError as e:
                    outcome["error"] = str(e)

            t = threading.Thread(target=stall)
            t.start()
            deadline = time.monotonic() + 5
            while len(stalled.requests) < 9 and time.monotonic() < deadline:  # the open, then the first 8 parts in flight
                time.sleep(0.05)
            assert len(stalled.requests) >= 9, stalled.requests
            start = time.monotonic()
            U.assert_same_dict(fst.load_file(f"{healthy.url}/flat/a.safetensors"), ref)
            took = time.monotonic() - start
            t.join(timeout=60)
        assert took < 3, f"a load from a healthy server took {took:.1f} s beside a stalled one"
        assert "error" in outcome, "the stalled load did not fail"


# ------------------------------------------------------------------------------ secrets in URLs
def test_credentials_in_urls_are_used_and_never_shown(local_models, tmp_path):
    """`user:password@` goes as HTTP Basic authorization; neither it nor a query string shows
    in an error, a log line or the command line's output."""
    root = tmp_path / "served"
    (root / "m").mkdir(parents=True)
    tensors = _same_layout_other_values(root / "m" / "model.safetensors", 0.0)
    (root / "m" / "notes.safetensors").write_bytes(b"PK\x03\x04 not a safetensors file at all" * 10)
    (root / "m" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "missing.safetensors"}}))
    password, sig = "pa55w0rd-SECRET", "SIGNATURE-SECRET"
    with FileServer(root, basic_auth=("user", password)) as server:
        base = server.url.replace("http://", f"http://user:{password}@")
        U.assert_same_dict(fst.load_file(f"{base}/m/model.safetensors"), tensors)
        failing = [lambda: fst.load_file(f"{base}/m/absent.safetensors?sig={sig}"),
                   lambda: fst.load_file(f"{base}/m/model.safetensors.index.json"),
                   lambda: fst.safe_open(f"{base}/m/notes.safetensors?sig={sig}", framework="pt"),
                   lambda: fst.load_file(f"{server.url}/m/model.safetensors?sig={sig}")]  # no password: 401
        for load in failing:
            with pytest.raises((RuntimeError, OSError, ValueError)) as e:
                load()
            assert password not in str(e.value) and sig not in str(e.value), e.value
            assert "/m/" in str(e.value), e.value
        script = (f"import fastsafetensors_rs as f\nf.load_file({base + '/m/model.safetensors?sig=' + sig!r})\n"
                  f"with f.safe_open({base + '/m/model.safetensors?sig=' + sig!r}) as h:\n    h.get_tensor('zz')\n")
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env={**os.environ, "FASTSAFETENSORS_LOG": "debug"}, timeout=120)
        assert "read with" in run.stderr and "KeyError" in run.stderr, run.stderr
        for cli in (["inspect", "-v", f"{base}/m/model.safetensors?sig={sig}"],
                    ["verify", "-v", "--json", f"{base}/m/absent.safetensors?sig={sig}"]):
            out = subprocess.run([sys.executable, "-m", "fastsafetensors_rs", *cli], capture_output=True,
                                 text=True, timeout=120)
            assert f"{server.url}/m/{'model' if cli[0] == 'inspect' else 'absent'}.safetensors" in out.stdout, out
            for text in (run.stdout, run.stderr, out.stdout, out.stderr):
                assert password not in text and sig not in text, text


def test_s3_keys_are_read_as_the_aws_cli_reads_them(s3_env, tmp_path):
    """`%20` in an s3:// URL is three characters of the key, as `aws s3 cp` takes it; a space
    is a space."""
    literal = _same_layout_other_values(tmp_path / "literal.safetensors", 0.0)
    spaced = _same_layout_other_values(tmp_path / "spaced.safetensors", 1.0)
    s3_env.put(BUCKET, "sp%20ace/m.safetensors", (tmp_path / "literal.safetensors").read_bytes())
    s3_env.put(BUCKET, "sp ace/m.safetensors", (tmp_path / "spaced.safetensors").read_bytes())
    U.assert_same_dict(fst.load_file(f"s3://{BUCKET}/sp%20ace/m.safetensors"), literal)
    U.assert_same_dict(fst.load_file(f"s3://{BUCKET}/sp ace/m.safetensors"), spaced)


def test_a_compressed_answer_is_refused_saying_so(local_models, tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    _same_layout_other_values(root / "model.safetensors", 0.0)
    with FileServer(root, encoding="gzip") as server:
        with pytest.raises(RuntimeError) as e:
            fst.load_file(f"{server.url}/model.safetensors")
    message = str(e.value)
    assert "Content-Encoding: gzip, which was not asked for" in message, message
    assert "decompress it first" not in message and "\n" not in message, message


# ------------------------------------------------------------------------------ giving up a load
def _stall_after_open(server) -> None:
    server.delay = 60.0  # each answer from now on waits far past the test


def test_closing_a_remote_stream_stops_its_stalled_requests_at_once(local_models, monkeypatch):
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_PART_SIZE", "64K")
    monkeypatch.setenv("FASTSAFETENSORS_REMOTE_TIMEOUT", "120")
    with FileServer(local_models) as server:
        for leave in ("close", "drop"):
            it = fst.stream(f"{server.url}/big/model.safetensors", max_memory="4M")
            _stall_after_open(server)
            time.sleep(0.5)  # the reads are in flight, stalled
            start = time.monotonic()
            if leave == "close":
                it.close()
            else:
                del it
            took = time.monotonic() - start
            server.delay = 0.0
            assert took < 3, f"{leave}: leaving a stalled stream took {took:.1f} s"


@pytest.mark.parametrize("stalled", ["header", "data", "stream-header", "stream-data"])
def test_ctrl_c_interrupts_a_stalled_remote_load_at_once(local_models, stalled):
    """SIGINT during `load_file` (or a stream's opening or iteration) of a URL whose server
    stalls (in the GET of the header, or in those of the data): KeyboardInterrupt within a
    second or two, not when the request times out."""
    load = ("f.load_file(url)" if not stalled.startswith("stream") else
            "for name, t in f.stream(url, max_memory='4M'):\n            print(name, flush=True)")
    script = f"""
import sys
sys.path.insert(0, {str(Path(U.__file__).parent)!r})
import fastsafetensors_rs as f
from remote_servers import FileServer
with FileServer({str(local_models)!r}, delay=60) as server:
    server.delay_from = {0 if stalled.endswith("header") else 1 << 20}
    url = server.url + "/big/model.safetensors"
    print("loading", flush=True)
    try:
        {load}
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
"""
    env = {**os.environ, "FASTSAFETENSORS_REMOTE_TIMEOUT": "120", "FASTSAFETENSORS_REMOTE_PART_SIZE": "64K"}
    # SIGINT as a terminal delivers it, even where the suite runs as a background job (whose
    # commands inherit SIGINT ignored, and Python then installs no KeyboardInterrupt for it).
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "loading"
        time.sleep(2.0)  # stalled
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - start
        assert proc.returncode == 7 and "interrupted" in out, (proc.returncode, out, err)
        assert took < 3, f"Ctrl-C took {took:.1f} s to interrupt the load"
    finally:
        proc.kill()
        proc.wait()


def test_retries_wait_a_tenth_of_a_second_doubling_and_give_up_when_counted(http_server, local_models, monkeypatch):
    """The schedule docs/remote.md gives: 0.1 s before the first retry, then twice as long
    each time (at most 8 s); the count of retries is FASTSAFETENSORS_REMOTE_RETRIES."""
    ref = reference(local_models / "single" / "all.safetensors")
    with FaultProxy(http_server.server_address[1]) as proxy:
        url = f"{proxy.url}/single/all.safetensors"
        proxy.fail_next = 5
        U.assert_same_dict(fst.load_file(url), ref)
        assert proxy.failed == 5
        gaps = [b - a for a, b in zip(proxy.failed_at, proxy.failed_at[1:])]
        for gap, want in zip(gaps, [0.1, 0.2, 0.4, 0.8]):
            assert want <= gap < want + 0.3, gaps
        monkeypatch.setenv("FASTSAFETENSORS_REMOTE_RETRIES", "3")
        proxy.fail_next, proxy.failed_at = 100, []
        start = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            fst.load_file(url)
        took = time.monotonic() - start
        assert len(proxy.failed_at) == 4 and 0.7 <= took < 2.5, (proxy.failed_at, took)
        assert "503 Service Unavailable" in str(e.value) and "after 3 retries over 0." in str(e.value), e.value
        proxy.fail_next = 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: see tests/gpu")
@pytest.mark.parametrize("entry", ["load_file", "stream"])
def test_a_url_to_cuda_without_a_driver_is_the_loaders_clear_error(http_server, entry):
    """Loads of URLs wait on a thread of their own (for Ctrl-C): the error is still the
    loader's own, raised in the caller."""
    url = f"{http_server.url}/flat/a.safetensors"
    with pytest.raises(RuntimeError, match="cannot load to cuda"):
        if entry == "load_file":
            fst.load_file(url, device="cuda")
        else:
            list(fst.stream(url, device="cuda"))


# ------------------------------------------------------------------------------ verified
def test_verified_loads_from_s3_and_http_hash_what_the_gets_bring(remote, tmp_path):
    """A prefix (index and shards), a file whose header is larger than the first GET, and a
    cached load: right digests pass; a wrong one fails naming the file, with nothing returned."""
    import hashlib
    base, local = remote
    sha = lambda p: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    digests = {p.name: sha(p) for p in (local / "sharded").glob("*.safetensors")}
    verify, index = fst.Digests(digests), f"{base}/sharded/model.safetensors.index.json"
    U.assert_same_dict(fst.load(index, verify=verify), reference_dir(local / "sharded"))
    U.assert_same_dict(dict(fst.stream(index, verify=verify)), reference_dir(local / "sharded"))
    big = fst.Digests({"x.safetensors": sha(local / "bigheader" / "x.safetensors")})
    U.assert_same_dict(fst.load_file(f"{base}/bigheader/x.safetensors", verify=big),
                       reference(local / "bigheader" / "x.safetensors"))
    for _ in range(2):  # filling the cache, then from it
        U.assert_same_dict(fst.load(index, verify=verify, cache_dir=tmp_path / "cache"),
                           reference_dir(local / "sharded"))
    wrong = fst.Digests({**digests, "model-00002-of-00002.safetensors": "sha256:" + "1" * 64})
    for cache in (None, tmp_path / "cache"):
        with pytest.raises(fst.SafetensorError, match="model-00002-of-00002.safetensors: digest mismatch"):
            fst.load(index, verify=wrong, cache_dir=cache)
