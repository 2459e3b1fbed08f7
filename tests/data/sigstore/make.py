"""Keyless (Sigstore) bundles of the model in ../oms/model, made without Sigstore's servers, for
rust/verify/oms/keyless.rs and tests/python/test_verify_keyless.py.

A test CA stands in for Fulcio (a root and an intermediate, the leaf certificates with Fulcio's
extensions and an embedded SCT), a CT log key signs the SCTs, and a transparency log key stands
in for Rekor (dsse 0.0.1 entries in a small Merkle tree, their inclusion proofs, signed
checkpoints and signed entry timestamps). `trusted_root.json` lists them as Sigstore's trusted
root lists its services. Every bundle signs the in-toto statement model_signing 1.1.1 wrote of
../oms/model (the payload of ../oms/key.sig), so a bundle that verifies checks that model.

    python tests/data/sigstore/make.py          # writes trusted_root.json, *.sig, cases.json
    python tests/data/sigstore/make.py check    # what sigstore-python's offline Verifier says

A test timestamp authority (a root and its timestamping certificate) makes RFC 3161 timestamps
of an envelope's signature, as Sigstore's timestamp authority does. It needs `cryptography`,
`asn1crypto` (the timestamps' CMS; model_signing depends on it) and `sigstore` (4.x). The keys
are new on every run (so every file changes) and are not kept. cases.json lists each case (a bundle, the identity and issuer it is
checked against) and what sigstore-python's offline `Verifier.verify_dsse` says of it;
tests/python/test_verify_keyless.py asks sigstore-python again on every run.
"""

import base64
import datetime
import hashlib
import json
import pathlib
import sys

from asn1crypto import cms, tsp  # noqa: F401 (tsp registers TSTInfo with cms)
from asn1crypto import x509 as asn1_x509
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

HERE = pathlib.Path(__file__).resolve().parent
IDENTITY = "signer@example.com"
ISSUER = "https://issuer.example.com"
WORKFLOW = "https://github.com/example/model/.github/workflows/sign.yml@refs/heads/main"
ACTIONS = "https://token.actions.githubusercontent.com"
INTOTO = "application/vnd.in-toto+json"
ISSUER_V1 = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")
ORIGIN = "rekor.example.com - 2605736670972794746"
UTC = datetime.timezone.utc

# The signing: a leaf valid for ten minutes, logged a minute after it was issued.
ISSUED = datetime.datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
LOGGED = ISSUED + datetime.timedelta(minutes=1)


def b64(data):
    return base64.b64encode(data).decode()


def spki(key):
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key):
    """A log's ID: the sha256 of its key's SubjectPublicKeyInfo."""
    return hashlib.sha256(spki(key)).digest()


def sign(key, data):
    alg = hashes.SHA384() if key.curve.key_size == 384 else hashes.SHA256()
    return key.sign(data, ec.ECDSA(alg))


def p256():
    return ec.generate_private_key(ec.SECP256R1())


def p384():
    return ec.generate_private_key(ec.SECP384R1())


def name(cn):
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "example"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def ca(cn, key, issuer=None, issuer_key=None, start=(2025, 1, 1), end=(2035, 1, 1)):
    """A CA certificate as Fulcio's: self-signed without `issuer`, else an intermediate."""
    issuer, issuer_key = issuer or None, issuer_key or key
    b = (
        x509.CertificateBuilder()
        .subject_name(name(cn))
        .issuer_name(issuer.subject if issuer else name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(*start, tzinfo=UTC))
        .not_valid_after(datetime.datetime(*end, tzinfo=UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0 if issuer else 1), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    )
    if issuer:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
    return b.sign(issuer_key, hashes.SHA384())


def tsa_leaf(key, issuer, issuer_key):
    """A timestamp authority's signing certificate: its only extended key usage timeStamping,
    critical (RFC 3161)."""
    return (
        x509.CertificateBuilder()
        .subject_name(name("test-tsa"))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(2025, 1, 1, tzinfo=UTC))
        .not_valid_after(datetime.datetime(2035, 1, 1, tzinfo=UTC))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.TIME_STAMPING]), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        .sign(issuer_key, hashes.SHA384())
    )


def timestamp(message, key, cert, at):
    """An RFC 3161 timestamp response granting a TimeStampToken (CMS SignedData over a TSTInfo)
    of `message` at `at`, signed by `key` with `cert`."""
    info = tsp.TSTInfo({
        "version": "v1",
        "policy": "1.3.6.1.4.1.57264.2",
        "message_imprint": {"hash_algorithm": {"algorithm": "sha256"},
                            "hashed_message": hashlib.sha256(message).digest()},
        "serial_number": x509.random_serial_number(),
        "gen_time": at,
    })
    der_cert = asn1_x509.Certificate.load(cert.public_bytes(serialization.Encoding.DER))
    attrs = cms.CMSAttributes([
        {"type": "content_type", "values": ["tst_info"]},
        {"type": "message_digest", "values": [hashlib.sha256(info.dump()).digest()]},
        {"type": "signing_certificate_v2",
         "values": [{"certs": [{"cert_hash": hashlib.sha256(der_cert.dump()).digest()}]}]},
    ])
    signer = cms.SignerInfo({
        "version": "v1",
        "sid": {"issuer_and_serial_number": {"issuer": der_cert.issuer, "serial_number": der_cert.serial_number}},
        "digest_algorithm": {"algorithm": "sha256"},
        "signed_attrs": attrs,
        "signature_algorithm": {"algorithm": "sha256_ecdsa"},
        "signature": key.sign(attrs.dump(), ec.ECDSA(hashes.SHA256())),  # over the attributes' DER SET
    })
    signed = cms.SignedData({
        "version": "v3",
        "digest_algorithms": [{"algorithm": "sha256"}],
        "encap_content_info": {"content_type": "tst_info", "content": info},
        "certificates": [der_cert],
        "signer_infos": [signer],
    })
    token = cms.ContentInfo({"content_type": "signed_data", "content": signed})
    # A bundle carries the authority's whole response (TimeStampResp), the token inside it.
    return tsp.TimeStampResp({"status": {"status": "granted"}, "time_stamp_token": token}).dump()


def der_utf8(text):
    data = text.encode()
    assert len(data) < 128
    return bytes([0x0C, len(data)]) + data


def tls_vector(data, width):
    return len(data).to_bytes(width, "big") + data


def leaf(key, issuer, issuer_key, ct_key, *, sans=(x509.RFC822Name(IDENTITY),), issuer_v1=ISSUER, issuer_v2=ISSUER,
         eku=ExtendedKeyUsageOID.CODE_SIGNING, sct=True, start=ISSUED):
    """A Fulcio signing certificate: no subject, the identity as a critical SAN, the OIDC issuer in
    the legacy (raw) and current (UTF8String) extensions, and an SCT over its precertificate."""
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(minutes=10))
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        .add_extension(x509.SubjectAlternativeName(list(sans)), critical=True)
    )
    if issuer_v1 is not None:
        b = b.add_extension(x509.UnrecognizedExtension(ISSUER_V1, issuer_v1.encode()), critical=False)
    if issuer_v2 is not None:
        b = b.add_extension(x509.UnrecognizedExtension(ISSUER_V2, der_utf8(issuer_v2)), critical=False)
    if not sct:
        return b.sign(issuer_key, hashes.SHA384())
    # The SCT signs the precertificate: the certificate's TBS without the SCT list (RFC 6962).
    precert = b.sign(issuer_key, hashes.SHA384())
    timestamp = int((start + datetime.timedelta(milliseconds=500)).timestamp() * 1000)
    signed = (
        bytes([0, 0]) + timestamp.to_bytes(8, "big") + (1).to_bytes(2, "big")
        + hashlib.sha256(spki(issuer_key)).digest() + tls_vector(precert.tbs_certificate_bytes, 3)
        + tls_vector(b"", 2)
    )
    sct_bytes = (
        bytes([0]) + key_id(ct_key) + timestamp.to_bytes(8, "big") + tls_vector(b"", 2)
        + bytes([4, 3]) + tls_vector(sign(ct_key, signed), 2)
    )
    scts = tls_vector(tls_vector(sct_bytes, 2), 2)
    octets = bytes([0x04]) + der_len(len(scts)) + scts
    cert = b.add_extension(x509.UnrecognizedExtension(SCT_LIST, octets), critical=False).sign(
        issuer_key, hashes.SHA384())
    assert cert.tbs_precertificate_bytes == precert.tbs_certificate_bytes
    return cert


def der_len(n):
    if n < 128:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def pae(payload):
    return b"DSSEv1 %d %s %d " % (len(INTOTO), INTOTO.encode(), len(payload)) + payload


# RFC 6962's Merkle tree.

def leaf_hash(data):
    return hashlib.sha256(b"\x00" + data).digest()


def node(left, right):
    return hashlib.sha256(b"\x01" + left + right).digest()


def split(n):
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def root(leaves):
    if len(leaves) == 1:
        return leaves[0]
    k = split(len(leaves))
    return node(root(leaves[:k]), root(leaves[k:]))


def path(m, leaves):
    if len(leaves) == 1:
        return []
    k = split(len(leaves))
    if m < k:
        return path(m, leaves[:k]) + [root(leaves[k:])]
    return path(m - k, leaves[k:]) + [root(leaves[:k])]


class Log:
    """A transparency log standing in for Rekor (v1): dsse 0.0.1 entries, a signed checkpoint of
    the tree and a signed entry timestamp of each."""

    INDEX = 5  # the entry's place among 7 leaves: a proof of three hashes

    def __init__(self, key):
        self.key = key

    def entry(self, payload, signature, cert, *, time=LOGGED, proof_edit=None, checkpoint_key=None,
              checkpoint_root=None, set_time=None):
        body = {
            "apiVersion": "0.0.1",
            "kind": "dsse",
            "spec": {
                "envelopeHash": {"algorithm": "sha256",
                                 "value": hashlib.sha256(payload + signature).hexdigest()},
                "payloadHash": {"algorithm": "sha256", "value": hashlib.sha256(payload).hexdigest()},
                "signatures": [{"signature": b64(signature),
                                "verifier": b64(cert.public_bytes(serialization.Encoding.PEM))}],
            },
        }
        body = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        leaves = [leaf_hash(b"other entry %d" % i) for i in range(7)]
        leaves[self.INDEX] = leaf_hash(body)
        tree_root = root(leaves)
        hashes_ = path(self.INDEX, leaves)
        if proof_edit is not None:
            hashes_[proof_edit] = bytes([hashes_[proof_edit][0] ^ 1]) + hashes_[proof_edit][1:]
        note = f"{ORIGIN}\n{len(leaves)}\n{b64(checkpoint_root or tree_root)}\n".encode()
        signer = checkpoint_key or self.key
        checkpoint = note.decode() + "\n" + f"\u2014 rekor.example.com {b64(key_id(self.key)[:4] + sign(signer, note))}\n"
        logged = int(time.timestamp())
        promise = json.dumps({"body": b64(body), "integratedTime": int((set_time or time).timestamp()),
                              "logID": key_id(self.key).hex(), "logIndex": self.INDEX},
                             sort_keys=True, separators=(",", ":")).encode()
        return {
            "logIndex": str(self.INDEX),
            "logId": {"keyId": b64(key_id(self.key))},
            "kindVersion": {"kind": "dsse", "version": "0.0.1"},
            "integratedTime": str(logged),
            "inclusionPromise": {"signedEntryTimestamp": b64(sign(self.key, promise))},
            "inclusionProof": {
                "logIndex": str(self.INDEX),
                "rootHash": b64(tree_root),
                "treeSize": str(len(leaves)),
                "hashes": [b64(h) for h in hashes_],
                "checkpoint": {"envelope": checkpoint},
            },
            "canonicalizedBody": b64(body),
        }


def bundle(payload, key, cert, log, *, logged_signature=None, edit_payload=None, stamp=None, **entry):
    """A v0.3 bundle as sigstore-python writes them: the leaf alone, one log entry, the DSSE
    envelope. `logged_signature`: the log entry records another signature than the envelope's;
    `edit_payload`: the payload changed after signing and logging; `stamp(signature)`: an RFC
    3161 timestamp of the envelope's signature."""
    signature = sign(key, pae(payload))
    tlog = log.entry(payload, logged_signature or signature, cert, **entry)
    stamps = {"rfc3161Timestamps": [{"signedTimestamp": b64(stamp(signature))}]} if stamp else {}
    if edit_payload is not None:
        payload = edit_payload(payload)
    return {
        "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
        "verificationMaterial": {
            "certificate": {"rawBytes": b64(cert.public_bytes(serialization.Encoding.DER))},
            "tlogEntries": [tlog],
            "timestampVerificationData": stamps,
        },
        "dsseEnvelope": {"payload": b64(payload), "payloadType": INTOTO, "signatures": [{"sig": b64(signature)}]},
    }


def public_key(key, start="2025-01-01T00:00:00Z"):
    return {"rawBytes": b64(spki(key)), "keyDetails": "PKIX_ECDSA_P256_SHA_256", "validFor": {"start": start}}


def authority(cn, uri, chain):
    return {"subject": {"organization": "example", "commonName": cn}, "uri": uri,
            "certChain": {"certificates": [{"rawBytes": b64(c.public_bytes(serialization.Encoding.DER))} for c in chain]},
            "validFor": {"start": "2025-01-01T00:00:00Z"}}


def trusted_root(rekor, ct, chains, tsa_chain):
    return {
        "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
        "tlogs": [{"baseUrl": "https://rekor.example.com", "hashAlgorithm": "SHA2_256", "publicKey": public_key(rekor),
                   "logId": {"keyId": b64(key_id(rekor))}}],
        "certificateAuthorities": [authority(cn, "https://fulcio.example.com", chain) for cn, chain in chains],
        "ctlogs": [{"baseUrl": "https://ctfe.example.com", "hashAlgorithm": "SHA2_256", "publicKey": public_key(ct),
                    "logId": {"keyId": b64(key_id(ct))}}],
        "timestampAuthorities": [authority("test-tsa", "https://tsa.example.com/api/v1/timestamp", tsa_chain)],
    }


def flip_digest_digit(payload):
    """The statement with one hex digit of a resource digest changed: still JSON, still the same
    shape, but not what was signed."""
    text = payload.decode()
    at = text.index('"digest": "') + len('"digest": "')
    return (text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:]).encode()


def make():
    payload = base64.b64decode(json.loads((HERE.parent / "oms" / "key.sig").read_text())["dsseEnvelope"]["payload"])
    root_key, inter_key, old_inter_key = p384(), p384(), p384()
    fulcio_root = ca("test-fulcio-root", root_key)
    inter = ca("test-fulcio-intermediate", inter_key, fulcio_root, root_key)
    # An intermediate of the same root that had expired before the signing.
    old_inter = ca("test-fulcio-intermediate-2024", old_inter_key, fulcio_root, root_key, (2024, 1, 1), (2025, 1, 1))
    rekor, ct = p256(), p256()
    log = Log(rekor)
    tsa_root_key, tsa_key = p384(), p256()
    tsa_root = ca("test-tsa-root", tsa_root_key)
    tsa = tsa_leaf(tsa_key, tsa_root, tsa_root_key)
    (HERE / "trusted_root.json").write_text(json.dumps(
        trusted_root(rekor, ct, [("test-fulcio", [inter, fulcio_root]), ("test-fulcio-2024", [old_inter, fulcio_root])],
                     [tsa, tsa_root]),
        indent=2) + "\n")

    # Keys that are not in the trusted root.
    stranger_ca_key, stranger_ct, stranger_rekor = p384(), p256(), p256()
    stranger_ca = ca("test-fulcio-intermediate", stranger_ca_key)
    stranger_tsa_root_key, stranger_tsa_key = p384(), p256()
    stranger_tsa_root = ca("test-tsa-root", stranger_tsa_root_key)
    stranger_tsa = tsa_leaf(stranger_tsa_key, stranger_tsa_root, stranger_tsa_root_key)

    def stamped(at=ISSUED + datetime.timedelta(seconds=30), key=tsa_key, cert=tsa, of=None):
        return lambda signature: timestamp(of or signature, key, cert, at)

    def signer(**options):
        key = p256()
        return key, leaf(key, inter, inter_key, ct, **options)

    def write(file, data):
        (HERE / file).write_text(json.dumps(data, indent=2) + "\n")

    key, cert = signer()
    write("good.sig", bundle(payload, key, cert, log))
    write("edited-payload.sig", bundle(payload, key, cert, log, edit_payload=flip_digest_digit))
    write("bad-proof.sig", bundle(payload, key, cert, log, proof_edit=1))
    write("bad-checkpoint.sig", bundle(payload, key, cert, log, checkpoint_key=stranger_rekor))
    write("checkpoint-other-root.sig", bundle(payload, key, cert, log, checkpoint_root=hashlib.sha256(b"x").digest()))
    write("bad-set.sig", bundle(payload, key, cert, log, set_time=LOGGED + datetime.timedelta(seconds=1)))
    write("expired.sig", bundle(payload, key, cert, log, time=ISSUED + datetime.timedelta(minutes=11)))
    write("not-yet-valid.sig", bundle(payload, key, cert, log, time=ISSUED - datetime.timedelta(minutes=1)))
    write("unknown-log.sig", bundle(payload, key, cert, Log(stranger_rekor)))
    write("entry-mismatch.sig", bundle(payload, key, cert, log, logged_signature=sign(key, pae(payload + b" "))))
    write("other-key.sig", bundle(payload, p256(), cert, log))
    write("timestamped.sig", bundle(payload, key, cert, log, stamp=stamped()))
    write("timestamp-other-bytes.sig", bundle(payload, key, cert, log, stamp=stamped(of=b"other bytes")))
    write("timestamp-after-expiry.sig", bundle(payload, key, cert, log,
                                               stamp=stamped(at=ISSUED + datetime.timedelta(minutes=20))))
    write("timestamp-unknown-tsa.sig", bundle(payload, key, cert, log,
                                              stamp=stamped(key=stranger_tsa_key, cert=stranger_tsa)))

    key, cert = signer(sans=[x509.UniformResourceIdentifier(WORKFLOW)], issuer_v1=ACTIONS, issuer_v2=ACTIONS)
    write("workflow.sig", bundle(payload, key, cert, log))
    key, cert = signer(sct=False)
    write("no-sct.sig", bundle(payload, key, cert, log))
    key = p256()
    write("bad-sct.sig", bundle(payload, key, leaf(key, inter, inter_key, stranger_ct), log))
    key = p256()
    write("other-ca.sig", bundle(payload, key, leaf(key, stranger_ca, stranger_ca_key, ct), log))
    key = p256()
    write("expired-intermediate.sig", bundle(payload, key, leaf(key, old_inter, old_inter_key, ct), log))
    key, cert = signer(eku=ExtendedKeyUsageOID.SERVER_AUTH)
    write("no-codesigning.sig", bundle(payload, key, cert, log))
    key, cert = signer(issuer_v1=None)
    write("issuer-v2-only.sig", bundle(payload, key, cert, log))
    key, cert = signer(issuer_v2="https://other-issuer.example.com")
    write("issuer-v2-differs.sig", bundle(payload, key, cert, log))
    key, cert = signer(sans=[x509.RFC822Name("someone@example.com"), x509.RFC822Name(IDENTITY)])
    write("second-san.sig", bundle(payload, key, cert, log))

    cases = [
        # bundle, identity, issuer, what sigstore-python's verify_dsse says (`check` fills it)
        ["good.sig", IDENTITY, ISSUER],
        ["good.sig", "someone@example.com", ISSUER],
        ["good.sig", IDENTITY, "https://other-issuer.example.com"],
        ["workflow.sig", WORKFLOW, ACTIONS],
        ["workflow.sig", WORKFLOW, ISSUER],
        ["edited-payload.sig", IDENTITY, ISSUER],
        ["other-key.sig", IDENTITY, ISSUER],
        ["bad-proof.sig", IDENTITY, ISSUER],
        ["bad-checkpoint.sig", IDENTITY, ISSUER],
        ["checkpoint-other-root.sig", IDENTITY, ISSUER],
        ["bad-set.sig", IDENTITY, ISSUER],
        ["expired.sig", IDENTITY, ISSUER],
        ["not-yet-valid.sig", IDENTITY, ISSUER],
        ["unknown-log.sig", IDENTITY, ISSUER],
        ["entry-mismatch.sig", IDENTITY, ISSUER],
        ["no-sct.sig", IDENTITY, ISSUER],
        ["bad-sct.sig", IDENTITY, ISSUER],
        ["other-ca.sig", IDENTITY, ISSUER],
        ["expired-intermediate.sig", IDENTITY, ISSUER],
        ["no-codesigning.sig", IDENTITY, ISSUER],
        ["issuer-v2-only.sig", IDENTITY, ISSUER],
        ["issuer-v2-differs.sig", IDENTITY, ISSUER],
        ["second-san.sig", IDENTITY, ISSUER],
        ["timestamped.sig", IDENTITY, ISSUER],
        ["timestamp-other-bytes.sig", IDENTITY, ISSUER],
        ["timestamp-after-expiry.sig", IDENTITY, ISSUER],
        ["timestamp-unknown-tsa.sig", IDENTITY, ISSUER],
    ]
    write("cases.json", [{"bundle": b, "identity": i, "issuer": s, "sigstore_python": python_verdict(b, i, s)}
                         for b, i, s in cases])


def python_verdict(file, identity, issuer):
    """"ok", or the first line of why sigstore-python's offline Verifier refuses the bundle."""
    from sigstore.models import Bundle, TrustedRoot
    from sigstore.verify import Verifier, policy

    try:
        verifier = Verifier(trusted_root=TrustedRoot.from_file(str(HERE / "trusted_root.json")))
        found = Bundle.from_json((HERE / file).read_bytes())
        verifier.verify_dsse(found, policy.Identity(identity=identity, issuer=issuer))
    except Exception as e:  # every refusal, whatever its class
        return "refused: " + (str(e).splitlines() or [type(e).__name__])[0]
    return "ok"


def check():
    for case in json.loads((HERE / "cases.json").read_text()):
        print(f"{case['bundle']:28} {case['identity'][:24]:24} {case['issuer'][:34]:34} "
              f"{python_verdict(case['bundle'], case['identity'], case['issuer'])}")


if __name__ == "__main__":
    {"make": make, "check": check}[(sys.argv[1:] or ["make"])[0]]()
