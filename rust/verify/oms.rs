//! OpenSSF model-signing (OMS) signatures: a sigstore bundle whose DSSE envelope holds an
//! in-toto statement listing every file's digest.
//!
//! [`read_signature`] reads what the Python package `model_signing` writes with `model_signing
//! sign key` and `sign certificate` (and its `signing.Config` API), from release 0.2 to 1.1,
//! checks it offline the way `model_signing verify key` / `verify certificate` (1.1.1) do, and
//! returns the files it lists; and what `model_signing sign` (sigstore, its default) writes,
//! checked as `verify sigstore` does, offline (`oms/keyless.rs`). The bundle is JSON (media type
//! `application/vnd.dev.sigstore.bundle.v0.3+json`); its `dsseEnvelope` holds a base64 in-toto
//! statement (payload type `application/vnd.in-toto+json`) and the ECDSA signature of its DSSE
//! pre-authentication encoding. The statement (predicate `https://model_signing/signature/v1.0`)
//! has one subject, whose sha256 is that of every resource digest's bytes in order, and
//! `predicate.resources`: `{name, algorithm, digest}` per file (`serialization.method` `files`)
//! or per file shard (`shards`: named `path:start:end`, algorithm `sha256-sharded-<shard_size>`).
//! The serialization's `ignore_paths` and `allow_symlinks` are kept in the [`Manifest`]. A
//! signature of a single file names it `.`. Accepted as model_signing 1.1 accepts them: the v0.1
//! statements of model_signing 0.2 (predicate `https://model_signing/Digests/v0.1`, a subject
//! per file), signatures over its mis-encoded PAE, and the key material of releases before 1.1
//! (`rawBytes` and `keyDetails`, no key hint: model_signing warns).
//!
//! Keys and certificates are read with x509-parser; signatures are checked with ring. A
//! signature is refused where model_signing's verification would refuse it whatever the model's
//! files hold. The checks are model_signing's, with these differences:
//!
//! - Keys: P-256 and P-384 ECDSA keys, their points uncompressed, as cryptography writes them
//!   (model_signing also signs with P-521, which `ring` does not implement: such signatures are
//!   refused as unsupported).
//! - Certificate chains are judged by OpenSSL's rules, as model_signing's pyOpenSSL `X509Store`
//!   judges them at the signing certificate's notBefore (`oms/chain.rs` says how): every given
//!   certificate is trusted, the bundle's others are untrusted intermediates, the chain must end
//!   at a given self-signed certificate, every certificate of it, the root's included, must be
//!   valid at that time, issuers must be CAs and keep their pathLenConstraint, the signing
//!   certificate may be a CA, extended key usages are not checked on the chain, and the signing
//!   certificate must have the digitalSignature key usage or the codeSigning extended key usage
//!   (model_signing's own rule). Unlike OpenSSL here: certificate signatures other than ECDSA
//!   P-256/P-384, RSA (PKCS#1 v1.5 and PSS) and Ed25519 are refused as unsupported, as are
//!   name constraints (OpenSSL checks them); where two certificates could issue one, the one
//!   whose key verifies its signature is taken (OpenSSL takes one by name and key identifier
//!   and fails if its signature does not verify). With no certificate given, model_signing
//!   trusts certifi's web roots; here that is refused.
//! - The bundle is read as strictly as model_signing's pydantic models read it (unknown fields
//!   refused, exactly one verification material and one content), except that `tlogEntries`
//!   and `timestampVerificationData` are not looked into (model_signing checks their shape and
//!   then ignores them too), that snake_case field names are refused, and that base64 with
//!   characters outside its alphabet is refused where Python's `b64decode` skips them.
//! - The statement's digests must be hex without spaces, shard offsets plain decimal, and names
//!   relative paths without `..` (read as model_signing reads them: `a//./b` is `a/b`, `""` is
//!   `.`). A statement whose resources could never match a model is refused here, where
//!   model_signing refuses it when it compares the model's files: a resource hashed with another
//!   algorithm than the serialization's (or `<alg>-sharded-<n>` with another shard size),
//!   shards that do not tile their file from byte 0 in `shard_size` pieces, blake3 shards
//!   (model_signing hashes blake3 manifests by file), `.` beside other names. A name listed
//!   twice with two digests is refused (model_signing keeps the last one).
//! - Keyless (Sigstore) bundles are read and verified by `oms/keyless.rs`, as sigstore-python
//!   verifies them for `model_signing verify sigstore`, offline (see [`Trust::Sigstore`]).
//! - Key, certificate and signature files are read only if they are regular files of at most
//!   1 MiB (64 MiB for a signature), opened without waiting (a FIFO is refused, not read).
//!
//! In shard manifests an empty file is listed nowhere: model_signing makes no shard for it.

mod chain;
mod keyless;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;
use x509_parser::x509::SubjectPublicKeyInfo;

use super::{Algorithm, Digest, Expected, Manifest, Shard, SINGLE_FILE};
use crate::error::{Error, Result};

/// What a signature is checked against.
#[derive(Debug, Clone)]
pub enum Trust {
    /// A PEM public key (`model_signing sign key`).
    PublicKey(PathBuf),
    /// PEM certificates: the signing certificate's issuers up to a root (`sign certificate`).
    CertificateChain(Vec<PathBuf>),
    /// A Sigstore (keyless) bundle (`model_signing sign sigstore`), checked offline against a
    /// Sigstore trusted root (`trusted_root.json`, or a client trust configuration holding one)
    /// and the signer's identity and OIDC issuer (`oms/keyless.rs` says how).
    Sigstore { trusted_root: PathBuf, identity: String, issuer: String },
}

/// The manifest a signature (the bundle's bytes; `name` is what errors call it) lists, once
/// its envelope verifies against `trust`.
///
/// Errors: [`Error::SignatureInvalid`] where the bundle is malformed, its signature or
/// certificates do not verify with `trust`, or the signed statement contradicts itself;
/// [`Error::ManifestUnsupported`] where it is of a kind, version, key or algorithm not read
/// here; [`Error::Io`] where a key or certificate file cannot be read.
pub fn read_signature(bundle: &[u8], name: &str, trust: &Trust) -> Result<Manifest> {
    let origin = match trust {
        Trust::PublicKey(path) => format!("{name} (key {})", short(path)),
        Trust::CertificateChain(paths) => {
            format!("{name} (certificate chain {})", paths.iter().map(|p| short(p)).collect::<Vec<_>>().join(", "))
        }
        Trust::Sigstore { identity, .. } => format!("{name} (sigstore identity {identity})"),
    };
    let statement = read(bundle, trust).map_err(|fail| match fail {
        Fail::Invalid(why) => Error::SignatureInvalid { signature: name.to_owned(), why },
        Fail::Unsupported(why) => Error::ManifestUnsupported { signature: name.to_owned(), why },
        Fail::Io(e) => e,
    })?;
    Ok(Manifest {
        files: statement.files,
        origin,
        ignored: statement.ignored,
        allow_symlinks: statement.allow_symlinks,
    })
}

const BUNDLE_MEDIA_TYPE: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";
const PREDICATE_TYPE_V01: &str = "https://model_signing/Digests/v0.1";
const KEYLESS: &str = "verify it with the signer's identity and OIDC issuer (identity=, issuer=)";

/// Why a signature is refused, before it is given the signature's name.
#[derive(Debug)]
enum Fail {
    Invalid(String),
    Unsupported(String),
    Io(Error),
}

type Check<T> = std::result::Result<T, Fail>;

fn invalid<T>(why: impl Into<String>) -> Check<T> {
    Err(Fail::Invalid(why.into()))
}

fn unsupported<T>(why: impl Into<String>) -> Check<T> {
    Err(Fail::Unsupported(why.into()))
}

/// A path's file name (the whole path where it has none): origins are for messages.
fn short(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

// The bundle as model_signing's sigstore_models reads it (pydantic, `extra="forbid"`).

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Bundle {
    media_type: String,
    verification_material: VerificationMaterial,
    #[serde(default)]
    message_signature: Option<IgnoredAny>,
    #[serde(default)]
    dsse_envelope: Option<Envelope>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct VerificationMaterial {
    #[serde(default)]
    public_key: Option<PublicKeyIdentifier>,
    #[serde(default)]
    x509_certificate_chain: Option<CertificateChain>,
    #[serde(default)]
    certificate: Option<IgnoredAny>,
    /// model_signing adds an empty list where it is missing.
    #[serde(default)]
    #[allow(dead_code)]
    tlog_entries: Vec<IgnoredAny>,
    #[serde(default)]
    #[allow(dead_code)]
    timestamp_verification_data: Option<IgnoredAny>,
}

/// `rawBytes` and `keyDetails` (model_signing 0.2's) are dropped by model_signing as it reads.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PublicKeyIdentifier {
    #[serde(default)]
    hint: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    raw_bytes: Option<IgnoredAny>,
    #[serde(default)]
    #[allow(dead_code)]
    key_details: Option<IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CertificateChain {
    certificates: Vec<RawCertificate>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawCertificate {
    raw_bytes: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Envelope {
    payload: String,
    payload_type: String,
    signatures: Vec<EnvelopeSignature>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvelopeSignature {
    sig: String,
    #[serde(default)]
    #[allow(dead_code)]
    keyid: Option<String>,
}

fn read(bundle: &[u8], trust: &Trust) -> Check<Statement> {
    if let Trust::Sigstore { trusted_root, identity, issuer } = trust {
        let signed = keyless::verify(bundle, trusted_root, identity, issuer)?;
        if signed.payload_type != PAYLOAD_TYPE {
            return unsupported(format!(
                "the DSSE payload type is '{}', not the in-toto statement ({PAYLOAD_TYPE}) of model_signing",
                signed.payload_type
            ));
        }
        return statement_of(&signed.payload);
    }
    let bundle: Value =
        serde_json::from_slice(bundle).map_err(|e| Fail::Invalid(format!("not a sigstore bundle: {e}")))?;
    // serde reads a struct from a list of its fields too; pydantic does not.
    if !no_lists_for_objects(&bundle) {
        return invalid("not a sigstore bundle: a JSON list where the bundle has an object");
    }
    let bundle: Bundle =
        serde_json::from_value(bundle).map_err(|e| Fail::Invalid(format!("not a sigstore bundle: {e}")))?;
    let material = bundle.verification_material;
    let kinds =
        [material.public_key.is_some(), material.x509_certificate_chain.is_some(), material.certificate.is_some()];
    if kinds.iter().filter(|&&k| k).count() != 1 {
        return invalid(
            "the bundle's verificationMaterial must hold exactly one of publicKey, x509CertificateChain and certificate",
        );
    }
    let envelope = match (bundle.dsse_envelope, bundle.message_signature.is_some()) {
        (Some(envelope), false) => envelope,
        (None, true) => {
            return unsupported("the bundle holds a messageSignature, not the DSSE envelope model_signing writes")
        }
        _ => return invalid("the bundle must hold exactly one of dsseEnvelope and messageSignature"),
    };
    // Every base64 field is decoded as the bundle is read, as model_signing does.
    let payload = base64_field(&envelope.payload, "dsseEnvelope.payload")?;
    let signatures = envelope
        .signatures
        .iter()
        .enumerate()
        .map(|(i, s)| base64_field(&s.sig, &format!("dsseEnvelope.signatures[{i}].sig")))
        .collect::<Check<Vec<_>>>()?;
    let certificates = match &material.x509_certificate_chain {
        Some(chain) => chain
            .certificates
            .iter()
            .enumerate()
            .map(|(i, c)| base64_field(&c.raw_bytes, &format!("x509CertificateChain.certificates[{i}].rawBytes")))
            .collect::<Check<Vec<_>>>()?,
        None => Vec::new(),
    };
    if bundle.media_type != BUNDLE_MEDIA_TYPE {
        return unsupported(format!(
            "bundle media type '{}' is not the one model_signing writes and reads ({BUNDLE_MEDIA_TYPE})",
            bundle.media_type
        ));
    }

    let signer = match trust {
        Trust::PublicKey(path) => key_signer(path, &material)?,
        Trust::CertificateChain(paths) => {
            if material.certificate.is_some() {
                return invalid(format!("the bundle is a keyless (Sigstore) one: {KEYLESS}"));
            }
            if material.x509_certificate_chain.is_none() {
                return invalid(
                    "the bundle carries a public key, not a certificate chain: verify it with the public key",
                );
            }
            certificate_signer(paths, &certificates)?
        }
        // Read above.
        Trust::Sigstore { .. } => return invalid(format!("the bundle is a keyless (Sigstore) one: {KEYLESS}")),
    };
    // model_signing checks the first signature only.
    let Some(signature) = signatures.first() else {
        return invalid("the DSSE envelope holds no signatures");
    };
    if envelope.payload_type != PAYLOAD_TYPE {
        return unsupported(format!(
            "the DSSE payload type is '{}', not the in-toto statement ({PAYLOAD_TYPE}) of model_signing",
            envelope.payload_type
        ));
    }
    signer.verify(&payload, signature)?;
    statement_of(&payload)
}

/// Whether `value` has no list where [`Bundle`] reads an object (the lists it reads are
/// `signatures` and `certificates`; the fields it does not look into are not checked).
fn no_lists_for_objects(value: &Value) -> bool {
    match value {
        Value::Array(_) => false,
        Value::Object(map) => map.iter().all(|(key, value)| match (key.as_str(), value) {
            ("tlogEntries" | "timestampVerificationData" | "messageSignature" | "certificate", _) => true,
            ("signatures" | "certificates", Value::Array(items)) => items.iter().all(no_lists_for_objects),
            _ => no_lists_for_objects(value),
        }),
        _ => true,
    }
}

/// Base64 as Python's `b64decode` reads it: padding required, unused trailing bits ignored.
fn base64_field(text: &str, field: &str) -> Check<Vec<u8>> {
    const PYTHON: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(DecodePaddingMode::RequireCanonical),
    );
    PYTHON.decode(text).map_err(|e| Fail::Invalid(format!("{field} is not base64: {e}")))
}

/// The DSSE v1 pre-authentication encoding of an in-toto payload, what the signature signs.
fn pae(payload: &[u8]) -> Vec<u8> {
    let mut out = format!("DSSEv1 {} {PAYLOAD_TYPE} {} ", PAYLOAD_TYPE.len(), payload.len()).into_bytes();
    out.extend_from_slice(payload);
    out
}

/// model_signing 0.2's encoding (its `pae_compat`), which model_signing 1.1 still accepts:
/// `DSSEV1`, and the payload as Python writes `str(bytes)`.
fn pae_compat(payload: &[u8]) -> Vec<u8> {
    format!("DSSEV1 {} {PAYLOAD_TYPE} {} {}", PAYLOAD_TYPE.len(), payload.len(), python_bytes_repr(payload))
        .into_bytes()
}

/// `repr(b)` of Python bytes: `b'...'` (or `b"..."` where only `'` occurs), escaping the quote,
/// backslash, `\t \n \r` and every byte outside printable ASCII as `\xNN`.
fn python_bytes_repr(bytes: &[u8]) -> String {
    let quote = if bytes.contains(&b'\'') && !bytes.contains(&b'"') { '"' } else { '\'' };
    let mut out = String::with_capacity(bytes.len() + 3);
    out.push('b');
    out.push(quote);
    for &b in bytes {
        match b {
            b'\t' => out.push_str("\\t"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\\' => out.push_str("\\\\"),
            _ if b as char == quote => {
                out.push('\\');
                out.push(quote);
            }
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out.push(quote);
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Curve {
    P256,
    P384,
}

/// A public key the envelope's signature must verify with.
struct Signer {
    /// The key's point (SubjectPublicKeyInfo's subjectPublicKey), uncompressed.
    point: Vec<u8>,
    curve: Curve,
    /// model_signing 0.2's certificate signatures hashed with SHA-256 whatever the curve.
    compat_sha256: bool,
    /// The key, for messages.
    what: String,
}

impl Signer {
    /// The signer of `spki`, an elliptic-curve key model_signing signs with (`what` holds it).
    fn of(spki: &SubjectPublicKeyInfo<'_>, what: String, compat_sha256: bool) -> Check<Signer> {
        use x509_parser::oid_registry::{OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_NIST_EC_P521};
        if spki.algorithm.algorithm != OID_KEY_TYPE_EC_PUBLIC_KEY {
            return unsupported(format!(
                "{what} is not an elliptic-curve key: model_signing signs with P-256, P-384 and P-521 keys only"
            ));
        }
        let curve = spki.algorithm.parameters.as_ref().and_then(|p| p.as_oid().ok());
        let curve = match curve {
            Some(oid) if oid == OID_EC_P256 => Curve::P256,
            Some(oid) if oid == OID_NIST_EC_P384 => Curve::P384,
            Some(oid) if oid == OID_NIST_EC_P521 => {
                return unsupported(format!(
                    "{what} is a P-521 key: P-521 signatures are not verified here (ring, the verifier, has no P-521)"
                ))
            }
            _ => {
                return unsupported(format!(
                    "{what} is an elliptic-curve key on a curve model_signing does not sign with"
                ))
            }
        };
        let point = spki.subject_public_key.as_ref();
        if point.first() != Some(&4) {
            return unsupported(format!(
                "{what} holds a compressed or malformed elliptic-curve point, which is not read here"
            ));
        }
        Ok(Signer { point: point.to_vec(), curve, compat_sha256, what })
    }

    fn verify(&self, payload: &[u8], signature: &[u8]) -> Check<()> {
        use ring::signature::{
            EcdsaVerificationAlgorithm, UnparsedPublicKey, ECDSA_P256_SHA256_ASN1, ECDSA_P384_SHA256_ASN1,
            ECDSA_P384_SHA384_ASN1,
        };
        let (alg, compat): (&'static EcdsaVerificationAlgorithm, &'static EcdsaVerificationAlgorithm) =
            match (self.curve, self.compat_sha256) {
                (Curve::P256, _) => (&ECDSA_P256_SHA256_ASN1, &ECDSA_P256_SHA256_ASN1),
                (Curve::P384, false) => (&ECDSA_P384_SHA384_ASN1, &ECDSA_P384_SHA384_ASN1),
                (Curve::P384, true) => (&ECDSA_P384_SHA384_ASN1, &ECDSA_P384_SHA256_ASN1),
            };
        if UnparsedPublicKey::new(alg, &self.point).verify(&pae(payload), signature).is_ok()
            || UnparsedPublicKey::new(compat, &self.point).verify(&pae_compat(payload), signature).is_ok()
        {
            return Ok(());
        }
        invalid(format!("the envelope's signature is not one made by {} of this payload", self.what))
    }
}

/// A key's SubjectPublicKeyInfo as cryptography writes it in PEM: what model_signing hashes
/// for the bundle's key hint.
fn pem_public_key(spki: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(spki);
    let mut pem = String::from("-----BEGIN PUBLIC KEY-----\n");
    for line in b64.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END PUBLIC KEY-----\n");
    pem
}

/// The largest key or certificate file read: far more than a chain of PEM certificates takes.
const MAX_TRUST_FILE: u64 = 1 << 20;

fn read_trust_file(path: &Path) -> Check<Vec<u8>> {
    super::read_small_file(path, MAX_TRUST_FILE, "a PEM key or certificate file").map_err(Fail::Io)
}

/// The contents of the PEM blocks labelled `label` in `pem` (the file `what`), in order.
fn pem_blocks(pem: &[u8], label: &str, what: &str) -> Check<Vec<Vec<u8>>> {
    let mut blocks = Vec::new();
    for block in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let block = block.map_err(|e| Fail::Invalid(format!("{what}: not PEM: {e}")))?;
        if block.label == label {
            blocks.push(block.contents);
        }
    }
    Ok(blocks)
}

/// The signer of a bundle signed by the private half of the key in `path`
/// (model_signing's `sign_ec_key.Verifier`).
fn key_signer(path: &Path, material: &VerificationMaterial) -> Check<Signer> {
    use x509_parser::prelude::FromDer as _;
    let what = short(path);
    let pem = read_trust_file(path)?;
    let Some(der) = pem_blocks(&pem, "PUBLIC KEY", &what)?.into_iter().next() else {
        return invalid(format!("{what} holds no PEM public key (-----BEGIN PUBLIC KEY-----)"));
    };
    let spki = match SubjectPublicKeyInfo::from_der(&der) {
        Ok(([], spki)) => spki,
        _ => return invalid(format!("{what}: its PEM public key is not a DER SubjectPublicKeyInfo")),
    };
    let signer = Signer::of(&spki, what.clone(), false)?;
    let Some(identifier) = &material.public_key else {
        if material.certificate.is_some() {
            return invalid(format!("the bundle is a keyless (Sigstore) one, not signed with a key: {KEYLESS}"));
        }
        return invalid("the bundle carries a certificate, not a public key: verify it with its certificate chain");
    };
    // An empty or missing hint is accepted (model_signing warns that the format is older).
    if let Some(hint) = identifier.hint.as_deref().filter(|h| !h.is_empty()) {
        let mut ours = Algorithm::Sha256.hasher();
        ours.update(pem_public_key(spki.raw).as_bytes());
        if ours.finish().hex() != hint {
            return invalid(format!(
                "the bundle was signed with another key: its key hint is {hint}, not the sha256 of {what}"
            ));
        }
    }
    Ok(signer)
}

/// The signer of a bundle signed by the key of its signing certificate (`chain[0]`), once that
/// certificate chains to the given ones (model_signing's `sign_certificate.Verifier`).
fn certificate_signer(paths: &[PathBuf], chain: &[Vec<u8>]) -> Check<Signer> {
    if paths.is_empty() {
        return unsupported(
            "no certificates to verify the signing certificate with (model_signing would trust certifi's web roots; pass the root)",
        );
    }
    let Some((leaf, bundled)) = chain.split_first() else {
        return invalid("the bundle's certificate chain is empty");
    };
    let names = paths.iter().map(|p| short(p)).collect::<Vec<_>>().join(", ");
    let mut pems = Vec::new();
    for path in paths {
        let blocks = pem_blocks(&read_trust_file(path)?, "CERTIFICATE", &short(path))?;
        if blocks.is_empty() {
            return invalid(format!("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", short(path)));
        }
        pems.extend(blocks.into_iter().map(|der| (short(path), der)));
    }
    // Every certificate is read first, as model_signing (cryptography) reads them.
    let given = pems
        .iter()
        .map(|(file, der)| {
            chain::parse(der).map_err(|e| Fail::Invalid(format!("{file}: a certificate is not DER X.509: {e}")))
        })
        .collect::<Check<Vec<_>>>()?;
    let leaf = chain::parse(leaf)
        .map_err(|e| Fail::Invalid(format!("the bundle's signing certificate cannot be read: {e}")))?;
    let bundled = bundled
        .iter()
        .enumerate()
        .map(|(i, der)| {
            chain::parse(der)
                .map_err(|e| Fail::Invalid(format!("the bundle's certificate {} is not DER X.509: {e}", i + 1)))
        })
        .collect::<Check<Vec<_>>>()?;
    let at = leaf.validity().not_before.timestamp();
    chain::verify(&leaf, &bundled, &given, &names, at)?;
    let usage = chain::Extensions::of(&leaf).map_err(|why| Fail::Invalid(format!("the signing certificate: {why}")))?;
    if !usage.signs() {
        return invalid(
            "the signing certificate cannot be used for signing: it has neither the digitalSignature key usage nor the codeSigning extended key usage",
        );
    }
    Signer::of(leaf.public_key(), "the signing certificate's key".into(), true)
}

/// `2025-01-01T00:00:00Z`.
fn format_time(secs: i64) -> String {
    match chrono::DateTime::from_timestamp(secs, 0) {
        Some(t) => t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        None => format!("{secs} s after 1970"),
    }
}

// The statement.

/// `value[key]`, or why not.
fn field<'v>(value: &'v Value, key: &str, path: &str) -> Check<&'v Value> {
    match value {
        Value::Object(map) => map.get(key).ok_or_else(|| Fail::Unsupported(format!("the statement has no {path}"))),
        _ => match path.rsplit_once('.') {
            Some((parent, _)) => unsupported(format!("the statement's {parent} is not an object")),
            None => unsupported("the statement is not a JSON object"),
        },
    }
}

fn string<'v>(value: &'v Value, key: &str, path: &str) -> Check<&'v str> {
    field(value, key, path)?
        .as_str()
        .ok_or_else(|| Fail::Unsupported(format!("the statement's {path} is not a string")))
}

fn array<'v>(value: &'v Value, key: &str, path: &str) -> Check<&'v Vec<Value>> {
    field(value, key, path)?
        .as_array()
        .ok_or_else(|| Fail::Unsupported(format!("the statement's {path} is not a list")))
}

/// What a signed statement says of the model.
#[derive(Debug, Default)]
struct Statement {
    files: BTreeMap<String, Expected>,
    /// The serialization's `ignore_paths`, as relative names.
    ignored: Vec<String>,
    /// The serialization's `allow_symlinks` (a v0.1 statement has none).
    allow_symlinks: Option<bool>,
}

/// The files a verified payload lists.
#[cfg(test)]
fn manifest_of(payload: &[u8]) -> Check<BTreeMap<String, Expected>> {
    statement_of(payload).map(|s| s.files)
}

/// What a verified payload (an in-toto statement, JSON) says, checked as model_signing checks
/// it.
fn statement_of(payload: &[u8]) -> Check<Statement> {
    let statement: Value = serde_json::from_slice(payload)
        .map_err(|e| Fail::Unsupported(format!("the signed payload is not JSON: {e}")))?;
    let kind = string(&statement, "_type", "_type")?;
    if kind != STATEMENT_TYPE {
        return unsupported(format!("the payload is a '{kind}' statement, not an in-toto {STATEMENT_TYPE} one"));
    }
    let predicate_type = string(&statement, "predicateType", "predicateType")?;
    match predicate_type {
        PREDICATE_TYPE => {}
        PREDICATE_TYPE_V01 => return Ok(Statement { files: manifest_v01(&statement)?, ..Statement::default() }),
        _ => {
            return unsupported(format!(
                "the statement's predicate type is '{predicate_type}', not model_signing's {PREDICATE_TYPE}"
            ))
        }
    }

    let subjects = array(&statement, "subject", "subject")?;
    let [subject] = subjects.as_slice() else {
        return unsupported(format!("the statement has {} subjects where model_signing writes one", subjects.len()));
    };
    string(subject, "name", "subject[0].name")?;
    let root = string(field(subject, "digest", "subject[0].digest")?, "sha256", "subject[0].digest.sha256")?;

    let predicate = field(&statement, "predicate", "predicate")?;
    let serialization = field(predicate, "serialization", "predicate.serialization")?;
    let method = string(serialization, "method", "predicate.serialization.method")?;
    let hash_type = string(serialization, "hash_type", "predicate.serialization.hash_type")?;
    let allow_symlinks =
        field(serialization, "allow_symlinks", "predicate.serialization.allow_symlinks")?.as_bool().ok_or_else(
            || Fail::Unsupported("the statement's predicate.serialization.allow_symlinks is not true or false".into()),
        )?;
    let ignored = match serialization.get("ignore_paths") {
        None => Vec::new(),
        Some(_) => array(serialization, "ignore_paths", "predicate.serialization.ignore_paths")?
            .iter()
            .enumerate()
            .map(|(i, path)| {
                path.as_str().ok_or_else(|| {
                    Fail::Unsupported(format!(
                        "the statement's predicate.serialization.ignore_paths[{i}] is not a string"
                    ))
                })
            })
            .collect::<Check<Vec<&str>>>()?
            .into_iter()
            // model_signing drops a path outside the model's directory: it names no file of it.
            .filter_map(|path| file_name(path).ok())
            .collect(),
    };
    let shard_size = match method {
        "files" => None,
        "shards" => Some(shard_size(field(serialization, "shard_size", "predicate.serialization.shard_size")?)?),
        _ => {
            return unsupported(format!(
                "serialization method '{method}' is not one model_signing writes (files, shards)"
            ))
        }
    };

    let resources = array(predicate, "resources", "predicate.resources")?;
    let mut listed = Vec::with_capacity(resources.len());
    let mut hasher = Algorithm::Sha256.hasher();
    for (i, resource) in resources.iter().enumerate() {
        let at = |key: &str| format!("predicate.resources[{i}].{key}");
        let name = string(resource, "name", &at("name"))?;
        let algorithm = string(resource, "algorithm", &at("algorithm"))?;
        let hex = string(resource, "digest", &at("digest"))?;
        let bytes =
            super::parse_hex(hex).ok_or_else(|| Fail::Unsupported(format!("{} '{hex}' is not hex", at("digest"))))?;
        hasher.update(&bytes);
        listed.push((name, algorithm, hex));
    }
    let ours = hasher.finish().hex();
    if ours != root {
        return invalid(format!(
            "the statement is inconsistent: its subject digest is {root}, but its resources hash to {ours}"
        ));
    }

    let Some(hash) = Algorithm::from_name(hash_type) else {
        return unsupported(format!("hash algorithm '{hash_type}' is not supported (sha256, blake2 and blake3 are)"));
    };
    let mut files = BTreeMap::new();
    match shard_size {
        None => {
            for (name, algorithm, hex) in listed {
                if Algorithm::from_name(algorithm) != Some(hash) {
                    return unsupported(format!(
                        "'{name}' is hashed with '{algorithm}' where the serialization says '{hash_type}'"
                    ));
                }
                let digest =
                    Digest::from_hex(algorithm, hex).map_err(|why| Fail::Unsupported(format!("'{name}': {why}")))?;
                add(&mut files, file_name(name)?, Expected::Whole(digest))?;
            }
        }
        Some(size) => {
            if hash == Algorithm::Blake3 {
                return unsupported("a blake3 manifest by shards: model_signing hashes blake3 manifests by file");
            }
            let mut shards: BTreeMap<String, Vec<Shard>> = BTreeMap::new();
            for (name, algorithm, hex) in listed {
                let base = algorithm
                    .strip_suffix(&format!("-sharded-{size}"))
                    .filter(|base| Algorithm::from_name(base) == Some(hash))
                    .ok_or_else(|| {
                        Fail::Unsupported(format!(
                            "'{name}' is hashed with '{algorithm}' where the serialization says '{hash_type}-sharded-{size}'"
                        ))
                    })?;
                let digest =
                    Digest::from_hex(base, hex).map_err(|why| Fail::Unsupported(format!("'{name}': {why}")))?;
                let (path, start, end) = shard_name(name)?;
                let list = shards.entry(path).or_default();
                match list.iter().find(|s| (s.start, s.end) == (start, end)) {
                    Some(s) if s.digest == digest => {}
                    Some(_) => return unsupported(format!("'{name}' is listed twice, with two digests")),
                    None => list.push(Shard { start, end, digest }),
                }
            }
            for (path, mut list) in shards {
                list.sort_by_key(|s| s.start);
                tiles(&path, &list, size)?;
                files.insert(path, Expected::Shards(list));
            }
        }
    }
    single_file_alone(&files)?;
    Ok(Statement { files, ignored, allow_symlinks: Some(allow_symlinks) })
}

/// model_signing 0.2's statement: a subject (name and sha256) per file.
fn manifest_v01(statement: &Value) -> Check<BTreeMap<String, Expected>> {
    let mut files = BTreeMap::new();
    for (i, subject) in array(statement, "subject", "subject")?.iter().enumerate() {
        let name = string(subject, "name", &format!("subject[{i}].name"))?;
        let digest = field(subject, "digest", &format!("subject[{i}].digest"))?;
        let hex = string(digest, "sha256", &format!("subject[{i}].digest.sha256"))?;
        let digest = Digest::from_hex("sha256", hex).map_err(|why| Fail::Unsupported(format!("'{name}': {why}")))?;
        add(&mut files, file_name(name)?, Expected::Whole(digest))?;
    }
    single_file_alone(&files)?;
    Ok(files)
}

/// That a signature of a single file (model_signing names its file `.`) lists nothing else: a
/// model is a file or a directory, never both.
fn single_file_alone(files: &BTreeMap<String, Expected>) -> Check<()> {
    if files.contains_key(SINGLE_FILE) && files.len() > 1 {
        return unsupported(format!(
            "'{SINGLE_FILE}' (the file of a signature of a single file) is listed beside other files"
        ));
    }
    Ok(())
}

fn add(files: &mut BTreeMap<String, Expected>, name: String, expected: Expected) -> Check<()> {
    match files.get(&name) {
        Some(e) if *e == expected => Ok(()),
        Some(_) => unsupported(format!("'{name}' is listed twice, with two digests")),
        None => {
            files.insert(name, expected);
            Ok(())
        }
    }
}

/// A shard size: a positive whole number (protobuf's JSON writes `1000.0`).
fn shard_size(value: &Value) -> Check<u64> {
    let size = match value.as_u64() {
        Some(n) => Some(n),
        None => value.as_f64().filter(|f| f.fract() == 0.0 && *f >= 1.0 && *f <= 2f64.powi(53)).map(|f| f as u64),
    };
    match size {
        Some(n) if n > 0 => Ok(n),
        _ => unsupported(format!("the serialization's shard_size {value} is not a positive whole number")),
    }
}

/// A resource name as model_signing reads it (a `PurePosixPath`: `a//./b` is `a/b`), which must
/// name a file inside the model's directory, or be `.` (`""`, `./.`): the file of a signature of
/// a single file.
fn file_name(name: &str) -> Check<String> {
    if name.starts_with('/') {
        return unsupported(format!("'{name}' is an absolute path, not a file of the model's directory"));
    }
    let parts: Vec<&str> = name.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    if parts.contains(&"..") {
        return unsupported(format!("'{name}' leads out of the model's directory (..)"));
    }
    if parts.is_empty() {
        return Ok(SINGLE_FILE.to_owned());
    }
    Ok(parts.join("/"))
}

/// `path:start:end`, a shard's resource name.
fn shard_name(name: &str) -> Check<(String, u64, u64)> {
    let [path, start, end] = name.split(':').collect::<Vec<_>>()[..] else {
        return unsupported(format!("shard '{name}' is not named path:start:end"));
    };
    let offset = |text: &str| {
        Some(text)
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|t| t.parse::<u64>().ok())
    };
    match (offset(start), offset(end)) {
        (Some(start), Some(end)) => Ok((file_name(path)?, start, end)),
        _ => unsupported(format!("shard '{name}' does not end in two byte offsets")),
    }
}

/// That the shards (sorted) are those model_signing makes of a file: `[0, size)`, `[size,
/// 2 size)`, ..., the last one at most `size` long.
fn tiles(path: &str, shards: &[Shard], size: u64) -> Check<()> {
    let mut next = 0;
    for (i, shard) in shards.iter().enumerate() {
        let last = i + 1 == shards.len();
        let len = shard.end.checked_sub(shard.start).filter(|&len| len > 0);
        let fits = match len {
            Some(len) => len == size || (last && len < size),
            None => false,
        };
        if shard.start != next || !fits {
            return unsupported(format!(
                "the shards of '{path}' are not the {size}-byte pieces model_signing makes of a file: {}..{} after {next}",
                shard.start, shard.end
            ));
        }
        next = shard.end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The fixtures are in tests/data/oms (README.md there says how make.sh made them). Every
    //! signature file below, with the trust it is given here, was also given to model_signing
    //! 1.1.1 (`make.py check`, the `_checks` table): it verifies those read here and refuses those
    //! refused here, except key521.sig (P-521, which model_signing verifies and this module
    //! refuses as unsupported). The edits made in the tests themselves (`edited`, the byte flips,
    //! the statements of `manifest_of`) were not run through model_signing: what it does with
    //! each is read from its source, in the comment of each case.

    use super::*;
    use serde_json::json;

    const FILES: [&str; 3] = ["config.json", "model.safetensors", "sub/notes.txt"];

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/oms").join(name)
    }

    fn bytes(name: &str) -> Vec<u8> {
        std::fs::read(data(name)).expect("fixture")
    }

    fn key(name: &str) -> Trust {
        Trust::PublicKey(data(name))
    }

    fn chain(names: &[&str]) -> Trust {
        Trust::CertificateChain(names.iter().map(|n| data(n)).collect())
    }

    fn read(sig: &str, trust: &Trust) -> Result<Manifest> {
        read_signature(&bytes(sig), sig, trust)
    }

    /// `invalid: why`, `unsupported: why` or `other: message` of a refused signature.
    fn refusal(result: Result<Manifest>) -> String {
        match result {
            Ok(m) => panic!("verified, listing {:?}", m.files.keys().collect::<Vec<_>>()),
            Err(Error::SignatureInvalid { why, .. }) => format!("invalid: {why}"),
            Err(Error::ManifestUnsupported { why, .. }) => format!("unsupported: {why}"),
            Err(e) => format!("other: {e}"),
        }
    }

    fn assert_refused(result: Result<Manifest>, want: &str, case: &str) {
        let got = refusal(result);
        assert!(got.starts_with(want), "{case}: got '{got}', want '{want}...'");
    }

    /// The digest of a model file's bytes `range` (all of them for `None`).
    fn digest(algorithm: Algorithm, file: &str, range: Option<(u64, u64)>) -> Digest {
        let bytes = bytes(&format!("model/{file}"));
        let (start, end) = range.unwrap_or((0, bytes.len() as u64));
        let mut h = algorithm.hasher();
        h.update(&bytes[start as usize..end as usize]);
        h.finish()
    }

    fn whole(algorithm: Algorithm) -> BTreeMap<String, Expected> {
        FILES.iter().map(|f| (f.to_string(), Expected::Whole(digest(algorithm, f, None)))).collect()
    }

    fn sharded(algorithm: Algorithm, size: u64) -> BTreeMap<String, Expected> {
        let mut files = BTreeMap::new();
        for f in FILES {
            let len = bytes(&format!("model/{f}")).len() as u64;
            let shards = (0..len.div_ceil(size))
                .map(|i| {
                    let (start, end) = (i * size, ((i + 1) * size).min(len));
                    Shard { start, end, digest: digest(algorithm, f, Some((start, end))) }
                })
                .collect();
            files.insert(f.to_string(), Expected::Shards(shards));
        }
        files
    }

    #[test]
    fn a_key_signature_lists_every_file_with_its_digest() {
        let m = read("key.sig", &key("key.pub")).expect("key.sig verifies with key.pub");
        assert_eq!(m.origin, "key.sig (key key.pub)");
        assert_eq!(m.files, whole(Algorithm::Sha256));
        // The digests are those of the files' bytes, spelled out for one of them.
        let Expected::Whole(d) = &m.files["config.json"] else { panic!() };
        assert_eq!(d.to_string(), format!("sha256:{}", digest(Algorithm::Sha256, "config.json", None).hex()));
        assert_eq!(m.entry_for("/somewhere/model/sub/notes.txt").map(|(n, _)| n), Some("sub/notes.txt"));

        let m = read("key384.sig", &key("key384.pub")).expect("P-384");
        assert_eq!(m.files, whole(Algorithm::Sha256));
    }

    #[test]
    fn shard_manifests_give_each_file_its_shards_in_order() {
        let m = read("shards.sig", &key("key.pub")).expect("shards.sig");
        assert_eq!(m.files, sharded(Algorithm::Sha256, 1000));
        let Expected::Shards(s) = &m.files["model.safetensors"] else { panic!() };
        assert_eq!(s.iter().map(|s| (s.start, s.end)).collect::<Vec<_>>(), [(0, 1000), (1000, 2000), (2000, 2480)]);

        let m = read("blake2-shards.sig", &key("key.pub")).expect("blake2-shards.sig");
        assert_eq!(m.files, sharded(Algorithm::Blake2b, 1000));
    }

    #[test]
    fn blake2_and_blake3_manifests() {
        let m = read("blake2.sig", &key("key.pub")).expect("blake2.sig");
        assert_eq!(m.files, whole(Algorithm::Blake2b));
        let Expected::Whole(d) = &m.files["model.safetensors"] else { panic!() };
        assert_eq!(d.bytes.len(), 64);
        let m = read("blake3.sig", &key("key.pub")).expect("blake3.sig");
        assert_eq!(m.files, whole(Algorithm::Blake3));
    }

    #[test]
    fn older_formats_model_signing_still_accepts() {
        // No key hint (model_signing warns), the 0.2 PAE, the 0.2 statement with rawBytes keys.
        for sig in ["nohint.sig", "compat-pae.sig", "v01.sig"] {
            let m = read(sig, &key("key.pub")).unwrap_or_else(|e| panic!("{sig}: {e}"));
            assert_eq!(m.files, whole(Algorithm::Sha256), "{sig}");
        }
    }

    #[test]
    fn a_certificate_chain_to_a_given_root() {
        let m = read("cert.sig", &chain(&["root.pem"])).expect("cert.sig verifies with root.pem");
        assert_eq!(m.origin, "cert.sig (certificate chain root.pem)");
        assert_eq!(m.files, whole(Algorithm::Sha256));
        // The intermediate among the trusted certificates too, or only there.
        read("cert.sig", &chain(&["root.pem", "inter.pem"])).expect("root and intermediate");
        read("cert-leaf-only.sig", &chain(&["inter.pem", "root.pem"])).expect("intermediate given, not bundled");
        // No key usage but the codeSigning extended key usage, and a P-384 key.
        let m = read("cert-eku.sig", &chain(&["root.pem"])).expect("cert-eku.sig");
        assert_eq!(m.files, whole(Algorithm::Sha256));
    }

    #[test]
    fn signatures_model_signing_refuses_are_refused() {
        let cases: Vec<(&str, Trust, &str)> = vec![
            ("key.sig", key("other.pub"), "invalid: the bundle was signed with another key: its key hint is"),
            ("key.sig", key("key384.pub"), "invalid: the bundle was signed with another key"),
            ("key384.sig", key("key.pub"), "invalid: the bundle was signed with another key"),
            ("nohint.sig", key("other.pub"), "invalid: the envelope's signature is not one made by other.pub"),
            ("key.sig", key("rsa.pub"), "unsupported: rsa.pub is not an elliptic-curve key"),
            ("key.sig", chain(&["root.pem"]), "invalid: the bundle carries a public key, not a certificate chain"),
            ("cert.sig", key("cert.pub"), "invalid: the bundle carries a certificate, not a public key"),
            ("cert.sig", chain(&["other-root.pem"]), "invalid: the signing certificate does not chain to other-root.pem"),
            ("cert.sig", chain(&["inter.pem"]), "invalid: none of the given certificates (inter.pem) is self-signed"),
            ("cert-leaf-only.sig", chain(&["root.pem"]), "invalid: the signing certificate does not chain to root.pem"),
            ("cert-nousage.sig", chain(&["root.pem"]), "invalid: the signing certificate cannot be used for signing"),
            // OpenSSL's rules for issuers, which webpki leaves out.
            ("cert.sig", chain(&["root-not-ca.pem"]), "invalid: the signing certificate does not chain to root-not-ca.pem at its notBefore (2025-01-01T00:00:00Z): certificate 'CN=OMS test root' issues a certificate of the chain but is not a CA (basicConstraints CA:FALSE)"),
            ("cert.sig", chain(&["root-pathlen0.pem"]), "invalid: the signing certificate does not chain to root-pathlen0.pem at its notBefore (2025-01-01T00:00:00Z): certificate 'CN=OMS test root' allows 0 issuers below it (pathLenConstraint), and the chain has 1"),
            ("cert.sig", chain(&["root-no-certsign.pem"]), "invalid: the signing certificate does not chain to root-no-certsign.pem at its notBefore (2025-01-01T00:00:00Z): certificate 'CN=OMS test root' issues a certificate of the chain but is not a CA (its key usage does not allow certificate signing)"),
            ("cert-inter-no-certsign.sig", chain(&["root.pem"]), "invalid: the signing certificate does not chain to root.pem at its notBefore (2025-01-01T00:00:00Z): certificate 'CN=OMS test intermediate' issues a certificate of the chain but is not a CA (its key usage does not allow certificate signing)"),
            (
                "cert-expired-inter.sig",
                chain(&["root.pem"]),
                "invalid: the signing certificate does not chain to root.pem at its notBefore (2025-01-01T00:00:00Z): certificate 'CN=OMS test expired intermediate' expired at 2022-01-01T00:00:00Z",
            ),
            ("bad-flipped-payload.sig", key("key.pub"), "invalid: the envelope's signature is not one made by key.pub"),
            ("bad-edited-sig.sig", key("key.pub"), "invalid: the envelope's signature is not one made by key.pub"),
            ("bad-no-signatures.sig", key("key.pub"), "invalid: the DSSE envelope holds no signatures"),
            ("bad-media-type.sig", key("key.pub"), "unsupported: bundle media type 'application/vnd.dev.sigstore.bundle+json;version=0.2'"),
            ("bad-base64.sig", key("key.pub"), "invalid: dsseEnvelope.payload is not base64"),
            ("bad-json.sig", key("key.pub"), "invalid: not a sigstore bundle: EOF while parsing"),
            ("bad-message-signature.sig", key("key.pub"), "unsupported: the bundle holds a messageSignature"),
            ("bad-payload-type.sig", key("key.pub"), "unsupported: the DSSE payload type is 'application/json'"),
            ("bad-statement-type.sig", key("key.pub"), "unsupported: the payload is a 'https://in-toto.io/Statement/v0.1' statement"),
            ("bad-predicate-type.sig", key("key.pub"), "unsupported: the statement's predicate type is 'https://slsa.dev/provenance/v1'"),
            ("bad-subject-digest.sig", key("key.pub"), "invalid: the statement is inconsistent: its subject digest is"),
            ("bad-two-subjects.sig", key("key.pub"), "unsupported: the statement has 2 subjects"),
            ("bad-hash-md5.sig", key("key.pub"), "unsupported: hash algorithm 'md5' is not supported"),
            ("bad-method.sig", key("key.pub"), "unsupported: serialization method 'tensors'"),
            ("bad-name-dotdot.sig", key("key.pub"), "unsupported: '../model/config.json' leads out of the model's directory"),
            ("bad-shard-gap.sig", key("key.pub"), "unsupported: the shards of 'model.safetensors' are not the 1000-byte pieces"),
        ];
        for (sig, trust, want) in cases {
            assert_refused(read(sig, &trust), want, sig);
        }
    }

    #[test]
    fn chains_are_judged_as_openssl_judges_them() {
        // A signing certificate that is a CA (model_signing's own test PKI has one).
        let m = read("cert-ca.sig", &chain(&["root.pem"])).expect("a CA signing certificate");
        assert_eq!(m.files, whole(Algorithm::Sha256));
        // The root's dates count at the signing time (the leaf's notBefore, 2025-01-01T00:00:00Z),
        // both ends included.
        for root in ["root-starts-at-signing.pem", "root-ends-at-signing.pem"] {
            read("cert.sig", &chain(&[root])).unwrap_or_else(|e| panic!("{root}: {e}"));
        }
        let at = "invalid: the signing certificate does not chain to";
        for (root, why) in [
            ("root-expired.pem", "certificate 'CN=OMS test root' expired at 2024-06-01T00:00:00Z"),
            ("root-ends-before-signing.pem", "certificate 'CN=OMS test root' expired at 2024-12-31T23:59:59Z"),
            ("root-not-yet.pem", "certificate 'CN=OMS test root' is valid from 2026-01-01T00:00:00Z only"),
        ] {
            let want = format!("{at} {root} at its notBefore (2025-01-01T00:00:00Z): {why}");
            assert_refused(read("cert.sig", &chain(&[root])), &want, root);
        }
        // A self-signed signing certificate is a chain of one when it is the one given, and
        // nothing otherwise.
        read("self-signed.sig", &chain(&["self-signed.pem"])).expect("a chain of one");
        assert_refused(
            read("self-signed.sig", &chain(&["root.pem"])),
            &format!("{at} root.pem at its notBefore (2025-01-01T00:00:00Z): the signing certificate is self-signed, and not one of the given certificates"),
            "self-signed, not given",
        );
    }

    #[test]
    fn signatures_of_a_single_file_and_of_older_releases() {
        // model_signing 1.1.1 and 1.0.0 name the file of a single-file signature `.`; 1.0.0
        // writes the key as rawBytes and keyDetails, without a hint (model_signing warns).
        let digest = Expected::Whole(digest(Algorithm::Sha256, "model.safetensors", None));
        for sig in ["single.sig", "v1.0.0-single.sig"] {
            let m = read(sig, &key("key.pub")).unwrap_or_else(|e| panic!("{sig}: {e}"));
            assert_eq!(m.files, BTreeMap::from([(SINGLE_FILE.to_owned(), digest.clone())]), "{sig}");
            assert!(m.single_file());
            assert_eq!(m.entry_for("/anywhere/renamed.bin").map(|(n, _)| n), Some(SINGLE_FILE));
        }
        let raw: Value = serde_json::from_slice(&bytes("v1.0.0-key.sig")).expect("JSON");
        assert!(raw["verificationMaterial"]["publicKey"]["rawBytes"].is_string(), "the older format");
        let m = read("v1.0.0-key.sig", &key("key.pub")).expect("v1.0.0-key.sig");
        assert_eq!(m.files, whole(Algorithm::Sha256));
        // model_signing 0.2.0: a subject per file, its PAE; a certificate chain and a key.
        let m = read("v0.2.0-cert.sig", &chain(&["root.pem"])).expect("v0.2.0-cert.sig");
        assert_eq!(m.files, whole(Algorithm::Sha256));
        assert_eq!(m.allow_symlinks, None);
        let m = read("v0.2.0-key.sig", &key("key.pub")).expect("v0.2.0-key.sig");
        assert_eq!(m.files, whole(Algorithm::Sha256));
        assert_refused(
            read("v0.2.0-key.sig", &key("other.pub")),
            "invalid: the envelope's signature is not one made by other.pub",
            "0.2.0 other key",
        );
    }

    #[test]
    fn the_paths_a_signature_leaves_out_and_its_links_rule() {
        let m = read("ignore.sig", &key("key.pub")).expect("ignore.sig");
        let mut files = whole(Algorithm::Sha256);
        files.remove("sub/notes.txt");
        assert_eq!(m.files, files);
        assert!(m.ignored.iter().any(|p| p == "sub"), "{:?}", m.ignored);
        assert_eq!(m.allow_symlinks, Some(false));
    }

    #[test]
    fn what_is_not_verified_here_says_so() {
        // model_signing verifies P-521 signatures; ring has no P-521.
        assert_refused(read("key521.sig", &key("key521.pub")), "unsupported: key521.pub is a P-521 key", "P-521");
        // No certificates: model_signing would trust certifi's web roots.
        assert_refused(read("cert.sig", &Trust::CertificateChain(vec![])), "unsupported: no certificates", "no roots");
    }

    #[test]
    fn trust_files_that_cannot_be_used() {
        let e = read("key.sig", &key("missing.pub")).expect_err("no such key");
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        // A certificate is not a public key (model_signing's load_pem_public_key refuses it too).
        assert_refused(read("key.sig", &key("root.pem")), "invalid: root.pem holds no PEM public key", "cert as key");
        assert_refused(
            read("cert.sig", &chain(&["key.pub"])),
            "invalid: key.pub holds no PEM certificate",
            "key as cert",
        );
        let e = read("cert.sig", &chain(&["root.pem", "missing.pem"])).expect_err("no such certificate file");
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
    }

    fn remove(value: &mut Value, key: &str) {
        value.as_object_mut().expect("an object").remove(key);
    }

    fn push(list: &mut Value, item: Value) {
        list.as_array_mut().expect("a list").push(item);
    }

    /// key.sig (or another fixture) as JSON, edited.
    fn edited(sig: &str, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        let mut bundle: Value = serde_json::from_slice(&bytes(sig)).expect("fixture JSON");
        edit(&mut bundle);
        serde_json::to_vec(&bundle).expect("JSON")
    }

    #[test]
    fn malformed_bundles_name_the_problem() {
        let trust = key("key.pub");
        let verify = |bundle: &[u8]| read_signature(bundle, "m.sig", &trust);
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            // model_signing: json.loads fails, or pydantic refuses the shape (extra="forbid").
            ("empty", vec![], "invalid: not a sigstore bundle: EOF while parsing a value at line 1 column 0"),
            ("null", b"null".to_vec(), "invalid: not a sigstore bundle: invalid type: null"),
            ("a list", b"[]".to_vec(), "invalid: not a sigstore bundle: a JSON list where the bundle has an object"),
            (
                // serde would read the bundle from the list of its fields in order.
                "the envelope as a list",
                edited("key.sig", |b| {
                    let e = b["dsseEnvelope"].clone();
                    b["dsseEnvelope"] = json!([e["payload"], e["payloadType"], e["signatures"]]);
                }),
                "invalid: not a sigstore bundle: a JSON list where the bundle has an object",
            ),
            ("not UTF-8", b"\xff\xfe".to_vec(), "invalid: not a sigstore bundle: expected value"),
            (
                "unknown field",
                edited("key.sig", |b| b["extra"] = json!(1)),
                "invalid: not a sigstore bundle: unknown field `extra`",
            ),
            (
                "no verification material",
                edited("key.sig", |b| remove(b, "verificationMaterial")),
                "invalid: not a sigstore bundle: missing field `verificationMaterial`",
            ),
            (
                "no media type",
                edited("key.sig", |b| remove(b, "mediaType")),
                "invalid: not a sigstore bundle: missing field `mediaType`",
            ),
            (
                "unknown key field",
                edited("key.sig", |b| b["verificationMaterial"]["publicKey"]["kid"] = json!("x")),
                "invalid: not a sigstore bundle: unknown field `kid`",
            ),
            (
                "two verification materials",
                edited("key.sig", |b| b["verificationMaterial"]["x509CertificateChain"] = json!({"certificates": []})),
                "invalid: the bundle's verificationMaterial must hold exactly one of",
            ),
            (
                "no verification material kind",
                edited("key.sig", |b| b["verificationMaterial"] = json!({"tlogEntries": []})),
                "invalid: the bundle's verificationMaterial must hold exactly one of",
            ),
            (
                "envelope and message signature",
                edited("key.sig", |b| b["messageSignature"] = json!({})),
                "invalid: the bundle must hold exactly one of dsseEnvelope and messageSignature",
            ),
            (
                "no content",
                edited("key.sig", |b| remove(b, "dsseEnvelope")),
                "invalid: the bundle must hold exactly one of dsseEnvelope and messageSignature",
            ),
            (
                "signature not base64",
                edited("key.sig", |b| b["dsseEnvelope"]["signatures"][0]["sig"] = json!("MEUC!!==")),
                "invalid: dsseEnvelope.signatures[0].sig is not base64",
            ),
            (
                // Python's b64decode would skip the '*': refused here (stricter).
                "payload with a character outside base64",
                edited("key.sig", |b| {
                    let p = b["dsseEnvelope"]["payload"].as_str().expect("payload").to_owned();
                    b["dsseEnvelope"]["payload"] = json!(format!("*{p}"));
                }),
                "invalid: dsseEnvelope.payload is not base64",
            ),
            (
                "a second signature not base64",
                edited("key.sig", |b| {
                    push(&mut b["dsseEnvelope"]["signatures"], json!({"sig": "?", "keyid": ""}));
                }),
                "invalid: dsseEnvelope.signatures[1].sig is not base64",
            ),
            (
                "keyid not a string",
                edited("key.sig", |b| b["dsseEnvelope"]["signatures"][0]["keyid"] = json!(5)),
                "invalid: not a sigstore bundle: invalid type: integer `5`, expected a string",
            ),
            (
                // model_signing checks the first signature only.
                "a good signature after a bad one",
                edited("key.sig", |b| {
                    let good = b["dsseEnvelope"]["signatures"][0].clone();
                    b["dsseEnvelope"]["signatures"] = json!([{"sig": "MEUCIQ==", "keyid": ""}, good]);
                }),
                "invalid: the envelope's signature is not one made by key.pub",
            ),
            (
                // model_signing: its PAE has the in-toto type, so the signature still verifies,
                // and then the payload type is refused.
                "payload type edited",
                edited("key.sig", |b| b["dsseEnvelope"]["payloadType"] = json!("text/plain")),
                "unsupported: the DSSE payload type is 'text/plain'",
            ),
            (
                "sigstore 0.3 media type of the other spelling",
                edited("key.sig", |b| b["mediaType"] = json!("application/vnd.dev.sigstore.bundle+json;version=0.3")),
                "unsupported: bundle media type 'application/vnd.dev.sigstore.bundle+json;version=0.3'",
            ),
            (
                // model_signing's key verifier reads `public_key.hint` of None.
                "a single certificate, as keyless bundles carry",
                edited("key.sig", |b| b["verificationMaterial"] = json!({"certificate": {"rawBytes": "MA=="}})),
                "invalid: the bundle is a keyless (Sigstore) one, not signed with a key",
            ),
        ];
        for (case, bundle, want) in cases {
            assert_refused(verify(&bundle), want, case);
        }

        // What model_signing accepts: no tlogEntries (it adds them), an empty hint, no keyid, a
        // second signature it does not look at.
        let good = whole(Algorithm::Sha256);
        let accepted: Vec<(&str, Vec<u8>)> = vec![
            ("no tlogEntries", edited("key.sig", |b| remove(&mut b["verificationMaterial"], "tlogEntries"))),
            ("empty hint", edited("key.sig", |b| b["verificationMaterial"]["publicKey"]["hint"] = json!(""))),
            ("null hint", edited("key.sig", |b| b["verificationMaterial"]["publicKey"]["hint"] = json!(null))),
            ("no keyid", edited("key.sig", |b| remove(&mut b["dsseEnvelope"]["signatures"][0], "keyid"))),
            (
                "a second signature",
                edited("key.sig", |b| {
                    push(&mut b["dsseEnvelope"]["signatures"], json!({"sig": "MA==", "keyid": "x"}));
                }),
            ),
        ];
        for (case, bundle) in accepted {
            let m = verify(&bundle).unwrap_or_else(|e| panic!("{case}: {e}"));
            assert_eq!(m.files, good, "{case}");
        }

        // The certificate path: an empty chain, a chain whose signing certificate is garbage.
        let roots = chain(&["root.pem"]);
        let empty =
            edited("cert.sig", |b| b["verificationMaterial"]["x509CertificateChain"]["certificates"] = json!([]));
        assert_refused(
            read_signature(&empty, "c.sig", &roots),
            "invalid: the bundle's certificate chain is empty",
            "empty chain",
        );
        let garbage = edited("cert.sig", |b| {
            b["verificationMaterial"]["x509CertificateChain"]["certificates"][0]["rawBytes"] = json!("MAMCAQE=")
        });
        assert_refused(
            read_signature(&garbage, "c.sig", &roots),
            "invalid: the bundle's signing certificate cannot be read",
            "garbage certificate",
        );
        let garbage = edited("cert.sig", |b| {
            b["verificationMaterial"]["x509CertificateChain"]["certificates"][1]["rawBytes"] = json!("MAMCAQE=")
        });
        assert_refused(
            read_signature(&garbage, "c.sig", &chain(&["root.pem", "inter.pem"])),
            "invalid: the bundle's certificate 1 is not DER X.509",
            "garbage intermediate",
        );
        let single = edited("cert.sig", |b| b["verificationMaterial"] = json!({"certificate": {"rawBytes": "MA=="}}));
        assert_refused(
            read_signature(&single, "c.sig", &roots),
            "invalid: the bundle is a keyless (Sigstore) one: verify it with the signer's identity",
            "keyless-style certificate",
        );
        let other: Value = serde_json::from_slice(&bytes("key.sig")).expect("JSON");
        let resigned = edited("cert.sig", |b| b["dsseEnvelope"] = other["dsseEnvelope"].clone());
        assert_refused(
            read_signature(&resigned, "c.sig", &roots),
            "invalid: the envelope's signature is not one made by the signing certificate's key",
            "another key's envelope",
        );
    }

    /// Flipping a bit of any byte of a signature file never yields another manifest: it is
    /// refused, or (a bit base64 does not use, a hint's hex case...) reads as the same.
    #[test]
    fn no_edited_byte_verifies_to_another_manifest() {
        for (sig, trust) in [("key.sig", key("key.pub")), ("cert.sig", chain(&["root.pem"]))] {
            let good = read(sig, &trust).expect("fixture verifies");
            let original = bytes(sig);
            let mut accepted = 0;
            for i in 0..original.len() {
                for bit in [0x01, 0x20] {
                    let mut b = original.clone();
                    b[i] ^= bit;
                    if let Ok(m) = read_signature(&b, sig, &trust) {
                        assert_eq!(m, good, "{sig}: byte {i} ^ {bit:#x} verifies to another manifest");
                        accepted += 1;
                    }
                }
            }
            // Only unused base64 bits: a handful at most.
            assert!(accepted <= 8, "{sig}: {accepted} edits still verify");
        }
    }

    /// A v1.0 statement of `resources` (name, algorithm, hex) with its subject digest right.
    fn statement(serialization: Value, resources: &[(&str, &str, &str)]) -> Vec<u8> {
        let mut h = Algorithm::Sha256.hasher();
        for (_, _, hex) in resources {
            h.update(&parse_hex_or_empty(hex));
        }
        statement_with_root(serialization, resources, &h.finish().hex())
    }

    fn parse_hex_or_empty(hex: &str) -> Vec<u8> {
        super::super::parse_hex(hex).unwrap_or_default()
    }

    fn statement_with_root(serialization: Value, resources: &[(&str, &str, &str)], root: &str) -> Vec<u8> {
        let resources: Vec<Value> =
            resources.iter().map(|(n, a, d)| json!({"name": n, "algorithm": a, "digest": d})).collect();
        raw(json!({
            "_type": STATEMENT_TYPE,
            "subject": [{"name": "model", "digest": {"sha256": root}}],
            "predicateType": PREDICATE_TYPE,
            "predicate": {"serialization": serialization, "resources": resources},
        }))
    }

    fn raw(statement: Value) -> Vec<u8> {
        serde_json::to_vec(&statement).expect("JSON")
    }

    fn files(hash: &str) -> Value {
        json!({"method": "files", "hash_type": hash, "allow_symlinks": false})
    }

    fn shards(hash: &str, size: Value) -> Value {
        json!({"method": "shards", "hash_type": hash, "shard_size": size, "allow_symlinks": false, "ignore_paths": [".git"]})
    }

    fn why(result: Check<BTreeMap<String, Expected>>) -> String {
        match result {
            Ok(files) => panic!("accepted: {:?}", files.keys().collect::<Vec<_>>()),
            Err(Fail::Invalid(why)) => format!("invalid: {why}"),
            Err(Fail::Unsupported(why)) => format!("unsupported: {why}"),
            Err(Fail::Io(e)) => format!("io: {e}"),
        }
    }

    const H1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const H2: &str = "2222222222222222222222222222222222222222222222222222222222222222";
    const H3: &str = "3333333333333333333333333333333333333333333333333333333333333333";

    #[test]
    fn statements_are_read_as_model_signing_reads_them() {
        let sha = |hex: &str| Digest::from_hex("sha256", hex).expect("hex");
        // Names as PurePosixPath reads them.
        let m =
            manifest_of(&statement(files("sha256"), &[("./a//b/", "sha256", H1), ("c", "sha256", H2)])).expect("ok");
        assert_eq!(
            m,
            BTreeMap::from([("a/b".into(), Expected::Whole(sha(H1))), ("c".into(), Expected::Whole(sha(H2)))])
        );
        // Upper-case hex digests (bytes.fromhex takes them); a name twice with one digest.
        let upper = H1.replace('1', "A");
        let m = manifest_of(&statement(files("sha256"), &[("a", "sha256", &upper), ("./a", "sha256", &upper)]))
            .expect("ok");
        assert_eq!(m.len(), 1);
        // blake2 spelled either way, as the serialization (blake2b) and the API (blake2) do.
        let b2 = "ab".repeat(64);
        let m = manifest_of(&statement(files("blake2b"), &[("a", "blake2", &b2)])).expect("blake2");
        assert_eq!(m["a"], Expected::Whole(Digest::from_hex("blake2", &b2).expect("hex")));
        // Shards out of order come back sorted; shard_size as protobuf writes it (1000.0).
        let m = manifest_of(&statement(
            shards("sha256", json!(1000.0)),
            &[
                ("f:1000:1500", "sha256-sharded-1000", H2),
                ("f:0:1000", "sha256-sharded-1000", H1),
                ("g:0:5", "sha256-sharded-1000", H3),
            ],
        ))
        .expect("shards");
        assert_eq!(
            m["f"],
            Expected::Shards(vec![
                Shard { start: 0, end: 1000, digest: sha(H1) },
                Shard { start: 1000, end: 1500, digest: sha(H2) }
            ])
        );
        assert_eq!(m["g"], Expected::Shards(vec![Shard { start: 0, end: 5, digest: sha(H3) }]));
        // A signature of a single file: its name is `.` (PurePosixPath("") and "./." too), as a
        // file and as shards.
        for name in [".", "", "./."] {
            let m = manifest_of(&statement(files("sha256"), &[(name, "sha256", H1)])).expect("a single file");
            assert_eq!(m, BTreeMap::from([(".".into(), Expected::Whole(sha(H1)))]), "{name:?}");
        }
        let m = manifest_of(&statement(
            shards("sha256", json!(1000)),
            &[(".:0:1000", "sha256-sharded-1000", H1), ("./:1000:1200", "sha256-sharded-1000", H2)],
        ))
        .expect("a single file's shards");
        assert_eq!(
            m["."],
            Expected::Shards(vec![
                Shard { start: 0, end: 1000, digest: sha(H1) },
                Shard { start: 1000, end: 1200, digest: sha(H2) }
            ])
        );
        // What the serialization records: the paths left out (those outside the model dropped,
        // as model_signing drops them), and whether links were followed.
        let recorded = statement_of(&statement(
            json!({"method": "files", "hash_type": "sha256", "allow_symlinks": true,
                "ignore_paths": ["ignore-me", "./sub//", "../out", "/abs", ".git"]}),
            &[("a", "sha256", H1)],
        ))
        .expect("statement");
        assert_eq!(recorded.ignored, ["ignore-me", "sub", ".git"]);
        assert_eq!(recorded.allow_symlinks, Some(true));
        let unrecorded = statement_of(&statement(files("sha256"), &[])).expect("statement");
        assert!(unrecorded.ignored.is_empty());
        assert_eq!(unrecorded.allow_symlinks, Some(false));
        // No resources: an empty manifest (model_signing's verify then finds every file extra).
        assert!(manifest_of(&statement(files("sha256"), &[])).expect("empty").is_empty());
        // A v0.1 statement.
        let v01 = json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE_V01, "predicate": {},
            "subject": [{"name": "x/y", "digest": {"sha256": H1}}]});
        let m = manifest_of(&serde_json::to_vec(&v01).expect("JSON")).expect("v0.1");
        assert_eq!(m, BTreeMap::from([("x/y".into(), Expected::Whole(sha(H1)))]));
    }

    #[test]
    fn statements_model_signing_refuses_are_refused() {
        let s = |ser: Value, r: &[(&str, &str, &str)]| statement(ser, r);
        let size = |n: u64| shards("sha256", json!(n));
        let sh = "sha256-sharded-1000";
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            // json.loads / KeyError / ValueError in dsse_payload_to_manifest.
            ("not JSON", b"{".to_vec(), "unsupported: the signed payload is not JSON"),
            ("not an object", b"[1]".to_vec(), "unsupported: the statement is not a JSON object"),
            ("no _type", br#"{"predicateType": 1}"#.to_vec(), "unsupported: the statement has no _type"),
            (
                "no predicate type",
                raw(json!({"_type": STATEMENT_TYPE})),
                "unsupported: the statement has no predicateType",
            ),
            (
                "no subject",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE})),
                "unsupported: the statement has no subject",
            ),
            (
                "no subject",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE, "subject": []})),
                "unsupported: the statement has 0 subjects",
            ),
            (
                "subject without sha256",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
                    "subject": [{"name": "m", "digest": {"sha512": H1}}]})),
                "unsupported: the statement has no subject[0].digest.sha256",
            ),
            (
                "no predicate",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
                    "subject": [{"name": "m", "digest": {"sha256": H1}}]})),
                "unsupported: the statement has no predicate",
            ),
            ("no method", s(json!({"hash_type": "sha256", "allow_symlinks": false}), &[]), "unsupported: the statement has no predicate.serialization.method"),
            ("no hash_type", s(json!({"method": "files", "allow_symlinks": false}), &[]), "unsupported: the statement has no predicate.serialization.hash_type"),
            ("no allow_symlinks", s(json!({"method": "files", "hash_type": "sha256"}), &[]), "unsupported: the statement has no predicate.serialization.allow_symlinks"),
            ("no shard_size", s(json!({"method": "shards", "hash_type": "sha256", "allow_symlinks": false}), &[]), "unsupported: the statement has no predicate.serialization.shard_size"),
            ("shard_size 0", s(shards("sha256", json!(0)), &[]), "unsupported: the serialization's shard_size 0 is not a positive whole number"),
            ("shard_size 1000.5", s(shards("sha256", json!(1000.5)), &[]), "unsupported: the serialization's shard_size 1000.5"),
            ("shard_size a string", s(shards("sha256", json!("1000")), &[]), "unsupported: the serialization's shard_size \"1000\""),
            (
                "resources not a list",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
                    "subject": [{"name": "m", "digest": {"sha256": H1}}],
                    "predicate": {"serialization": files("sha256"), "resources": {"a": 1}}})),
                "unsupported: the statement's predicate.resources is not a list",
            ),
            (
                "resource without digest",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
                    "subject": [{"name": "m", "digest": {"sha256": H1}}],
                    "predicate": {"serialization": files("sha256"), "resources": [{"name": "a", "algorithm": "sha256"}]}})),
                "unsupported: the statement has no predicate.resources[0].digest",
            ),
            (
                "resource name not a string",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
                    "subject": [{"name": "m", "digest": {"sha256": H1}}],
                    "predicate": {"serialization": files("sha256"), "resources": [{"name": 1, "algorithm": "sha256", "digest": H1}]}})),
                "unsupported: the statement's predicate.resources[0].name is not a string",
            ),
            ("digest not hex", s(files("sha256"), &[("a", "sha256", "xyz")]), "unsupported: predicate.resources[0].digest 'xyz' is not hex"),
            // The subject digest is checked as a string: upper case is not what Python computes.
            ("subject digest", statement_with_root(files("sha256"), &[("a", "sha256", H1)], H2), "invalid: the statement is inconsistent: its subject digest is 2222"),
            (
                "subject digest in upper case",
                {
                    let mut h = Algorithm::Sha256.hasher();
                    h.update(&parse_hex_or_empty(H1));
                    statement_with_root(files("sha256"), &[("a", "sha256", H1)], &h.finish().hex().to_uppercase())
                },
                "invalid: the statement is inconsistent",
            ),
            // What model_signing's verify refuses when it hashes the model.
            ("unknown hash", s(files("sha512"), &[("a", "sha512", H1)]), "unsupported: hash algorithm 'sha512' is not supported"),
            ("unknown method", s(json!({"method": "tensors", "hash_type": "sha256", "allow_symlinks": false}), &[]), "unsupported: serialization method 'tensors'"),
            ("resource of another algorithm", s(files("sha256"), &[("a", "blake3", H1)]), "unsupported: 'a' is hashed with 'blake3' where the serialization says 'sha256'"),
            ("digest of the wrong length", s(files("sha256"), &[("a", "sha256", "abcd")]), "unsupported: 'a': a sha256 digest is 64 hex digits, not 4"),
            ("a sharded digest in a files manifest", s(files("sha256"), &[("a", sh, H1)]), "unsupported: 'a' is hashed with 'sha256-sharded-1000'"),
            ("a file digest in a shards manifest", s(size(1000), &[("a:0:5", "sha256", H1)]), "unsupported: 'a:0:5' is hashed with 'sha256' where the serialization says 'sha256-sharded-1000'"),
            ("another shard size", s(size(1000), &[("a:0:5", "sha256-sharded-999", H1)]), "unsupported: 'a:0:5' is hashed with 'sha256-sharded-999'"),
            ("blake3 shards", s(shards("blake3", json!(1000)), &[("a:0:5", "blake3-sharded-1000", H1)]), "unsupported: a blake3 manifest by shards"),
            ("a shard name of two parts", s(size(1000), &[("a:5", sh, H1)]), "unsupported: shard 'a:5' is not named path:start:end"),
            ("a name with a colon", s(size(1000), &[("a:b:0:5", sh, H1)]), "unsupported: shard 'a:b:0:5' is not named path:start:end"),
            ("a negative offset", s(size(1000), &[("a:-1:5", sh, H1)]), "unsupported: shard 'a:-1:5' does not end in two byte offsets"),
            ("an offset with a sign", s(size(1000), &[("a:+0:5", sh, H1)]), "unsupported: shard 'a:+0:5' does not end in two byte offsets"),
            ("an empty offset", s(size(1000), &[("a::5", sh, H1)]), "unsupported: shard 'a::5' does not end in two byte offsets"),
            ("a shard not at 0", s(size(1000), &[("a:1:5", sh, H1)]), "unsupported: the shards of 'a' are not the 1000-byte pieces model_signing makes of a file: 1..5 after 0"),
            ("an empty shard", s(size(1000), &[("a:0:0", sh, H1)]), "unsupported: the shards of 'a'"),
            ("a backwards shard", s(size(1000), &[("a:0:1000", sh, H1), ("a:1000:999", sh, H2)]), "unsupported: the shards of 'a'"),
            ("a gap", s(size(1000), &[("a:0:1000", sh, H1), ("a:1001:1500", sh, H2)]), "unsupported: the shards of 'a' are not the 1000-byte pieces model_signing makes of a file: 1001..1500 after 1000"),
            ("an overlap", s(size(1000), &[("a:0:1000", sh, H1), ("a:999:1500", sh, H2)]), "unsupported: the shards of 'a'"),
            ("a short shard before the last", s(size(1000), &[("a:0:500", sh, H1), ("a:500:1500", sh, H2)]), "unsupported: the shards of 'a'"),
            ("a shard longer than shard_size", s(size(1000), &[("a:0:1001", sh, H1)]), "unsupported: the shards of 'a'"),
            ("a shard twice, two digests", s(size(1000), &[("a:0:5", sh, H1), ("a:0:5", sh, H2)]), "unsupported: 'a:0:5' is listed twice, with two digests"),
            ("a file twice, two digests", s(files("sha256"), &[("a", "sha256", H1), ("./a", "sha256", H2)]), "unsupported: 'a' is listed twice, with two digests"),
            // Names no model file can have (model_signing: "Missing files").
            ("an absolute name", s(files("sha256"), &[("/etc/passwd", "sha256", H1)]), "unsupported: '/etc/passwd' is an absolute path"),
            ("a name out of the directory", s(files("sha256"), &[("a/../../b", "sha256", H1)]), "unsupported: 'a/../../b' leads out of the model's directory"),
            // `.` is the file of a signature of a single file: alone, or no model matches.
            ("the single file beside another", s(files("sha256"), &[("./.", "sha256", H1), ("a", "sha256", H2)]), "unsupported: '.' (the file of a signature of a single file) is listed beside other files"),
            ("a single file's shard beside another", s(size(1000), &[(".:0:5", sh, H1), ("a:0:5", sh, H2)]), "unsupported: '.' (the file of a signature of a single file)"),
            ("allow_symlinks not a bool", s(json!({"method": "files", "hash_type": "sha256", "allow_symlinks": "no"}), &[]), "unsupported: the statement's predicate.serialization.allow_symlinks is not true or false"),
            ("ignore_paths not a list", s(json!({"method": "files", "hash_type": "sha256", "allow_symlinks": false, "ignore_paths": "a"}), &[]), "unsupported: the statement's predicate.serialization.ignore_paths is not a list"),
            ("an ignore path not a string", s(json!({"method": "files", "hash_type": "sha256", "allow_symlinks": false, "ignore_paths": [1]}), &[]), "unsupported: the statement's predicate.serialization.ignore_paths[0] is not a string"),
            (
                "v0.1 subject without sha256",
                raw(json!({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE_V01,
                    "subject": [{"name": "a", "digest": {"md5": H1}}]})),
                "unsupported: the statement has no subject[0].digest.sha256",
            ),
        ];
        for (case, payload, want) in cases {
            let got = why(manifest_of(&payload));
            assert!(got.starts_with(want), "{case}: got '{got}', want '{want}...'");
        }
    }

    #[test]
    fn pre_authentication_encodings() {
        assert_eq!(pae(b"{}"), b"DSSEv1 28 application/vnd.in-toto+json 2 {}");
        assert_eq!(pae_compat(b"{\"k\": 1}\n"), b"DSSEV1 28 application/vnd.in-toto+json 9 b'{\"k\": 1}\\n'");
        // Python's repr of bytes, from python3 -c 'print(str(b))'.
        assert_eq!(python_bytes_repr(b"a'b"), r#"b"a'b""#);
        assert_eq!(python_bytes_repr(b"a'b\"c"), r#"b'a\'b"c'"#);
        assert_eq!(python_bytes_repr(b"\x00\x7f\x80\\\t\n\r ~"), r"b'\x00\x7f\x80\\\t\n\r ~'");
        assert_eq!(python_bytes_repr(b""), "b''");
    }

    #[test]
    fn the_key_hint_is_the_sha256_of_the_pem_cryptography_writes() {
        let pem = bytes("key.pub");
        let der = pem_blocks(&pem, "PUBLIC KEY", "key.pub").expect("PEM").remove(0);
        assert_eq!(pem_public_key(&der).as_bytes(), pem.as_slice(), "openssl and cryptography write the same PEM");
        let hint: Value = serde_json::from_slice(&bytes("key.sig")).expect("JSON");
        let mut h = Algorithm::Sha256.hasher();
        h.update(&pem);
        assert_eq!(hint["verificationMaterial"]["publicKey"]["hint"], json!(h.finish().hex()));
    }

    #[test]
    fn times_are_shown_in_utc() {
        assert_eq!(format_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_time(1_735_689_600), "2025-01-01T00:00:00Z");
        assert_eq!(format_time(951_825_600 + 3_723), "2000-02-29T13:02:03Z");
        assert_eq!(format_time(-631_152_000), "1950-01-01T00:00:00Z");
        assert_eq!(format_time(i64::MAX), format!("{} s after 1970", i64::MAX));
    }

    #[test]
    fn certificates_and_their_extensions_are_read_with_x509_parser() {
        let bundle: Value = serde_json::from_slice(&bytes("cert.sig")).expect("JSON");
        let raw = |i: usize| {
            base64_field(
                bundle["verificationMaterial"]["x509CertificateChain"]["certificates"][i]["rawBytes"]
                    .as_str()
                    .unwrap_or_default(),
                "certificate",
            )
            .expect("base64")
        };
        let leaf_der = raw(0);
        let leaf = chain::parse(&leaf_der).expect("leaf");
        assert_eq!(leaf.validity().not_before.timestamp(), 1_735_689_600);
        assert!(chain::Extensions::of(&leaf).expect("extensions").signs());
        let signer = Signer::of(leaf.public_key(), "leaf".into(), true).expect("an EC key");
        assert_eq!(signer.curve, Curve::P256);
        let root_der = pem_blocks(&bytes("root.pem"), "CERTIFICATE", "root.pem").expect("PEM").remove(0);
        let root = chain::parse(&root_der).expect("root");
        assert_eq!(root.subject(), root.issuer());
        assert_eq!(Signer::of(root.public_key(), "root".into(), false).ok().map(|s| s.curve), Some(Curve::P384));
        // What cannot be read is refused, never a panic: every truncation, trailing bytes.
        for len in 0..root_der.len() {
            assert!(chain::parse(&root_der[..len]).is_err(), "{len}");
        }
        let mut longer = root_der.clone();
        longer.push(0);
        assert_eq!(chain::parse(&longer).err().as_deref(), Some("1 bytes follow the certificate"));
        // The intermediate the bundle carries is read too.
        assert!(chain::parse(&raw(1)).is_ok());
    }
}
