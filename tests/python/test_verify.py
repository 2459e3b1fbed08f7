"""Verified loads (`verify=`): signatures made by OpenSSF model signing (`model_signing`, from
the Python registry), Hugging Face cache blob names and explicit digests, checked while the
bytes load, through every entry point; and what `model_signing verify` rejects is rejected here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastsafetensors_rs as fst
from fastsafetensors_rs import Digests, SafetensorError, Signature
from fastsafetensors_rs.weights import weights_iterator

import fst_testutils as U
from remote_servers import FileServer

model_signing = pytest.importorskip("model_signing", reason="model-signing is in requirements-dev.txt")
from cryptography.hazmat.primitives import serialization  # noqa: E402  (model_signing's dependency)
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

FILES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def _tensors(seed: int, count: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{seed}.{i}.weight": torch.randn(64, 96 + i, generator=g) for i in range(count)}


@pytest.fixture
def model(tmp_path) -> Path:
    """Two weight files (the first with a header over 4 KiB, so that its data starts past the
    first page) and a config, in a directory of their own."""
    root = tmp_path / "model"
    root.mkdir()
    save_file(_tensors(1, 120), str(root / FILES[0]), metadata={"format": "pt", "note": "aaaa"})
    save_file(_tensors(2, 6), str(root / FILES[1]), metadata={"format": "pt", "note": "aaaa"})
    (root / "config.json").write_text('{"model_type": "test"}')
    return root


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(root: Path) -> Digests:
    return Digests({name: _sha256(root / name) for name in FILES})


def _keypair(directory: Path, name: str = "key") -> tuple:
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def _sign(root: Path, private: Path, signature: Path, shards: bool = False, algorithm: str = "sha256") -> None:
    hashing = model_signing.hashing.Config()
    if shards:
        hashing = hashing.use_shard_serialization(hashing_algorithm=algorithm, shard_size=100_000)
    else:
        hashing = hashing.use_file_serialization(hashing_algorithm=algorithm)
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(
        hashing).sign(root, signature)


def _oms_verifies(root: Path, signature: Path, public: Path, shards: bool = False, algorithm: str = "sha256") -> bool:
    hashing = model_signing.hashing.Config()
    hashing = (hashing.use_shard_serialization(hashing_algorithm=algorithm, shard_size=100_000) if shards
               else hashing.use_file_serialization(hashing_algorithm=algorithm))
    try:
        model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).set_hashing_config(
            hashing).verify(root, signature)
        return True
    except Exception:  # noqa: BLE001 - any rejection
        return False


@pytest.fixture
def signed(model, tmp_path):
    """The model signed with a fresh P-256 key: (model dir, signature, public key)."""
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "model.sig"
    _sign(model, private, signature)
    return model, signature, public


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _places(path: Path) -> dict:
    """Byte offsets to flip: inside the header (a metadata value, so the header still parses),
    the first tensor's first byte, the file's last byte."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    note = data.index(b'"aaaa"') + 1
    assert note < 8 + header_len
    return {"header": note, "first tensor": 8 + header_len, "last byte": len(data) - 1}


def _entry_points(root: Path, verify) -> dict:
    """Every entry point that loads, each a callable loading the whole model."""
    paths = [str(root / name) for name in FILES]

    def opened():
        out = {}
        for p in paths:
            with fst.safe_open(p, framework="pt", verify=verify) as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    return {
        "load": lambda: fst.load(str(root), verify=verify),
        "load_file": lambda: fst.load_file(str(root), verify=verify),
        "stream": lambda: dict(fst.stream(str(root), verify=verify, max_memory="1M")),
        "safe_open": opened,
        "weights_iterator": lambda: dict(weights_iterator(paths, verify=verify)),
    }


def _expected(root: Path) -> dict:
    """The model as safetensors loads it."""
    out = {}
    for name in FILES:
        out.update(load_file(str(root / name)))
    return out


# ------------------------------------------------------------------------- explicit digests

def test_digests_verify_through_every_entry_point(model):
    expected = _expected(model)
    for name, run in _entry_points(model, _digests(model)).items():
        U.assert_same_dict(run(), expected)


@pytest.mark.parametrize("where", ["header", "first tensor", "last byte"])
def test_a_flipped_byte_fails_every_entry_point_naming_the_file(model, where):
    digests = _digests(model)
    for victim in FILES:
        original = (model / victim).read_bytes()
        _flip(model / victim, _places(model / victim)[where])
        for name, run in _entry_points(model, digests).items():
            with pytest.raises(SafetensorError, match="digest mismatch") as e:
                run()
            assert victim in str(e.value), (name, str(e.value))
            assert digests.digests[victim] in str(e.value), "the expected digest is named"
        (model / victim).write_bytes(original)


def test_digests_name_the_algorithm_and_refuse_what_they_cannot_check(model):
    blake = {n: "blake2:" + hashlib.blake2b((model / n).read_bytes()).hexdigest() for n in FILES}
    U.assert_same_dict(fst.load(str(model), verify=Digests(blake)), _expected(model))
    with pytest.raises(ValueError, match="'md5' is not supported"):
        fst.load(str(model), verify=Digests({FILES[0]: "md5:00"}))
    with pytest.raises(TypeError, match="verify= takes"):
        fst.load(str(model), verify="yes")


def test_a_file_the_manifest_does_not_list_and_one_it_lists_but_is_gone(model):
    only_first = Digests({FILES[0]: _sha256(model / FILES[0])})
    with pytest.raises(SafetensorError, match=f"{FILES[1]}: not listed in the digests given"):
        fst.load(str(model), verify=only_first)
    # A directory loaded without a file its manifest lists is short of weights: an error.
    digests = _digests(model)
    (model / FILES[1]).unlink()
    with pytest.raises(SafetensorError, match=f"{FILES[1]}: listed in the digests given, but not in the directory"):
        fst.load(str(model), verify=digests)
    # One file of it, asked for by name, is loaded and checked alone.
    assert len(fst.load_file(str(model / FILES[0]), verify=digests)) == 120


# ------------------------------------------------------------------------- partial reads

def test_a_partial_read_is_refused_or_read_whole_with_full(model):
    digests = _digests(model)
    name = "layer.1.7.weight"
    with pytest.raises(SafetensorError, match="reads only part of it: pass full=True"):
        fst.load(str(model), tensor_filter=[name], verify=digests)
    got = fst.load(str(model), tensor_filter=[name], verify=Digests(digests.digests, full=True))
    U.assert_same_dict(got, {name: _expected(model)[name]})
    # full=True still checks: the rest of the file is read and hashed.
    _flip(model / FILES[0], _places(model / FILES[0])["last byte"])
    with pytest.raises(SafetensorError, match="digest mismatch"):
        fst.load(str(model), tensor_filter=[name], verify=Digests(digests.digests, full=True))


def test_nothing_verified_is_remembered_between_loads(model):
    """docs/verify.md: every verified load hashes every byte it reads. A byte changed in place
    with the file's size and mtime put back (what a record keyed on them would miss) fails the
    next load, whichever reader and entry point reads it."""
    digests = _digests(model)
    path = model / FILES[1]
    st = path.stat()
    for load in (lambda: fst.load(str(model), verify=digests),
                 lambda: fst.load(str(model), verify=digests, reader="mmap"),
                 lambda: fst.load(str(model), verify=digests, reader="direct")):
        U.assert_same_dict(load(), _expected(model))
    with open(path, "r+b") as f:
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    for reader in ("auto", "mmap", "direct"):
        with pytest.raises(SafetensorError, match=f"{FILES[1]}: digest mismatch"):
            fst.load(str(model), verify=digests, reader=reader)
    with fst.safe_open(str(path), framework="pt", verify=digests) as f:
        with pytest.raises(SafetensorError, match="digest mismatch"):
            f.get_tensor(next(iter(f.keys())))


def test_get_slice_of_a_verified_handle(model):
    """A slice's shape comes from the header, which is checked with the file: a verified
    handle reads the file whole (and checks it) before `get_slice` returns, full=True or not."""
    digests = _digests(model)
    path = str(model / FILES[0])
    for verify in (digests, Digests(digests.digests, full=True)):
        with fst.safe_open(path, framework="pt", verify=verify) as f:
            U.assert_same_tensor(f.get_slice("layer.1.3.weight")[2:5], _expected(model)["layer.1.3.weight"][2:5])
    _flip(model / FILES[0], _places(model / FILES[0])["last byte"])
    with fst.safe_open(path, framework="pt", verify=digests) as f:
        with pytest.raises(SafetensorError, match="digest mismatch"):
            f.get_slice("layer.1.3.weight")


def test_a_verified_stream_refuses_a_selection_it_cannot_check(model):
    with pytest.raises(ValueError, match="a verified stream hands out only what it checks"):
        fst.stream(str(model), tensor_filter=["layer.1.7.weight"], verify=_digests(model))


def test_a_stream_stops_at_a_bad_file_before_any_tensor_of_the_next(model):
    digests = _digests(model)
    _flip(model / FILES[0], _places(model / FILES[0])["last byte"])
    seen = []
    with pytest.raises(SafetensorError, match=f"{FILES[0]}: digest mismatch"):
        for name, _ in fst.stream(str(model), verify=digests, max_memory="256K"):
            seen.append(name)
    assert not any(n.startswith("layer.2.") for n in seen), "a tensor of the second file was handed out"


# ------------------------------------------------------------------------- OMS signatures

def test_a_model_signing_signature_verifies_every_entry_point(signed):
    model, signature, public = signed
    assert _oms_verifies(model, signature, public)
    expected = _expected(model)
    for name, run in _entry_points(model, Signature(signature, public_key=public)).items():
        U.assert_same_dict(run(), expected)


@pytest.mark.parametrize("where", ["header", "first tensor", "last byte"])
def test_a_signed_model_with_a_flipped_byte_fails_as_model_signing_says(signed, where):
    model, signature, public = signed
    for victim in FILES:
        original = (model / victim).read_bytes()
        _flip(model / victim, _places(model / victim)[where])
        assert not _oms_verifies(model, signature, public)
        with pytest.raises(SafetensorError, match=f"{victim}: digest mismatch") as e:
            fst.load(str(model), verify=Signature(signature, public_key=public))
        assert "model.sig" in str(e.value), str(e.value)
        (model / victim).write_bytes(original)


def test_a_signature_by_another_key_or_edited_after_signing_is_rejected(signed, tmp_path):
    model, signature, public = signed
    _, other = _keypair(tmp_path / "other")
    assert not _oms_verifies(model, signature, other)
    with pytest.raises(SafetensorError, match="signature does not verify"):
        fst.load(str(model), verify=Signature(signature, public_key=other))
    # The statement edited: a digest replaced by that of other bytes.
    bundle = json.loads(signature.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"][0]["digest"] = hashlib.sha256(b"other").hexdigest()
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    edited = tmp_path / "edited.sig"
    edited.write_text(json.dumps(bundle))
    assert not _oms_verifies(model, edited, public)
    with pytest.raises(SafetensorError, match="signature does not verify"):
        fst.load(str(model), verify=Signature(edited, public_key=public))


def test_a_missing_and_an_extra_file_fail_as_model_signing_says(signed):
    model, signature, public = signed
    save_file({"x": torch.zeros(3)}, str(model / "extra.safetensors"))
    assert not _oms_verifies(model, signature, public)
    with pytest.raises(SafetensorError, match="extra.safetensors: not listed in .*model.sig"):
        fst.load(str(model), verify=Signature(signature, public_key=public))
    (model / "extra.safetensors").unlink()
    (model / FILES[1]).rename(model.parent / "moved.safetensors")
    assert not _oms_verifies(model, signature, public)
    with pytest.raises(SafetensorError, match=f"{FILES[1]}: listed in .*model.sig"):
        fst.load(str(model), verify=Signature(signature, public_key=public))


@pytest.mark.parametrize("shards,algorithm", [(True, "sha256"), (False, "blake2"), (True, "blake2")])
def test_shard_manifests_and_blake2(model, tmp_path, shards, algorithm):
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "model.sig"
    _sign(model, private, signature, shards=shards, algorithm=algorithm)
    assert _oms_verifies(model, signature, public, shards=shards, algorithm=algorithm)
    verify = Signature(signature, public_key=public)
    U.assert_same_dict(fst.load(str(model), verify=verify), _expected(model))
    U.assert_same_dict(dict(fst.stream(str(model), verify=verify, max_memory="256K")), _expected(model))
    if shards:
        # A tensor in the first 100 kB shard: only that shard is read whole and checked.
        name = "layer.1.0.weight"
        U.assert_same_dict(fst.load(str(model), tensor_filter=[name], verify=verify), {name: _expected(model)[name]})
    _flip(model / FILES[0], _places(model / FILES[0])["last byte"])
    assert not _oms_verifies(model, signature, public, shards=shards, algorithm=algorithm)
    with pytest.raises(SafetensorError, match=f"{FILES[0]}: digest mismatch"):
        fst.load(str(model), verify=verify)


def test_the_cli_checks_every_file_and_names_each_bad_one(signed):
    model, signature, public = signed
    cli = [sys.executable, "-m", "fastsafetensors_rs", "verify", "--no-progress"]
    args = ["--signature", str(signature), "--public-key", str(public), str(model)]
    ok = subprocess.run(cli + args, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "3 of 3 file(s) verified" in ok.stdout
    (model / "config.json").write_text('{"model_type": "changed"}')
    (model / "tokenizer.json").write_text("{}")
    (model / FILES[1]).unlink()
    assert not _oms_verifies(model, signature, public)
    bad = subprocess.run(cli + ["--json"] + args, capture_output=True, text=True)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    status = {f["name"]: f["status"] for f in json.loads(bad.stdout)["files"]}
    assert status == {"config.json": "changed", "tokenizer.json": "extra", FILES[1]: "missing", FILES[0]: "ok"}


# ------------------------------------------------------------------------- HF cache

def test_a_hugging_face_cache_snapshot_verifies_with_true(model, tmp_path):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in FILES:
        blob = repo / "blobs" / _sha256(model / name).split(":")[1]
        shutil.copy(model / name, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    U.assert_same_dict(fst.load(str(snapshot), verify=True), _expected(model))
    U.assert_same_dict(dict(fst.stream(str(snapshot), verify=True)), _expected(model))
    blob = (snapshot / FILES[1]).resolve()
    _flip(blob, _places(blob)["first tensor"])
    with pytest.raises(SafetensorError, match=f"{FILES[1]}: digest mismatch"):
        fst.load(str(snapshot), verify=True)
    with pytest.raises(SafetensorError, match="carries no digest"):
        fst.load(str(model), verify=True)


# ------------------------------------------------------------------------- remote and cached

def test_remote_weights_verify_against_a_signature_beside_them(signed, tmp_path):
    model, signature, public = signed
    shutil.copy(signature, model / "model.sig")
    expected = _expected(model)
    cache = tmp_path / "cache"
    with FileServer(model) as server:
        urls = [f"{server.url}/{name}" for name in FILES]
        verify = Signature(f"{server.url}/model.sig", public_key=public)
        U.assert_same_dict(fst.load(urls, verify=verify), expected)
        U.assert_same_dict(dict(fst.stream(urls, verify=verify)), expected)
        for _ in range(2):  # filling the cache, then from it
            U.assert_same_dict(fst.load(urls, verify=verify, cache_dir=cache), expected)
        _flip(model / FILES[0], _places(model / FILES[0])["last byte"])
        with pytest.raises(SafetensorError, match=f"{FILES[0]}: digest mismatch"):
            fst.load(urls, verify=verify)
        with pytest.raises(SafetensorError, match="carries no digest"):
            fst.load(urls, verify=True)


# ------------------------------------------------------------------------- integrations

def test_the_fastsafetensors_compatible_loader_verifies_each_ranks_files(model):
    digests = _digests(model)
    loader = fst.SafeTensorsFileLoader(None, "cpu", verify=digests)
    loader.add_filenames({0: [str(model / name) for name in FILES]})
    buffer = loader.copy_files_to_device()
    expected = _expected(model)
    for name in ("layer.1.0.weight", "layer.2.5.weight"):
        U.assert_same_tensor(buffer.get_tensor(name), expected[name])
    _flip(model / FILES[1], _places(model / FILES[1])["last byte"])
    loader = fst.SafeTensorsFileLoader(None, "cpu", verify=digests)
    loader.add_filenames({0: [str(model / name) for name in FILES]})
    with pytest.raises(SafetensorError, match=f"{FILES[1]}: digest mismatch"):
        loader.copy_files_to_device()


def _tiny_llama(tmp_path: Path, seed: int):
    """transformers and a tiny random Llama saved in shards of 20 KB: (transformers, its directory)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory), max_shard_size="20KB")
    return transformers, directory


def test_from_pretrained_under_the_patch_verifies_the_weights(tmp_path):
    transformers, directory = _tiny_llama(tmp_path, 7)
    weights = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(weights) > 1
    digests = Digests({name: _sha256(directory / name) for name in weights})
    stock = transformers.LlamaForCausalLM.from_pretrained(str(directory))
    with fst.patched_transformers(verify=digests):
        ours = transformers.LlamaForCausalLM.from_pretrained(str(directory))
    U.assert_same_dict(ours.state_dict(), stock.state_dict())
    _flip(directory / weights[-1], (directory / weights[-1]).stat().st_size - 1)
    with fst.patched_transformers(verify=digests):
        with pytest.raises(Exception, match=f"{weights[-1]}: digest mismatch"):
            transformers.LlamaForCausalLM.from_pretrained(str(directory))


def test_the_vllm_plugin_takes_verify_in_its_extra_config(signed):
    from fastsafetensors_rs import vllm_plugin
    model, signature, public = signed
    opts = vllm_plugin.parse_options({"verify": {"signature": str(signature), "public_key": str(public)}})
    assert isinstance(opts["verify"], Signature)
    U.assert_same_dict(dict(weights_iterator([str(model / n) for n in FILES], verify=opts["verify"])),
                       _expected(model))
    assert isinstance(vllm_plugin.parse_options({"verify": {"digests": {FILES[0]: "0" * 64}}})["verify"], Digests)
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['verify'\].*'signature' or 'digests'"):
        vllm_plugin.parse_options({"verify": {"key": "x"}})


@pytest.mark.parametrize("chain,ok", [(["root.pem"], True), (["other-root.pem"], False)])
def test_a_certificate_signature_verifies_against_its_chain_as_model_signing_says(tmp_path, chain, ok):
    """The committed fixtures (tests/data/oms/README.md): a model signed with
    `model_signing sign certificate` under root.pem; another root under the same name fails."""
    data = Path(__file__).resolve().parents[1] / "data" / "oms"
    model = tmp_path / "model"
    shutil.copytree(data / "model", model)
    chain = [str(data / c) for c in chain]
    try:
        model_signing.verifying.Config().use_certificate_verifier(certificate_chain=chain).verify(
            model, data / "cert.sig")
        theirs = True
    except Exception:  # noqa: BLE001 - any rejection
        theirs = False
    assert theirs == ok
    verify = Signature(data / "cert.sig", certificate_chain=chain)
    if ok:
        got = fst.load(str(model / "model.safetensors"), verify=verify)
        U.assert_same_dict(got, load_file(str(model / "model.safetensors")))
        _flip(model / "model.safetensors", (model / "model.safetensors").stat().st_size - 1)
        with pytest.raises(SafetensorError, match="model.safetensors: digest mismatch"):
            fst.load(str(model / "model.safetensors"), verify=verify)
    else:
        with pytest.raises(SafetensorError, match="signature does not verify"):
            fst.load(str(model / "model.safetensors"), verify=verify)


# ------------------------------------------------------- nothing unsigned is ever handed out

def _swap_offsets(path: Path, a: str, b: str) -> None:
    """Swaps the data offsets of tensors `a` and `b` (of the same size) in the header, in place:
    the header keeps its length and still parses, and each name now places the other's bytes."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    text = data[8:8 + n].decode()
    oa, ob = (json.dumps(header[k]["data_offsets"], separators=(",", ":")) for k in (a, b))
    assert text.count(oa) == 1 and text.count(ob) == 1, (oa, ob)
    text = text.replace(oa, "\0").replace(ob, oa).replace("\0", ob)
    data[8:8 + n] = text.encode()
    path.write_bytes(bytes(data))


def _sign_shards(root: Path, tmp_path: Path, shard_size: int) -> tuple:
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "shards.sig"
    hashing = model_signing.hashing.Config().use_shard_serialization(shard_size=shard_size)
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(
        hashing).sign(root, signature)
    return signature, public


def _oms_verifies_shards(root: Path, signature: Path, public: Path, shard_size: int) -> bool:
    hashing = model_signing.hashing.Config().use_shard_serialization(shard_size=shard_size)
    try:
        model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).set_hashing_config(
            hashing).verify(root, signature)
        return True
    except Exception:  # noqa: BLE001 - any rejection
        return False


def test_a_partial_read_checks_the_header_of_a_shard_manifest(tmp_path):
    """Swapping the data offsets of two same-size tensors in the header (same length, still
    parses) of a shard-signed file: a load of one tensor, a slice of it, and full=True all
    fail, as model_signing does; the header's shard is part of every check."""
    root = tmp_path / "model"
    root.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = {name: torch.randn(4000, generator=g) for name in ("a", "x", "pad", "y")}
    save_file(tensors, str(root / "model.safetensors"))
    signature, public = _sign_shards(root, tmp_path, shard_size=8192)
    path = root / "model.safetensors"
    verify = Signature(signature, public_key=public)
    U.assert_same_tensor(fst.load(str(path), tensor_filter="x", verify=verify)["x"], tensors["x"])
    _swap_offsets(path, "x", "y")
    assert not _oms_verifies_shards(root, signature, public, 8192)
    assert torch.equal(load_file(str(path))["x"], tensors["y"]), "the edit makes x name y's bytes"
    for v in (verify, Signature(signature, public_key=public, full=True)):
        with pytest.raises(SafetensorError, match="model.safetensors: digest mismatch \\(bytes 0\\.\\.8192\\)"):
            fst.load(str(path), tensor_filter="x", verify=v)
        with pytest.raises(SafetensorError, match="digest mismatch"):
            with fst.safe_open(str(path), framework="pt", verify=v) as f:
                f.get_slice("x")[:10]
        with pytest.raises(SafetensorError, match="digest mismatch"):
            dict(fst.stream(str(path), verify=v))


@pytest.mark.parametrize("reader", [None, "mmap", "direct"])
def test_verified_tensors_do_not_change_when_the_file_is_written_after(model, reader):
    """A verified tensor's bytes are those hashed, in memory the load owns: writing into the
    file in place afterwards (the page cache, which a mapping would share) changes nothing
    handed out, through every entry point."""
    digests = _digests(model)
    last = model / FILES[1]
    name = "layer.2.5.weight"
    original = _expected(model)[name].clone()  # safetensors may hand out a view of its mapping
    last.read_bytes()  # in the page cache: the reader a warm, unverified load would map
    got = {
        "load": fst.load(str(model), verify=digests, reader=reader)[name],
        "load_file": fst.load_file(str(last), verify=digests)[name],
        "stream": dict(fst.stream(str(model), verify=digests, reader=reader, max_memory="1M"))[name],
    }
    with fst.safe_open(str(last), framework="pt", verify=digests) as f:
        got["safe_open"] = f.get_tensor(name)
    with open(last, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(struct.pack("<f", 123.0))
        f.flush()
        os.fsync(f.fileno())
    assert load_file(str(last))[name][-1, -1].item() == 123.0, "the file was written"
    for how, tensor in got.items():
        assert tensor[-1, -1].item() == original[-1, -1].item(), f"{how}: a verified tensor changed"
        U.assert_same_tensor(tensor, original)


def test_a_stream_hands_out_no_second_copy_the_server_sent_differently(model):
    """Consecutive groups of a stream share a page, read twice; a server that answers the
    second request for those bytes differently must not reach a tensor: the stream fails
    naming the bytes, or every tensor is the signed one."""
    digests = _digests(model)
    expected = _expected(model)
    with FileServer(model) as server:
        server.lie_on_rereads = True
        url = f"{server.url}/{FILES[0]}"
        try:
            got = dict(fst.stream(url, verify=digests, max_memory="64K"))
        except SafetensorError as e:
            assert "were read twice and the copies differ" in str(e) or "digest mismatch" in str(e), e
        else:
            wrong = [n for n in got if not torch.equal(got[n], expected[n])]
            assert not wrong, f"tensors from bytes never hashed: {wrong[:5]}"
        assert server.lies > 0, "the server sent some bytes twice, the second time changed"


def _diffusers_like(tmp_path: Path) -> Path:
    """A repository of several models in subfolders, as diffusers lays them out."""
    repo = tmp_path / "repo"
    for sub, seed, files in (("transformer", 1, 2), ("unet", 2, 1), ("vae", 3, 1)):
        (repo / sub).mkdir(parents=True)
        for k in range(files):
            name = f"diffusion_pytorch_model-{k + 1:05d}-of-{files:05d}.safetensors" if files > 1 else \
                "diffusion_pytorch_model.safetensors"
            save_file(_tensors(seed * 10 + k, 3), str(repo / sub / name))
        (repo / sub / "config.json").write_text("{}")
    (repo / "model_index.json").write_text("{}")
    return repo


def test_completeness_is_judged_in_the_directory_loaded(tmp_path):
    """A signed repository with subfolders: an untouched subfolder loads; one whose signed
    shard was deleted is refused naming it, as model_signing refuses the repository."""
    repo = _diffusers_like(tmp_path)
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "repo.sig"
    _sign(repo, private, signature)
    verify = Signature(signature, public_key=public)
    unet = fst.load(str(repo / "unet"), verify=verify)
    U.assert_same_dict(unet, load_file(str(repo / "unet" / "diffusion_pytorch_model.safetensors")))
    assert len(fst.load(str(repo / "transformer"), verify=verify)) == 6
    gone = "diffusion_pytorch_model-00002-of-00002.safetensors"
    (repo / "transformer" / gone).unlink()
    assert not _oms_verifies(repo, signature, public)
    with pytest.raises(SafetensorError, match=f"transformer/{gone}: listed in .*, but not in the directory loaded"):
        fst.load(str(repo / "transformer"), verify=verify)
    with pytest.raises(SafetensorError, match=f"{gone}: listed in"):
        dict(fst.stream(str(repo / "transformer"), verify=verify))


def test_an_index_is_checked_and_a_mistral_style_directory_loads(tmp_path, model):
    """A listed index is checked like any listed file (it chooses the files); a directory with
    an index beside a consolidated file (Mistral's layout) loads the index's shards."""
    index = {"metadata": {}, "weight_map": {}}
    for name in FILES:
        for key in load_file(str(model / name)):
            index["weight_map"][key] = name
    (model / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    save_file(_tensors(9, 2), str(model / "consolidated.safetensors"))
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "mistral.sig"
    _sign(model, private, signature)
    verify = Signature(signature, public_key=public)
    U.assert_same_dict(fst.load(str(model), verify=verify), _expected(model))
    # The index edited to drop the second shard (and the shard deleted): refused.
    for key in [k for k, v in index["weight_map"].items() if v == FILES[1]]:
        del index["weight_map"][key]
    (model / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (model / FILES[1]).unlink()
    assert not _oms_verifies(model, signature, public)
    with pytest.raises(SafetensorError, match="model.safetensors.index.json: digest mismatch"):
        fst.load(str(model), verify=verify)


def test_from_pretrained_refuses_a_signed_shard_deleted_and_the_index_edited(tmp_path):
    transformers, directory = _tiny_llama(tmp_path, 8)
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "llama.sig"
    _sign(directory, private, signature)
    verify = Signature(signature, public_key=public)
    stock = transformers.LlamaForCausalLM.from_pretrained(str(directory))
    with fst.patched_transformers(verify=verify):
        U.assert_same_dict(transformers.LlamaForCausalLM.from_pretrained(str(directory)).state_dict(),
                           stock.state_dict())
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index_path.write_text(json.dumps(index, indent=2))
    (directory / shard).unlink()
    assert not _oms_verifies(directory, signature, public)
    with fst.patched_transformers(verify=verify):
        with pytest.raises(Exception, match="model.safetensors.index.json: digest mismatch"):
            transformers.LlamaForCausalLM.from_pretrained(str(directory))


def test_safe_open_returns_nothing_of_an_unverified_header(tmp_path):
    """Metadata, names, shapes and dtypes come from the header, which is checked with the
    file before any of them is returned."""
    root = tmp_path / "model"
    root.mkdir()
    w = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    save_file({"w": w}, str(root / "model.safetensors"), metadata={"quant": "none"})
    private, public = _keypair(tmp_path / "keys")
    signature = tmp_path / "model.sig"
    _sign(root, private, signature)
    verify = Signature(signature, public_key=public)
    path = root / "model.safetensors"
    with fst.safe_open(str(path), framework="pt", verify=verify) as f:
        assert f.metadata() == {"quant": "none"}
        assert f.get_slice("w").get_shape() == [4, 2]
    good = path.read_bytes()
    for old, new, accessor in [(b'"none"', b'"int4"', lambda f: f.metadata()),
                               (b"[4,2]", b"[2,4]", lambda f: f.get_slice("w").get_shape()),
                               (b"[4,2]", b"[2,4]", lambda f: f.keys())]:
        path.write_bytes(good.replace(old, new, 1))
        assert not _oms_verifies(root, signature, public)
        with fst.safe_open(str(path), framework="pt", verify=verify) as f:
            with pytest.raises(SafetensorError, match="model.safetensors: digest mismatch"):
                accessor(f)
