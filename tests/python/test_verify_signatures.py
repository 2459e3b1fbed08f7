"""Signatures model_signing 1.1.1 verifies, verified here as it verifies them: certificate
chains judged by OpenSSL's rules (a CA signing certificate, a root's dates), signatures of a
single file, the paths a signature leaves out, the formats of older releases; and the trust
files a verification reads (a FIFO, a device, a directory, a file too large) refused in one
line, never waited on. Each verdict is compared with `model_signing verify` on the same input.
The signatures are made here with model_signing 1.1.1, or are the committed fixtures of
tests/data/oms (older releases' formats)."""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastsafetensors_rs as fst
from fastsafetensors_rs import SafetensorError, Signature

import fst_testutils as U
from remote_servers import FileServer

model_signing = pytest.importorskip("model_signing", reason="model-signing is in requirements-dev.txt")
from cryptography import x509  # noqa: E402  (model_signing's dependency)
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "oms"
WEIGHTS = "model.safetensors"


def _pem(path: Path, obj) -> Path:
    if isinstance(obj, x509.Certificate):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    elif isinstance(obj, ec.EllipticCurvePrivateKey):
        path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    else:
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.fixture
def model(tmp_path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    save_file({"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}, str(root / WEIGHTS))
    (root / "config.json").write_text('{"model_type": "test"}')
    return root


@pytest.fixture
def keys(tmp_path) -> tuple:
    """A P-256 key pair: (private PEM, public PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "keys").mkdir()
    return _pem(tmp_path / "keys" / "key.pem", key), _pem(tmp_path / "keys" / "key.pub", key.public_key())


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "verify", "--no-progress", *map(str, args)],
                          capture_output=True, text=True, env=U.subprocess_env(), cwd=cwd, timeout=120)


def _model_signing(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_signing", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def _ms_verifies(kind: str, *args: str, cwd=None) -> bool:
    """`model_signing verify KIND ARGS` succeeds."""
    return _model_signing("verify", kind, *args, cwd=cwd).returncode == 0


def _flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------- item 9: trust files

_OPEN = """
import sys, fastsafetensors_rs as fst
kind, model, sig, trust = sys.argv[1:5]
try:
    if kind == "key":
        v = fst.Signature(sig, public_key=trust)
    elif kind == "chain":
        v = fst.Signature(sig, certificate_chain=trust)
    else:
        v = fst.Signature(sig, trusted_root=trust, identity="me@example.com", issuer="https://issuer")
    fst.load(model, verify=v)
    print("LOADED")
except Exception as e:
    print(type(e).__name__, e, sep=": ")
"""


def test_trust_files_are_regular_files_of_bounded_size_refused_in_one_line_never_waited_on(model, keys, tmp_path):
    private, public = keys
    signature = tmp_path / "model.sig"
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).sign(model, signature)
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    big = tmp_path / "big.pem"
    big.write_bytes(b"-----BEGIN PUBLIC KEY-----\n" + b"A" * (2 << 20))
    weights, fixture = model / WEIGHTS, DATA / "model" / WEIGHTS
    cases = []  # (kind, weights, signature, trust, the file refused, why)
    for bad, why in [(fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                     (tmp_path, "not a regular file"), (big, "too large for a PEM key or certificate file")]:
        cases += [("key", weights, signature, bad, bad, why), ("chain", fixture, DATA / "cert.sig", bad, bad, why)]
        if bad != big:  # 2 MiB is a signature's size: read, and not a bundle
            cases.append(("key", weights, bad, public, bad, why))
    for kind, path, sig, trust, bad, why in cases:
        # A subprocess with a time limit: a load that waits on a FIFO fails the test, not the run.
        out = U.check_output(U.run_python(_OPEN, kind, path, sig, trust, timeout=60)).strip()
        assert len(out.splitlines()) == 1, out
        assert out.startswith(f"SafetensorError: {bad}: ") and why in out, (kind, sig, trust, out)
    # A signature file past 64 MiB (sparse: nothing is written), local and at a URL: refused by
    # its size before it is read.
    huge = tmp_path / "served" / "huge.sig"
    huge.parent.mkdir()
    with open(huge, "wb") as f:
        f.truncate((64 << 20) + 1)
    why = f"{(64 << 20) + 1} bytes or more: too large for a signature (at most {64 << 20} bytes are read)"
    out = U.check_output(U.run_python(_OPEN, "key", weights, huge, public, timeout=60)).strip()
    assert out == f"SafetensorError: {huge}: {why}", out
    with FileServer(huge.parent) as server:
        url = f"{server.url}/huge.sig"
        out = U.check_output(U.run_python(_OPEN, "key", weights, url, public, timeout=60)).strip()
        assert out == f"SafetensorError: {url}: {why}", out
        assert server.sent <= (1 << 20), server.sent  # the first GET's bytes at most, not 64 MiB
    # A keyless bundle's trusted root, a FIFO: refused, not waited on.
    keyless = DATA.parent / "sigstore" / "good.sig"
    out = U.check_output(U.run_python(_OPEN, "root", fixture, keyless, fifo, timeout=60)).strip()
    assert out.startswith(f"SafetensorError: {fifo}: ") and "not a regular file" in out, out
    # The key itself verifies.
    assert "LOADED" in U.check_output(U.run_python(_OPEN, "key", weights, signature, public, timeout=60))


# ------------------------------------------------------------------------- item 10: chains

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, start, end, ca, ku, eku=None) -> x509.Certificate:
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(end)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    flags = dict.fromkeys(["digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                           "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"], False)
    flags.update(dict.fromkeys(ku, True))
    b = b.add_extension(x509.KeyUsage(**flags), critical=True)
    if eku:
        b = b.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _sign_under(model: Path, pki: Path, inter_key, now: datetime.datetime, leaf_ca: bool) -> Path:
    """`model` signed with model_signing by a new code-signing certificate ("test signer",
    a CA too where `leaf_ca`) that `pki/inter.pem` issued, that certificate in the chain: the
    signature's path (`pki/../model.sig`)."""
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    day = datetime.timedelta(days=1)
    _pem(pki / "leaf.pem", _cert("test signer", leaf_key, "test intermediate", inter_key, now - day, now + 90 * day,
                                 leaf_ca, ["digital_signature"], [ExtendedKeyUsageOID.CODE_SIGNING]))
    _pem(pki / "leaf.key", leaf_key)
    signature = pki.parent / "model.sig"
    model_signing.signing.Config().use_certificate_signer(
        private_key=pki / "leaf.key", signing_certificate=pki / "leaf.pem",
        certificate_chain=[pki / "inter.pem"]).sign(model, signature)
    return signature


def test_certificate_chains_as_openssl_judges_them_a_ca_signing_certificate_and_the_roots_dates(model, tmp_path):
    day = datetime.timedelta(days=1)
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    pki = tmp_path / "pki"
    pki.mkdir()
    root_key, inter_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(2))
    roots = {  # the same key and name, valid at other times around the signing time (the leaf's notBefore)
        "root.pem": (now - 900 * day, now + 900 * day, True),
        "root-expired.pem": (now - 900 * day, now - 30 * day, False),
        "root-not-yet.pem": (now + 30 * day, now + 900 * day, False),
    }
    for name, (start, end, _) in roots.items():
        _pem(pki / name, _cert("test root", root_key, "test root", root_key, start, end, True, ["key_cert_sign"]))
    _pem(pki / "inter.pem", _cert("test intermediate", inter_key, "test root", root_key, now - 800 * day,
                                  now + 800 * day, True, ["key_cert_sign"]))
    # A signing certificate that is a CA too (model_signing's own test PKI has one).
    signature = _sign_under(model, pki, inter_key, now, leaf_ca=True)
    expected = load_file(str(model / WEIGHTS))
    for root, (_, _, ok) in roots.items():
        theirs = _ms_verifies("certificate", model, "--signature", signature, "--certificate_chain", pki / root)
        assert theirs == ok, root
        verify = Signature(signature, certificate_chain=pki / root)  # one file, as a path
        ours = _cli(model, "--signature", signature, "--certificate_chain", pki / root)
        assert (ours.returncode == 0) == ok, ours.stdout + ours.stderr
        if ok:
            U.assert_same_dict(fst.load(str(model), verify=verify), expected)
        else:
            why = "expired at" if "expired" in root else "is valid from"
            with pytest.raises(SafetensorError, match=f"signature does not verify: .*certificate 'CN=test root' {why}"):
                fst.load(str(model), verify=verify)


@pytest.mark.parametrize("extension", ["unknown-critical", "unknown-not-critical", "name-constraints"])
def test_an_intermediates_extensions_as_openssl_acts_on_them(model, tmp_path, extension):
    """A critical extension OpenSSL does not know fails the chain, for model_signing and here;
    the same extension not critical is passed over by both. Name constraints are not checked
    here: a chain with them is refused as unsupported, never accepted unchecked."""
    day = datetime.timedelta(days=1)
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    root_key, inter_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(2))
    private = x509.ObjectIdentifier("1.3.6.1.4.1.55555.7")
    inter = (x509.CertificateBuilder().subject_name(_name("test intermediate")).issuer_name(_name("test root"))
             .public_key(inter_key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - 800 * day).not_valid_after(now + 800 * day)
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True))
    if extension == "name-constraints":
        inter = inter.add_extension(x509.NameConstraints(
            permitted_subtrees=[x509.DNSName("example.com")], excluded_subtrees=None), critical=True)
    else:
        inter = inter.add_extension(x509.UnrecognizedExtension(private, b"\x05\x00"),
                                    critical=extension == "unknown-critical")
    pki = tmp_path / "pki"
    pki.mkdir()
    _pem(pki / "root.pem", _cert("test root", root_key, "test root", root_key, now - 900 * day, now + 900 * day,
                                 True, ["key_cert_sign"]))
    _pem(pki / "inter.pem", inter.sign(root_key, hashes.SHA256()))
    signature = _sign_under(model, pki, inter_key, now, leaf_ca=False)
    verify = Signature(signature, certificate_chain=pki / "root.pem")
    theirs = _ms_verifies("certificate", model, "--signature", signature, "--certificate_chain", pki / "root.pem")
    if extension == "unknown-not-critical":
        assert theirs
        U.assert_same_dict(fst.load(str(model), verify=verify), load_file(str(model / WEIGHTS)))
        return
    if extension == "unknown-critical":
        assert not theirs
        why = "certificate 'CN=test intermediate' has a critical extension OpenSSL does not know (1.3.6.1.4.1.55555.7)"
    else:
        # model_signing accepts it (the signer's name is no DNS name, so OpenSSL finds nothing
        # to constrain): refusing it here is the stricter verdict, as docs/verify.md says.
        assert theirs
        why = "certificate 'CN=test intermediate' has name constraints, which are not checked here"
    with pytest.raises(SafetensorError, match=re.escape(why)) as raised:
        fst.load(str(model), verify=verify)
    assert str(signature) in str(raised.value), raised.value
    ours = _cli(model, "--signature", signature, "--certificate_chain", pki / "root.pem")
    assert ours.returncode != 0 and why in ours.stdout + ours.stderr, ours.stdout + ours.stderr


def test_certificate_chain_takes_one_file_as_a_string_or_a_path():
    for chain in ["root.pem", Path("root.pem")]:
        assert Signature("m.sig", certificate_chain=chain).certificate_chain == ["root.pem"]
    assert Signature("m.sig", certificate_chain=("a.pem", "b.pem")).certificate_chain == ["a.pem", "b.pem"]
    # The committed fixture: its chain given as one string loads.
    verify = Signature(DATA / "cert.sig", certificate_chain=str(DATA / "root.pem"))
    U.assert_same_dict(fst.load(str(DATA / "model" / WEIGHTS), verify=verify), load_file(str(DATA / "model" / WEIGHTS)))


# ------------------------------------------------------------------------- item 11: single files

def test_a_signature_of_a_single_file(model, keys, tmp_path):
    private, public = keys
    weights = model / WEIGHTS
    signature = tmp_path / "file.sig"
    assert _model_signing("sign", "key", weights, "--private_key", private, "--signature", signature).returncode == 0
    expected = load_file(str(weights))
    # The file, and the same bytes under another name: model_signing names the file '.'.
    renamed = tmp_path / "renamed.safetensors"
    shutil.copy(weights, renamed)
    for path in [weights, renamed]:
        assert _ms_verifies("key", path, "--signature", signature, "--public_key", public)
        U.assert_same_dict(fst.load(str(path), verify=Signature(signature, public_key=public)), expected)
        ours = _cli(path, "--signature", signature, "--public_key", public)
        assert ours.returncode == 0 and f"ok         {path.name}" in ours.stdout, ours.stdout + ours.stderr
    # Not a directory, nor two files at once.
    assert not _ms_verifies("key", model, "--signature", signature, "--public_key", public)
    assert _cli(model, "--signature", signature, "--public_key", public).returncode == 1
    other = tmp_path / "other.safetensors"
    save_file({"z": torch.zeros(4)}, str(other))
    with pytest.raises(SafetensorError, match="a signature of a single file checks a load of that one file"):
        fst.load([str(weights), str(other)], verify=Signature(signature, public_key=public))
    # One flipped byte: refused by both, naming the file.
    _flip(renamed)
    assert not _ms_verifies("key", renamed, "--signature", signature, "--public_key", public)
    with pytest.raises(SafetensorError, match="renamed.safetensors: digest mismatch"):
        fst.load(str(renamed), verify=Signature(signature, public_key=public))
    ours = _cli(renamed, "--signature", signature, "--public_key", public)
    assert ours.returncode == 1 and "changed    renamed.safetensors" in ours.stdout, ours.stdout


# ------------------------------------------------------------------------- items 11, 13: older releases

@pytest.mark.parametrize("sig,kind,trust,path", [
    ("v1.0.0-single.sig", "key", "key.pub", WEIGHTS),   # model_signing 1.0.0: a single file, rawBytes key
    ("v1.0.0-key.sig", "key", "key.pub", "."),          # its older verification material, of the model
    ("v0.2.0-cert.sig", "certificate", "root.pem", "."),  # model_signing 0.2.0: a v0.1 statement
    ("v0.2.0-key.sig", "key", "key.pub", "."),
])
def test_signatures_of_older_releases_verify_as_model_signing_verifies_them(tmp_path, sig, kind, trust, path):
    model = tmp_path / "model"
    shutil.copytree(DATA / "model", model)
    target = model / path
    option = "--public_key" if kind == "key" else "--certificate_chain"
    args = [target, "--signature", DATA / sig, option, DATA / trust]
    assert _ms_verifies(kind, *args)
    ours = _cli(*args)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    verify = Signature(DATA / sig, **{"public_key" if kind == "key" else "certificate_chain": DATA / trust})
    U.assert_same_dict(fst.load(str(model / WEIGHTS), verify=verify), load_file(str(model / WEIGHTS)))
    _flip(model / WEIGHTS)
    assert not _ms_verifies(kind, *args)
    assert _cli(*args).returncode == 1
    with pytest.raises(SafetensorError, match=f"{WEIGHTS}: digest mismatch"):
        fst.load(str(model / WEIGHTS), verify=verify)


# ------------------------------------------------------------------------- item 12: ignore_paths

def test_ignored_paths_as_the_signature_records_them_and_as_the_cli_is_given_them(model, keys, tmp_path):
    private, public = keys
    (model / "ignore-me").write_text("notes")
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    signature = model / "model.sig"  # inside the model, as model_signing's own tests keep it
    sign = ["sign", "key", model, "--private_key", private, "--signature", signature]
    assert _model_signing(*sign, "--ignore-paths", model / "ignore-me").returncode == 0
    verify = ["--signature", signature, "--public_key", public]
    # An edited ignored file: neither calls it extra.
    (model / "ignore-me").write_text("edited")
    assert _ms_verifies("key", model, *verify)
    ours = _cli(model, *verify)
    assert ours.returncode == 0 and "2 of 2 file(s) verified" in ours.stdout, ours.stdout + ours.stderr
    # A file added later, named with --ignore-paths at verify time (relative to the working
    # directory, as model_signing resolves it), in either spelling.
    (model / "added.txt").write_text("x")
    assert not _ms_verifies("key", model, *verify)
    assert _cli(model, *verify).returncode == 1
    for option in ["--ignore-paths", "--ignore_paths"]:
        assert _ms_verifies("key", "model", *verify, "--ignore-paths", "model/added.txt", cwd=tmp_path)
        ours = _cli("model", *verify, option, "model/added.txt", cwd=tmp_path)
        assert ours.returncode == 0, ours.stdout + ours.stderr
    (model / "added.txt").unlink()
    # Signed with git's files: .git/HEAD is listed, and checked, not missing.
    assert _model_signing(*sign, "--no-ignore-git-paths").returncode == 0
    assert _ms_verifies("key", model, *verify, "--no-ignore-git-paths")
    ours = _cli(model, *verify)
    assert ours.returncode == 0 and "ok         .git/HEAD" in ours.stdout, ours.stdout + ours.stderr
    (model / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    assert not _ms_verifies("key", model, *verify, "--no-ignore-git-paths")
    ours = _cli(model, *verify)
    assert ours.returncode == 1 and "changed    .git/HEAD" in ours.stdout, ours.stdout


def test_the_cli_takes_model_signings_verify_arguments(model, keys, tmp_path):
    """`model_signing verify key ARGS` as `fastsafetensors-rs verify ARGS`, and the certificate
    form with the committed fixtures."""
    private, public = keys
    signature = tmp_path / "model.sig"
    assert _model_signing("sign", "key", model, "--private_key", private, "--signature", signature).returncode == 0
    args = [model, "--signature", signature, "--public_key", public]
    assert _ms_verifies("key", *args)
    assert _cli(*args).returncode == 0
    assert _cli("--signature", signature, "--public-key", public, model).returncode == 0  # our spelling
    fixture = tmp_path / "fixture"
    shutil.copytree(DATA / "model", fixture)
    args = [fixture, "--signature", DATA / "cert.sig", "--certificate_chain", DATA / "root.pem"]
    assert _ms_verifies("certificate", *args)
    assert _cli(*args).returncode == 0
    args = [fixture, "--signature", DATA / "cert.sig", "--certificate_chain", DATA / "other-root.pem"]
    assert not _ms_verifies("certificate", *args)
    assert _cli(*args).returncode == 1


# ------------------------------------------------------------------------- genuine inputs

def test_allow_symlinks_false_refuses_a_linked_file_as_model_signing_does(model, keys, tmp_path):
    private, public = keys
    signature = tmp_path / "model.sig"
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).sign(model, signature)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(model / WEIGHTS, elsewhere)
    (model / WEIGHTS).symlink_to(elsewhere)
    verify = ["--signature", signature, "--public_key", public]
    assert not _ms_verifies("key", model, *verify)
    with pytest.raises(SafetensorError, match=f"{WEIGHTS}: a symbolic link, and .* records allow_symlinks=false"):
        fst.load(str(model), verify=Signature(signature, public_key=public))
    ours = _cli(model, *verify)
    assert ours.returncode == 1 and f"symlink    {WEIGHTS}" in ours.stdout, ours.stdout
    # Links followed when asked, as model_signing's --allow_symlinks does.
    assert _ms_verifies("key", model, *verify, "--allow_symlinks")
    assert _cli(model, *verify, "--allow_symlinks").returncode == 0
    U.assert_same_dict(fst.load(str(model), verify=Signature(signature, public_key=public, allow_symlinks=True)),
                       load_file(str(elsewhere)))


def test_hugging_face_cache_links_from_a_snapshot_subfolder(model, tmp_path):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    folder = repo / "snapshots" / "0123abcd" / "transformer"
    folder.mkdir(parents=True)
    blob = repo / "blobs" / hashlib.sha256((model / WEIGHTS).read_bytes()).hexdigest()
    shutil.copy(model / WEIGHTS, blob)
    (folder / WEIGHTS).symlink_to(os.path.relpath(blob, folder))  # ../../../blobs/<sha256>
    assert os.readlink(folder / WEIGHTS).startswith("../../../blobs/")
    U.assert_same_dict(fst.load(str(folder), verify=True), load_file(str(model / WEIGHTS)))
    _flip(blob)
    with pytest.raises(SafetensorError, match=f"{WEIGHTS}: digest mismatch"):
        fst.load(str(folder), verify=True)


def test_the_same_signed_bytes_at_a_url_with_a_query(model, keys):
    private, public = keys
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).sign(model, model / "model.sig")
    expected = load_file(str(model / WEIGHTS))
    with FileServer(model) as server:
        verify = Signature(f"{server.url}/model.sig?v=2", public_key=public)
        for query in ["?v=2", "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=0f%2Fab", "#part"]:
            U.assert_same_dict(fst.load(f"{server.url}/{WEIGHTS}{query}", verify=verify), expected)


# ------------------------------------------------------------------------- model_signing's own signatures

REFERENCE = os.environ.get("FST_MODEL_TRANSPARENCY_TESTS")


@pytest.mark.skipif(not REFERENCE, reason="FST_MODEL_TRANSPARENCY_TESTS names model_signing's scripts/tests folder "
                                          "(sigstore/model-transparency), whose files are not ours to ship")
def test_model_signings_own_key_and_certificate_signatures(tmp_path):
    """The 9 key and certificate signatures of model_signing's repository, verified as its
    test-verify-*.sh scripts do; then one flipped byte in each, refused naming the file."""
    tests = tmp_path / "tests"
    shutil.copytree(REFERENCE, tests)
    key, ca = "keys/certificate/signing-key-pub.pem", "keys/certificate/ca-cert.pem"
    runs = []
    for version in ["v0.2.0", "v0.3.1", "v1.0.0", "v1.0.1", "v1.1.0"]:
        ignore = ["--ignore-paths", f"./{version}-certificate/ignore-me"] if version >= "v1.0.1" else []
        runs.append(("certificate", f"{version}-certificate", "signme-1",
                     [*ignore, "--signature", f"./{version}-certificate/model.sig", "--certificate_chain", ca,
                      f"./{version}-certificate/"]))
        if version == "v0.2.0":
            continue
        single = version in ("v0.3.1", "v1.0.0")  # v0.x and v1.0.0 signed one file
        ignore = [] if single else ["--ignore-paths", f"./{version}-elliptic-key/ignore-me"]
        runs.append(("key", f"{version}-elliptic-key", "signme-1",
                     [*ignore, "--signature", f"./{version}-elliptic-key/model.sig", "--public_key", key,
                      f"./{version}-elliptic-key" + ("/signme-1" if single else "")]))
    assert len(runs) == 9
    for kind, name, _, args in runs:
        assert _ms_verifies(kind, *args, cwd=tests), name
        ours = _cli(*args, cwd=tests)
        assert ours.returncode == 0, f"{name}: {ours.stdout}{ours.stderr}"
    for kind, name, signed, args in runs:
        _flip(tests / name / signed, 0)
        assert not _ms_verifies(kind, *args, cwd=tests), name
        ours = _cli(*args, cwd=tests)
        assert ours.returncode == 1 and f"changed    {signed}" in ours.stdout, f"{name}: {ours.stdout}"
