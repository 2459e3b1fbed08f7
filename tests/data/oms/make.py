"""The fixtures of rust/verify/oms.rs, made with model_signing 1.1.1 and cryptography, and the
formats of older releases with model_signing 0.2.0 and 1.0.0.

Run by make.sh (which says the order): `make.py model`, `make.py certs TMP`, `make.py api TMP`,
`make.py v020 TMP` and `make.py v100 TMP` (each with its release's Python), `make.py check`.
TMP holds the private keys, which are not kept.
"""

import base64
import datetime
import hashlib
import json
import pathlib
import struct
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
import model_signing

INTOTO = "application/vnd.in-toto+json"


def H():
    """A hashing configuration of model_signing 1.x."""
    return model_signing.hashing.Config()


def model():
    d = pathlib.Path("model")
    (d / "sub").mkdir(parents=True, exist_ok=True)
    # A safetensors file of 2,488 bytes: 600 float32 values, so 1,000-byte shards give three.
    header = json.dumps({"w": {"dtype": "F32", "shape": [600], "data_offsets": [0, 2400]}})
    header = header.encode() + b" " * (-len(header) % 8)
    data = b"".join(struct.pack("<f", i * 0.5) for i in range(600))
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    (d / "config.json").write_text('{"model_type": "tiny", "hidden_size": 600}\n')
    (d / "sub" / "notes.txt").write_text("a tiny model for the signature tests\n")


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, start, end, ca, ku=None, eku=None, pathlen=None):
    """A certificate valid from `start` to `end` (tuples: year, month, day[, hour...], UTC)."""
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(*start, tzinfo=datetime.timezone.utc))
        .not_valid_after(datetime.datetime(*end, tzinfo=datetime.timezone.utc))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=pathlen), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ku:
        flags = dict.fromkeys(
            [
                "digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only",
            ],
            False,
        )
        flags.update(dict.fromkeys(ku, True))
        b = b.add_extension(x509.KeyUsage(**flags), critical=True)
    if eku:
        b = b.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    alg = hashes.SHA384() if issuer_key.curve.key_size == 384 else hashes.SHA256()
    return b.sign(issuer_key, alg)


def _pem(path, *objs):
    out = b""
    for o in objs:
        if isinstance(o, x509.Certificate):
            out += o.public_bytes(serialization.Encoding.PEM)
        elif isinstance(o, ec.EllipticCurvePrivateKey):
            out += o.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        else:
            out += o.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    pathlib.Path(path).write_bytes(out)


def certs(tmp):
    tmp = pathlib.Path(tmp)
    root_key = ec.generate_private_key(ec.SECP384R1())
    root = _cert("OMS test root", root_key, "OMS test root", root_key, (2020, 1, 1), (2045, 1, 1), True,
                 ku=["key_cert_sign", "crl_sign"])
    # Another root of the same name, with another key.
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert("OMS test root", other_key, "OMS test root", other_key, (2020, 1, 1), (2045, 1, 1), True,
                  ku=["key_cert_sign", "crl_sign"])
    inter_key = ec.generate_private_key(ec.SECP256R1())
    inter = _cert("OMS test intermediate", inter_key, "OMS test root", root_key, (2021, 1, 1), (2044, 1, 1), True,
                  ku=["key_cert_sign"], pathlen=0)
    # An intermediate that had expired when its leaf was issued.
    old_key = ec.generate_private_key(ec.SECP256R1())
    old = _cert("OMS test expired intermediate", old_key, "OMS test root", root_key, (2021, 1, 1), (2022, 1, 1),
                True, ku=["key_cert_sign"], pathlen=0)
    _pem("root.pem", root)
    # The same root key and name in certificates OpenSSL does not accept as issuers: not a CA, no
    # room for the intermediate (pathLenConstraint 0), no certificate signing in its key usage.
    for name, args in {
        "root-not-ca.pem": dict(ca=False, ku=["key_cert_sign", "crl_sign"]),
        "root-pathlen0.pem": dict(ca=True, ku=["key_cert_sign", "crl_sign"], pathlen=0),
        "root-no-certsign.pem": dict(ca=True, ku=["digital_signature"]),
    }.items():
        _pem(name, _cert("OMS test root", root_key, "OMS test root", root_key, (2020, 1, 1), (2045, 1, 1), **args))
    # The root's key and name, valid at other times: expired before the leaves were issued, valid
    # only after; ending one second before the leaves' notBefore (2025-01-01T00:00:00Z, the
    # signing time), ending at it, starting at it (OpenSSL: valid from notBefore to notAfter,
    # both included).
    for name, (start, end) in {
        "root-expired.pem": ((2020, 1, 1), (2024, 6, 1)),
        "root-not-yet.pem": ((2026, 1, 1), (2045, 1, 1)),
        "root-ends-before-signing.pem": ((2020, 1, 1), (2024, 12, 31, 23, 59, 59)),
        "root-ends-at-signing.pem": ((2020, 1, 1), (2025, 1, 1)),
        "root-starts-at-signing.pem": ((2025, 1, 1), (2045, 1, 1)),
    }.items():
        _pem(name, _cert("OMS test root", root_key, "OMS test root", root_key, start, end, True,
                         ku=["key_cert_sign", "crl_sign"]))
    _pem("other-root.pem", other)
    # The intermediate's key and name, without certificate signing in its key usage.
    _pem(tmp / "inter-no-certsign.pem", _cert("OMS test intermediate", inter_key, "OMS test root", root_key,
                                              (2021, 1, 1), (2044, 1, 1), True, ku=["digital_signature"], pathlen=0))
    _pem("inter.pem", inter)
    # Leaves: valid in 2025 only (model_signing checks the chain at the leaf's notBefore).
    leaves = {
        "cert": (ec.SECP256R1(), inter, inter_key, dict(ku=["digital_signature"])),
        "cert-eku": (ec.SECP384R1(), inter, inter_key, dict(eku=[ExtendedKeyUsageOID.CODE_SIGNING])),
        "cert-nousage": (ec.SECP256R1(), inter, inter_key,
                         dict(ku=["key_encipherment"], eku=[ExtendedKeyUsageOID.SERVER_AUTH])),
        "cert-expired-inter": (ec.SECP256R1(), old, old_key, dict(ku=["digital_signature"])),
        # A signing certificate that is a CA too, as model_signing's own test PKI has (certtool's
        # `ca` with `signing_key` and `code_signing_key`): OpenSSL accepts it.
        "cert-ca": (ec.SECP384R1(), inter, inter_key,
                    dict(ca=True, ku=["digital_signature"], eku=[ExtendedKeyUsageOID.CODE_SIGNING])),
    }
    for name, (curve, issuer, issuer_key, usage) in leaves.items():
        key = ec.generate_private_key(curve)
        issuer_cn = issuer.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        usage = {"ca": False, **usage}
        leaf = _cert(f"OMS test signer ({name})", key, issuer_cn, issuer_key, (2025, 1, 1), (2026, 1, 1),
                     **usage)
        _pem(tmp / f"{name}.key", key)
        _pem(tmp / f"{name}.pem", leaf)
        _pem(tmp / f"{name}-chain.pem", issuer)
    leaf = x509.load_pem_x509_certificate((tmp / "cert.pem").read_bytes())
    _pem("cert.pub", leaf.public_key())
    # A self-signed signing certificate: a chain of one when it is the certificate given.
    key = ec.generate_private_key(ec.SECP256R1())
    _pem(tmp / "self-signed.key", key)
    _pem("self-signed.pem", _cert("OMS test self-signed signer", key, "OMS test self-signed signer", key,
                                  (2025, 1, 1), (2026, 1, 1), False, ku=["digital_signature"]))


def pae(payload, ptype=INTOTO):
    return b"DSSEv1 %d %s %d %s" % (len(ptype), ptype.encode(), len(payload), payload)


def pae_compat(payload):
    # model_signing 0.2's PAE (its sign_sigstore_pb.pae_compat): the bytes' repr, "DSSEV1".
    return f"DSSEV1 {len(INTOTO)} {INTOTO} {len(payload)} {payload}".encode()


def b64(b):
    return base64.b64encode(b).decode()


def payload_of(bundle):
    return base64.b64decode(bundle["dsseEnvelope"]["payload"])


def resign(bundle, payload, key, ptype=INTOTO, pae_fn=pae):
    env = bundle["dsseEnvelope"]
    env["payload"] = b64(payload)
    env["payloadType"] = ptype
    message = pae_fn(payload) if pae_fn is pae_compat else pae_fn(payload, ptype)
    env["signatures"] = [{"sig": b64(key.sign(message, ec.ECDSA(hashes.SHA256()))), "keyid": ""}]
    return bundle


def with_root(statement):
    """The statement with its subject digest recomputed over its resources, as the signer does."""
    h = hashlib.sha256()
    for r in statement["predicate"]["resources"]:
        h.update(bytes.fromhex(r["digest"]))
    statement["subject"][0]["digest"]["sha256"] = h.hexdigest()
    return statement


def dump(statement):
    return json.dumps(statement, indent=2).encode()


def write(name, bundle):
    pathlib.Path(name).write_text(json.dumps(bundle))


def load(name):
    return json.loads(pathlib.Path(name).read_text())


def api(tmp):
    tmp = pathlib.Path(tmp)
    signer = lambda: model_signing.signing.Config().use_elliptic_key_signer(private_key=tmp / "key.pem")
    for name, hc in [
        ("shards.sig", H().use_shard_serialization(shard_size=1000)),
        ("blake2.sig", H().use_file_serialization(hashing_algorithm="blake2")),
        ("blake2-shards.sig", H().use_shard_serialization(hashing_algorithm="blake2", shard_size=1000)),
        ("blake3.sig", H().use_file_serialization(hashing_algorithm="blake3")),
        # The files under sub/ left out: the statement records ignore_paths.
        ("ignore.sig", H().set_ignored_paths(paths=["sub"])),
    ]:
        signer().set_hashing_config(hc).sign("model", name)
    # A signature of a single file (model_signing names it ".").
    signer().sign("model/model.safetensors", "single.sig")

    key = serialization.load_pem_private_key((tmp / "key.pem").read_bytes(), None)
    statement = json.loads(payload_of(load("key.sig")))

    # Accepted: no key hint (model_signing warns); a v1.0 statement signed over model_signing
    # 0.2's PAE; a v0.1 statement (the subjects are the files) as model_signing 0.2 wrote it.
    b = load("key.sig")
    b["verificationMaterial"]["publicKey"] = {}
    write("nohint.sig", b)
    write("compat-pae.sig", resign(load("key.sig"), payload_of(load("key.sig")), key, pae_fn=pae_compat))
    v01 = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": r["name"], "digest": {"sha256": r["digest"]}} for r in statement["predicate"]["resources"]],
        "predicateType": "https://model_signing/Digests/v0.1",
        "predicate": {},
    }
    b = resign(load("key.sig"), dump(v01), key, pae_fn=pae_compat)
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    b["verificationMaterial"]["publicKey"] = {"rawBytes": b64(spki), "keyDetails": "PKIX_ECDSA_P256_SHA_256"}
    write("v01.sig", b)

    # Edited after signing.
    b = load("key.sig")
    p = payload_of(b)
    at = p.index(b'"digest": "') + len(b'"digest": "')
    p = p[:at] + (b"0" if p[at:at + 1] != b"0" else b"1") + p[at + 1:]
    b["dsseEnvelope"]["payload"] = b64(p)
    write("bad-flipped-payload.sig", b)
    b = load("key.sig")
    sig = bytearray(base64.b64decode(b["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[-1] ^= 1
    b["dsseEnvelope"]["signatures"][0]["sig"] = b64(sig)
    write("bad-edited-sig.sig", b)
    b = load("key.sig")
    b["dsseEnvelope"]["signatures"] = []
    write("bad-no-signatures.sig", b)
    b = load("key.sig")
    b["mediaType"] = "application/vnd.dev.sigstore.bundle+json;version=0.2"
    write("bad-media-type.sig", b)
    b = load("key.sig")
    b["dsseEnvelope"]["payload"] = b["dsseEnvelope"]["payload"][:-1]
    write("bad-base64.sig", b)
    text = pathlib.Path("key.sig").read_text()
    pathlib.Path("bad-json.sig").write_text(text[: len(text) // 2])
    b = load("key.sig")
    env = b.pop("dsseEnvelope")
    b["messageSignature"] = {
        "messageDigest": {"algorithm": "SHA2_256", "digest": b64(hashlib.sha256(payload_of({"dsseEnvelope": env})).digest())},
        "signature": env["signatures"][0]["sig"],
    }
    write("bad-message-signature.sig", b)
    b = load("cert.sig")
    del b["verificationMaterial"]["x509CertificateChain"]["certificates"][1:]
    write("cert-leaf-only.sig", b)
    b = load("cert.sig")
    inter = x509.load_pem_x509_certificate((tmp / "inter-no-certsign.pem").read_bytes())
    b["verificationMaterial"]["x509CertificateChain"]["certificates"][1] = {
        "rawBytes": b64(inter.public_bytes(serialization.Encoding.DER))
    }
    write("cert-inter-no-certsign.sig", b)

    # Edited, then signed again with the right key.
    def variant(name, edit, ptype=INTOTO, base="key.sig"):
        s = json.loads(payload_of(load(base)))
        s = edit(s) or s
        write(name, resign(load(base), dump(s), key, ptype=ptype))

    variant("bad-payload-type.sig", lambda s: None, ptype="application/json")
    variant("bad-statement-type.sig", lambda s: s.update({"_type": "https://in-toto.io/Statement/v0.1"}))
    variant("bad-predicate-type.sig", lambda s: s.update({"predicateType": "https://slsa.dev/provenance/v1"}))

    def subject_digest(s):
        d = s["subject"][0]["digest"]["sha256"]
        s["subject"][0]["digest"]["sha256"] = ("1" if d[0] == "0" else "0") + d[1:]

    variant("bad-subject-digest.sig", subject_digest)
    variant("bad-two-subjects.sig", lambda s: s.update({"subject": s["subject"] * 2}))

    def md5(s):
        s["predicate"]["serialization"]["hash_type"] = "md5"
        for r in s["predicate"]["resources"]:
            r["algorithm"] = "md5"
            r["digest"] = hashlib.md5((pathlib.Path("model") / r["name"]).read_bytes()).hexdigest()
        return with_root(s)

    variant("bad-hash-md5.sig", md5)

    def method(s):
        s["predicate"]["serialization"]["method"] = "tensors"

    variant("bad-method.sig", method)

    def dotdot(s):
        s["predicate"]["resources"][0]["name"] = "../model/" + s["predicate"]["resources"][0]["name"]
        return with_root(s)

    variant("bad-name-dotdot.sig", dotdot)

    def gap(s):
        s["predicate"]["resources"] = [r for r in s["predicate"]["resources"] if not r["name"].endswith(":1000:2000")]
        return with_root(s)

    variant("bad-shard-gap.sig", gap, base="shards.sig")


def v020(tmp):
    """Signatures as model_signing 0.2.0 wrote them (its API; run with a Python that has
    model_signing==0.2.0 and sigstore<4): a v0.1 statement (a subject per file), a certificate
    chain, the PAE of that release."""
    from model_signing import api
    from model_signing.signature import key as key_signature, pki
    from model_signing.signing import in_toto, in_toto_signature

    tmp = pathlib.Path(tmp)
    for name, signer in [
        ("v0.2.0-cert.sig", pki.PKISigner.from_path(str(tmp / "cert.key"), str(tmp / "cert.pem"),
                                                     [str(tmp / "cert-chain.pem")])),
        ("v0.2.0-key.sig", key_signature.ECKeySigner.from_path(str(tmp / "key.pem"))),
    ]:
        config = api.SigningConfig.__new__(api.SigningConfig)  # its __init__ makes a Sigstore signer
        config.set_hashing_config(api.HashingConfig().set_serialize_by_file_to_manifest())
        config.set_payload_generator(in_toto.DigestsIntotoPayload.from_manifest)
        config._signer = in_toto_signature.IntotoSigner(signer)
        config.sign(pathlib.Path("model"), pathlib.Path(name))


def v100(tmp):
    """Signatures as model_signing 1.0.0 wrote them (run with a Python that has
    model_signing==1.0.0 and sigstore<4): the key as `rawBytes` and `keyDetails`, no hint (the
    older verification material format), of the model and of a single file."""
    from model_signing import signing

    signing.Config.use_sigstore_signer = lambda self, **kw: self  # its default reaches Sigstore
    tmp = pathlib.Path(tmp)
    for model, name in [("model", "v1.0.0-key.sig"), ("model/model.safetensors", "v1.0.0-single.sig")]:
        signing.Config().use_elliptic_key_signer(private_key=tmp / "key.pem").sign(model, name)


# (signature, verifier, trust, hashing config, expected to verify[, the model signed])
def _checks():
    files = H()
    shards = H().use_shard_serialization(shard_size=1000)
    key, cert = "key", "certificate"
    return [
        ("key.sig", key, "key.pub", files, True),
        ("key384.sig", key, "key384.pub", files, True),
        ("key521.sig", key, "key521.pub", files, True),
        ("shards.sig", key, "key.pub", shards, True),
        ("blake2.sig", key, "key.pub", H().use_file_serialization(hashing_algorithm="blake2"), True),
        ("blake2-shards.sig", key, "key.pub",
         H().use_shard_serialization(hashing_algorithm="blake2", shard_size=1000), True),
        ("blake3.sig", key, "key.pub", H().use_file_serialization(hashing_algorithm="blake3"), True),
        ("nohint.sig", key, "key.pub", files, True),
        ("compat-pae.sig", key, "key.pub", files, True),
        ("v01.sig", key, "key.pub", files, True),
        ("cert.sig", cert, ["root.pem"], files, True),
        ("cert.sig", cert, ["root.pem", "inter.pem"], files, True),
        ("cert-eku.sig", cert, ["root.pem"], files, True),
        ("cert-leaf-only.sig", cert, ["root.pem", "inter.pem"], files, True),
        ("cert-leaf-only.sig", cert, ["root.pem"], files, False),
        ("key.sig", key, "rsa.pub", files, False),
        ("key.sig", key, "other.pub", files, False),
        ("key.sig", key, "key384.pub", files, False),
        ("nohint.sig", key, "other.pub", files, False),
        ("key.sig", cert, ["root.pem"], files, False),
        ("cert.sig", key, "cert.pub", files, False),
        ("cert.sig", cert, ["other-root.pem"], files, False),
        ("cert.sig", cert, ["inter.pem"], files, False),
        ("cert-nousage.sig", cert, ["root.pem"], files, False),
        ("cert.sig", cert, ["root-not-ca.pem"], files, False),
        ("cert.sig", cert, ["root-pathlen0.pem"], files, False),
        ("cert.sig", cert, ["root-no-certsign.pem"], files, False),
        ("cert-inter-no-certsign.sig", cert, ["root.pem"], files, False),
        ("cert-expired-inter.sig", cert, ["root.pem"], files, False),
        ("cert-ca.sig", cert, ["root.pem"], files, True),
        ("cert.sig", cert, ["root-expired.pem"], files, False),
        ("cert.sig", cert, ["root-not-yet.pem"], files, False),
        ("cert.sig", cert, ["root-ends-before-signing.pem"], files, False),
        ("cert.sig", cert, ["root-ends-at-signing.pem"], files, True),
        ("cert.sig", cert, ["root-starts-at-signing.pem"], files, True),
        ("self-signed.sig", cert, ["self-signed.pem"], files, True),
        ("self-signed.sig", cert, ["root.pem"], files, False),
        ("ignore.sig", key, "key.pub", None, True),
        ("single.sig", key, "key.pub", None, True, "model/model.safetensors"),
        ("single.sig", key, "key.pub", None, False, "model"),
        ("v1.0.0-single.sig", key, "key.pub", None, True, "model/model.safetensors"),
        ("v1.0.0-key.sig", key, "key.pub", files, True),
        ("v0.2.0-cert.sig", cert, ["root.pem"], files, True),
        ("v0.2.0-key.sig", key, "key.pub", files, True),
        ("bad-flipped-payload.sig", key, "key.pub", files, False),
        ("bad-edited-sig.sig", key, "key.pub", files, False),
        ("bad-no-signatures.sig", key, "key.pub", files, False),
        ("bad-media-type.sig", key, "key.pub", files, False),
        ("bad-base64.sig", key, "key.pub", files, False),
        ("bad-json.sig", key, "key.pub", files, False),
        ("bad-message-signature.sig", key, "key.pub", files, False),
        ("bad-payload-type.sig", key, "key.pub", files, False),
        ("bad-statement-type.sig", key, "key.pub", files, False),
        ("bad-predicate-type.sig", key, "key.pub", files, False),
        ("bad-subject-digest.sig", key, "key.pub", files, False),
        ("bad-two-subjects.sig", key, "key.pub", files, False),
        ("bad-hash-md5.sig", key, "key.pub", files, False),
        ("bad-method.sig", key, "key.pub", files, False),
        ("bad-name-dotdot.sig", key, "key.pub", files, False),
        ("bad-shard-gap.sig", key, "key.pub", shards, False),
    ]


def check():
    import io
    import contextlib

    failed = 0
    for sig, kind, trust, hc, want, *model in _checks():
        out = io.StringIO()
        try:
            config = model_signing.verifying.Config()
            if kind == "key":
                config.use_elliptic_key_verifier(public_key=trust)
            else:
                config.use_certificate_verifier(certificate_chain=trust)
            if hc is not None:  # else the configuration the signature records
                config.set_hashing_config(hc)
            with contextlib.redirect_stdout(out):
                config.verify((model or ["model"])[0], sig)
            got, why = True, out.getvalue().strip()[:60]
        except Exception as e:  # what model_signing raises: ValueError, KeyError, AttributeError, ...
            got, why = False, f"{type(e).__name__}: {e}"[:150]
        mark = "ok" if got == want else "UNEXPECTED"
        failed += got != want
        print(f"{mark:10} {sig:26} {kind:11} {str(trust):28} {'verifies' if got else 'rejected'} {why}")
    if failed:
        sys.exit(f"{failed} fixtures did not do what they are for")


if __name__ == "__main__":
    {"model": model, "certs": certs, "api": api, "v020": v020, "v100": v100,
     "check": check}[sys.argv[1]](*sys.argv[2:])
