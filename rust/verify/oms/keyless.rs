//! Keyless (Sigstore) bundles verified offline, as sigstore-python's
//! `Verifier(trusted_root=TrustedRoot.from_file(...)).verify_dsse(bundle, policy.Identity(
//! identity=..., issuer=...))` verifies them for `model_signing verify sigstore`.
//!
//! The checks are sigstore-rust's (`sigstore-verify`), against the trusted root given:
//!
//! 1. The time of signing: the entry's integrated time, authenticated by the log's signed entry
//!    timestamp, and the times of any RFC 3161 timestamps, each verified against the trusted
//!    root's timestamp authorities.
//! 2. The signing certificate chains to a certificate authority of the trusted root that was in
//!    force at each of those times, is valid at each, and has the codeSigning extended key usage.
//! 3. Its embedded signed certificate timestamp verifies with a CT log key of the trusted root.
//! 4. Its identity (subject alternative name) and OIDC issuer are those given.
//! 5. The entry's Merkle inclusion proof leads to the root hash of a checkpoint signed by a log
//!    key of the trusted root.
//! 6. The DSSE envelope's signature verifies with the certificate's key, and the log entry
//!    records this envelope's payload, signature and certificate.
//!
//! What sigstore-python checks besides, checked here too: the bundle has exactly one log entry,
//! and the OIDC issuer is read from the certificate's first issuer extension
//! (1.3.6.1.4.1.57264.1.1), which must be there. Where the two verifiers differ, this one
//! refuses more, never less: it matches the identity against the certificate's first email or
//! URI name (sigstore-python against any of its names), it requires the current issuer
//! extension (1.3.6.1.4.1.57264.1.8), where there is one, to name the same issuer, it holds the
//! trusted root's validity windows of authorities and keys against the signing time
//! (sigstore-python only against the present), and an RFC 3161 timestamp that does not verify
//! fails the bundle (sigstore-python drops it). Fulcio's certificates have one name and both
//! issuer extensions alike.
//!
//! The signatures themselves are checked with ring, through [`Ring`], sigstore-rust's
//! [`CryptoProvider`] for it.

use std::path::Path;
use std::sync::OnceLock;

use sigstore_verify::crypto::provider::{CryptoProvider, HashContext};
use sigstore_verify::crypto::{self, SigningScheme};
use sigstore_verify::trust_root::TrustedRoot;
use sigstore_verify::types::bundle::VerificationMaterialContent;
use sigstore_verify::types::{Bundle, HashAlgorithm, SignatureContent, Statement};
use sigstore_verify::{CertificateError, Error as SigstoreError, TransparencyLogError, VerificationPolicy, Verifier};

use super::{invalid, short, unsupported, Check, Fail};

/// What a verified keyless bundle signed.
pub(super) struct Signed {
    pub payload_type: String,
    pub payload: Vec<u8>,
}

/// The largest trusted root read (Sigstore's production root is 7 KB).
const MAX_TRUSTED_ROOT: u64 = 4 << 20;

/// The OIDC issuer extension sigstore-python reads (Fulcio's first, its value the raw URL).
const ISSUER_V1: &str = "1.3.6.1.4.1.57264.1.1";

/// The payload of `bundle` (its DSSE envelope's), once the bundle verifies against the Sigstore
/// trusted root in `trusted_root` (a `trusted_root.json`, or a client trust configuration
/// holding one) and was signed by `identity` on the word of the OIDC issuer `issuer`.
pub(super) fn verify(bundle: &[u8], trusted_root: &Path, identity: &str, issuer: &str) -> Check<Signed> {
    let root = read_trusted_root(trusted_root)?;
    let bundle = std::str::from_utf8(bundle).map_err(|e| Fail::Invalid(format!("not a sigstore bundle: {e}")))?;
    let bundle =
        Bundle::from_json(bundle).map_err(|e| Fail::Invalid(one_line(format!("not a sigstore bundle: {e}"))))?;
    let SignatureContent::DsseEnvelope(envelope) = &bundle.content else {
        return unsupported("the bundle holds a messageSignature, not the DSSE envelope model_signing writes");
    };
    match &bundle.verification_material.content {
        VerificationMaterialContent::Certificate(_) => {}
        VerificationMaterialContent::PublicKey(_) => {
            return invalid("the bundle is signed with a key, not keylessly: verify it with the public key")
        }
        _ => {
            return invalid(
                "the bundle carries a certificate chain, not a Sigstore signing certificate: verify it with its certificate chain",
            )
        }
    }
    let entries = bundle.verification_material.tlog_entries.len();
    if entries != 1 {
        return invalid(format!(
            "the bundle has {entries} transparency log entries, where a keyless bundle has one (sigstore-python refuses it too)"
        ));
    }
    // The envelope's payload is checked as what was signed, not against an artifact: the
    // statement's own subject is the artifact it is bound to (model_signing checks the subject
    // against the statement's resources as it reads them).
    let statement: Statement = serde_json::from_slice(envelope.payload.as_bytes())
        .map_err(|e| Fail::Invalid(one_line(format!("the envelope's payload is not an in-toto statement: {e}"))))?;
    let Some(subject) = statement.subject.iter().find_map(|s| s.digest.sha256) else {
        return invalid("the envelope's statement has no subject with a sha256 digest");
    };
    let certificate = bundle.signing_certificate().map(|c| c.as_bytes().to_vec()).unwrap_or_default();
    let policy = VerificationPolicy::new(identity, issuer);
    let outcome = std::panic::catch_unwind(|| {
        install_ring();
        let verifier = Verifier::new(&root).map_err(|e| trusted_root_error(trusted_root, &e))?;
        verifier.verify(subject, &bundle, &policy).map_err(|e| Fail::Invalid(explain(&e, &bundle, &root, &certificate)))
    });
    let result = match outcome {
        Ok(result) => result?,
        Err(_) => return invalid("the Sigstore verifier failed on this bundle (it panicked)"),
    };
    let times: Vec<i64> = result.verified_timestamps().iter().map(|t| t.as_second()).collect();
    issuer_in_force(&root, &certificate, &times)?;
    legacy_issuer(&certificate, issuer)?;
    Ok(Signed { payload_type: envelope.payload_type.clone(), payload: envelope.payload.as_bytes().to_vec() })
}

/// The trusted root in `path`: a `trusted_root.json`, or a client trust configuration
/// (`model_signing --trust_config`) whose `trustedRoot` it is.
fn read_trusted_root(path: &Path) -> Check<TrustedRoot> {
    let what = short(path);
    let bytes = crate::verify::read_small_file(path, MAX_TRUSTED_ROOT, "a Sigstore trusted root").map_err(Fail::Io)?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Fail::Invalid(format!("the trusted root {what} is not JSON: {e}")))?;
    let root = match json.get("trustedRoot") {
        Some(root) => root.to_string(),
        None => String::from_utf8_lossy(&bytes).into_owned(),
    };
    TrustedRoot::from_json(&root)
        .map_err(|e| Fail::Invalid(one_line(format!("{what} is not a Sigstore trusted root: {e}"))))
}

fn trusted_root_error(path: &Path, e: &SigstoreError) -> Fail {
    Fail::Invalid(one_line(format!("the trusted root {} cannot be used: {e}", short(path))))
}

/// That a certificate of the trusted root that issued the signing certificate was valid itself
/// at every time the signing was established at (seconds since 1970), as sigstore-python's
/// chain check (cryptography's) requires: sigstore-rust takes the trusted root's certificates
/// for trust anchors, whose own validity it does not look at.
fn issuer_in_force(root: &TrustedRoot, certificate: &[u8], times: &[i64]) -> Check<()> {
    let leaf = super::chain::parse(certificate)
        .map_err(|e| Fail::Invalid(format!("the signing certificate cannot be read: {e}")))?;
    let authorities = root.fulcio_certs();
    let issuers: Vec<_> = authorities
        .iter()
        .filter_map(|der| super::chain::parse(der.as_bytes()).ok())
        .filter(|ca| super::chain::issued_by(&leaf, ca))
        .collect();
    let valid = |ca: &x509_parser::certificate::X509Certificate<'_>| {
        let v = ca.validity();
        times.iter().all(|&t| v.not_before.timestamp() <= t && t <= v.not_after.timestamp())
    };
    if issuers.iter().any(valid) {
        return Ok(());
    }
    let Some(ca) = issuers.first() else {
        return invalid("no certificate of the trusted root issued the signing certificate");
    };
    let v = ca.validity();
    invalid(one_line(format!(
        "the certificate authority that issued the signing certificate ({}) was not valid when the entry was logged: \
         valid from {} to {}, logged at {}",
        ca.subject(),
        super::format_time(v.not_before.timestamp()),
        super::format_time(v.not_after.timestamp()),
        times.iter().map(|&t| super::format_time(t)).collect::<Vec<_>>().join(", ")
    )))
}

/// That the certificate's first OIDC issuer extension is there and names `issuer`, as
/// sigstore-python requires (sigstore-rust reads the current extension first).
fn legacy_issuer(certificate: &[u8], issuer: &str) -> Check<()> {
    let cert = super::chain::parse(certificate)
        .map_err(|e| Fail::Invalid(format!("the signing certificate cannot be read: {e}")))?;
    let found = cert.extensions().iter().find(|e| e.oid.to_id_string() == ISSUER_V1);
    match found.map(|e| std::str::from_utf8(e.value)) {
        Some(Ok(value)) if value == issuer => Ok(()),
        Some(Ok(value)) => invalid(one_line(format!(
            "the signing certificate's OIDC issuer is {value} (extension {ISSUER_V1}), not {issuer}"
        ))),
        Some(Err(_)) => invalid(format!("the signing certificate's OIDC issuer (extension {ISSUER_V1}) is not UTF-8")),
        None => invalid(format!(
            "the signing certificate has no OIDC issuer extension {ISSUER_V1} (sigstore-python reads the issuer there)"
        )),
    }
}

/// One line saying which check failed, from sigstore-rust's error.
fn explain(e: &SigstoreError, bundle: &Bundle, root: &TrustedRoot, certificate: &[u8]) -> String {
    use CertificateError as C;
    use TransparencyLogError as T;
    if let (SigstoreError::TransparencyLog(_), Some(log)) = (e, unknown_log(bundle, root)) {
        return one_line(format!("the entry is in a transparency log the trusted root does not list (log ID {log})"));
    }
    let why = match e {
        SigstoreError::IdentityMismatch { expected, actual } => format!(
            "the signing certificate's identity is {}, not {expected}",
            actual.as_ref().map_or_else(|| "missing".to_owned(), |a| a.to_string())
        ),
        SigstoreError::IssuerMismatch { expected, actual } => format!(
            "the signing certificate's OIDC issuer is {}, not {expected}",
            actual.as_deref().unwrap_or("missing")
        ),
        SigstoreError::SignatureInvalid(_) => {
            "the envelope's signature is not one made by the signing certificate's key of this payload \
             (the payload was changed after signing, or signed with another key)"
                .to_owned()
        }
        SigstoreError::Certificate(c) => match (outside_validity(bundle, certificate), c) {
            (Some(when), _) => when,
            (None, C::Sct(why)) => {
                format!("the signing certificate's signed certificate timestamp does not verify: {why}")
            }
            (None, C::ChainInvalid(why)) if stamped_outside_validity(bundle, why) => {
                let (from, to) = validity_seconds(certificate).unwrap_or_default();
                format!(
                    "the signing certificate was not valid at the time an RFC 3161 timestamp of the bundle gives: \
                     valid from {} to {} ({why})",
                    super::format_time(from),
                    super::format_time(to)
                )
            }
            (None, C::ChainInvalid(why)) if why.contains("RequiredEkuNotFound") => {
                "the signing certificate is not for code signing (it lacks the codeSigning extended key usage)"
                    .to_owned()
            }
            (None, C::ChainInvalid(why)) => {
                format!("the signing certificate does not chain to a certificate authority of the trusted root: {why}")
            }
            (None, C::NoValidAuthority { time }) => {
                format!("no certificate authority of the trusted root was in force when the entry was logged ({time})")
            }
            (None, other) => format!("the signing certificate: {other}"),
        },
        SigstoreError::TransparencyLog(t) => match t {
            T::InclusionProof(why) => format!("the transparency log's inclusion proof does not verify: {why}"),
            T::Checkpoint(why) => format!("the transparency log's checkpoint does not verify: {why}"),
            T::InclusionPromise(why) => {
                format!("the transparency log's signed entry timestamp does not verify: {why}")
            }
            T::UnknownLog { log_id } => {
                format!("the entry is in a transparency log the trusted root does not list ({log_id})")
            }
            T::EntryMismatch(why) => format!("the transparency log entry records another signature: {why}"),
            T::IntegratedTime(why) => match outside_validity(bundle, certificate) {
                Some(when) => when,
                None => format!("the log entry's time: {why}"),
            },
            other => format!("the transparency log entry: {other}"),
        },
        SigstoreError::Timestamp(t) => format!("the signing time: {t}"),
        SigstoreError::Bundle(b) => format!("the bundle is malformed: {b}"),
        other => other.to_string(),
    };
    one_line(why)
}

/// The log ID of the bundle's entry (base64), where the trusted root lists no log of that ID.
fn unknown_log(bundle: &Bundle, root: &TrustedRoot) -> Option<String> {
    let entry = bundle.verification_material.tlog_entries.first()?;
    let id = entry.log_id.key_id.as_bytes();
    (!root.tlogs.iter().any(|log| log.log_id.key_id.as_bytes() == id)).then(|| entry.log_id.key_id.to_string())
}

/// Where the log recorded the entry outside the signing certificate's validity, that, in words.
fn outside_validity(bundle: &Bundle, certificate: &[u8]) -> Option<String> {
    let logged = bundle.verification_material.tlog_entries.first()?.integrated_time?.as_second();
    let (from, to) = validity_seconds(certificate)?;
    (logged < from || logged > to).then(|| {
        format!(
            "the signing certificate was not valid when the log recorded the entry: valid from {} to {}, logged at {}",
            super::format_time(from),
            super::format_time(to),
            super::format_time(logged)
        )
    })
}

/// Whether a chain that failed on the signing certificate's validity failed at an RFC 3161
/// timestamp's time: the chain is checked at each time the signing was established at, and
/// the log's time was within it (else [`outside_validity`] said so first).
fn stamped_outside_validity(bundle: &Bundle, why: &str) -> bool {
    !bundle.verification_material.timestamp_verification_data.rfc3161_timestamps.is_empty()
        && (why.contains("CertExpired") || why.contains("CertNotValidYet"))
}

/// The signing certificate's notBefore and notAfter, in seconds since 1970.
fn validity_seconds(certificate: &[u8]) -> Option<(i64, i64)> {
    let cert = super::chain::parse(certificate).ok()?;
    let validity = cert.validity();
    Some((validity.not_before.timestamp(), validity.not_after.timestamp()))
}

/// `text` on one line: control characters (from a certificate, a bundle) escaped.
fn one_line(text: String) -> String {
    if !text.chars().any(char::is_control) {
        return text;
    }
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// sigstore-rust's cryptography through ring (the verifier this crate already uses), installed
/// once for the process.
fn install_ring() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        // Only this module installs a provider; a second call finds it there.
        let _ = crypto::install_default_provider(&Ring);
    });
}

/// A [`CryptoProvider`] over ring (signatures) and sha2 (digests): verification only.
#[derive(Debug)]
struct Ring;

enum Digest {
    Sha256(sha2::Sha256),
    Sha384(sha2::Sha384),
    Sha512(sha2::Sha512),
}

impl HashContext for Digest {
    fn update(&mut self, data: &[u8]) {
        use sha2::Digest as _;
        match self {
            Digest::Sha256(h) => h.update(data),
            Digest::Sha384(h) => h.update(data),
            Digest::Sha512(h) => h.update(data),
        }
    }

    fn finalize(self: Box<Self>) -> Vec<u8> {
        use sha2::Digest as _;
        match *self {
            Digest::Sha256(h) => h.finalize().to_vec(),
            Digest::Sha384(h) => h.finalize().to_vec(),
            Digest::Sha512(h) => h.finalize().to_vec(),
        }
    }
}

impl CryptoProvider for Ring {
    fn hash(&self, algorithm: HashAlgorithm) -> crypto::Result<Box<dyn HashContext>> {
        use sha2::Digest as _;
        Ok(Box::new(match algorithm {
            HashAlgorithm::Sha2256 => Digest::Sha256(sha2::Sha256::new()),
            HashAlgorithm::Sha2384 => Digest::Sha384(sha2::Sha384::new()),
            HashAlgorithm::Sha2512 => Digest::Sha512(sha2::Sha512::new()),
            other => return Err(crypto::Error::UnsupportedAlgorithm(format!("cannot compute {other} digests"))),
        }))
    }

    fn verify_raw(&self, scheme: SigningScheme, key: &[u8], data: &[u8], signature: &[u8]) -> crypto::Result<()> {
        use ring::signature as sig;
        let algorithm: &'static dyn sig::VerificationAlgorithm = match scheme {
            SigningScheme::EcdsaP256Sha256 => &sig::ECDSA_P256_SHA256_ASN1,
            SigningScheme::EcdsaP256Sha384 => &sig::ECDSA_P256_SHA384_ASN1,
            SigningScheme::EcdsaP384Sha256 => &sig::ECDSA_P384_SHA256_ASN1,
            SigningScheme::EcdsaP384Sha384 => &sig::ECDSA_P384_SHA384_ASN1,
            SigningScheme::Ed25519 => &sig::ED25519,
            SigningScheme::RsaPssSha256 => &sig::RSA_PSS_2048_8192_SHA256,
            SigningScheme::RsaPssSha384 => &sig::RSA_PSS_2048_8192_SHA384,
            SigningScheme::RsaPssSha512 => &sig::RSA_PSS_2048_8192_SHA512,
            SigningScheme::RsaPkcs1Sha256 => &sig::RSA_PKCS1_2048_8192_SHA256,
            SigningScheme::RsaPkcs1Sha384 => &sig::RSA_PKCS1_2048_8192_SHA384,
            SigningScheme::RsaPkcs1Sha512 => &sig::RSA_PKCS1_2048_8192_SHA512,
            other => {
                return Err(crypto::Error::UnsupportedAlgorithm(format!(
                    "{} signatures are not verified here (ring has no {0})",
                    other.name()
                )))
            }
        };
        sig::UnparsedPublicKey::new(algorithm, key)
            .verify(data, signature)
            .map_err(|_| crypto::Error::Verification(format!("{} signature invalid", scheme.name())))
    }

    fn verify_prehashed(&self, scheme: SigningScheme, _: &[u8], _: &[u8], _: &[u8]) -> crypto::Result<()> {
        // Only signatures over a message digest given instead of the message need it; a DSSE
        // envelope's signature is checked over its bytes.
        Err(crypto::Error::UnsupportedAlgorithm(format!(
            "{} signatures over a digest alone are not verified here",
            scheme.name()
        )))
    }
}

#[cfg(test)]
mod tests {
    //! The bundles are in tests/data/sigstore (README.md there says how make.py made them, with a
    //! test CA, CT log and transparency log standing in for Sigstore's). cases.json holds what
    //! sigstore-python's offline Verifier said of each case when they were made
    //! (tests/python/test_verify_keyless.py asks it again on every run): every verdict here is
    //! its verdict, but for the two documented differences, where this verifier refuses more.

    use super::super::{read_signature, Trust};
    use crate::error::Error;
    use crate::verify::Manifest;
    use std::path::{Path, PathBuf};

    const IDENTITY: &str = "signer@example.com";
    const ISSUER: &str = "https://issuer.example.com";

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sigstore").join(name)
    }

    fn keyless(identity: &str, issuer: &str) -> Trust {
        Trust::Sigstore { trusted_root: data("trusted_root.json"), identity: identity.into(), issuer: issuer.into() }
    }

    fn read(bundle: &str, trust: &Trust) -> crate::error::Result<Manifest> {
        let bytes = std::fs::read(data(bundle)).expect("fixture");
        read_signature(&bytes, bundle, trust)
    }

    /// What model_signing signed of ../oms/model, as its key signature lists it.
    fn signed_files() -> Manifest {
        let oms = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/oms");
        let bytes = std::fs::read(oms.join("key.sig")).expect("fixture");
        read_signature(&bytes, "key.sig", &Trust::PublicKey(oms.join("key.pub"))).expect("key.sig verifies")
    }

    fn refusal(result: crate::error::Result<Manifest>) -> String {
        match result {
            Ok(m) => format!("verified, listing {:?}", m.files.keys().collect::<Vec<_>>()),
            Err(Error::SignatureInvalid { why, .. }) => format!("invalid: {why}"),
            Err(Error::ManifestUnsupported { why, .. }) => format!("unsupported: {why}"),
            Err(e) => format!("other: {e}"),
        }
    }

    /// Where this verifier refuses what sigstore-python accepts (keyless.rs's module doc).
    const STRICTER: [&str; 4] =
        ["issuer-v2-differs.sig", "second-san.sig", "timestamp-other-bytes.sig", "timestamp-unknown-tsa.sig"];

    /// Every case of cases.json: sigstore-python's verdict, and what is said here.
    #[test]
    fn every_case_as_sigstore_python_judges_it() {
        let expected: &[(&str, &str, &str, &str)] = &[
            ("good.sig", IDENTITY, ISSUER, "ok"),
            (
                "good.sig",
                "someone@example.com",
                ISSUER,
                "invalid: the signing certificate's identity is signer@example.com, not someone@example.com",
            ),
            (
                "good.sig",
                IDENTITY,
                "https://other-issuer.example.com",
                "invalid: the signing certificate's OIDC issuer is https://issuer.example.com, not https://other-issuer.example.com",
            ),
            ("workflow.sig", "https://github.com/example/model/.github/workflows/sign.yml@refs/heads/main",
             "https://token.actions.githubusercontent.com", "ok"),
            (
                "workflow.sig",
                "https://github.com/example/model/.github/workflows/sign.yml@refs/heads/main",
                ISSUER,
                "invalid: the signing certificate's OIDC issuer is https://token.actions.githubusercontent.com, not",
            ),
            ("edited-payload.sig", IDENTITY, ISSUER, "invalid: the envelope's signature is not one made by the signing certificate's key of this payload"),
            ("other-key.sig", IDENTITY, ISSUER, "invalid: the envelope's signature is not one made by the signing certificate's key"),
            ("bad-proof.sig", IDENTITY, ISSUER, "invalid: the transparency log's inclusion proof does not verify"),
            ("bad-checkpoint.sig", IDENTITY, ISSUER, "invalid: the transparency log's checkpoint does not verify"),
            ("checkpoint-other-root.sig", IDENTITY, ISSUER, "invalid: the bundle is malformed: "),
            ("bad-set.sig", IDENTITY, ISSUER, "invalid: the transparency log's signed entry timestamp does not verify"),
            (
                "expired.sig",
                IDENTITY,
                ISSUER,
                "invalid: the signing certificate was not valid when the log recorded the entry: valid from 2025-06-01T12:00:00Z to 2025-06-01T12:10:00Z, logged at 2025-06-01T12:11:00Z",
            ),
            (
                "not-yet-valid.sig",
                IDENTITY,
                ISSUER,
                "invalid: the signing certificate was not valid when the log recorded the entry: valid from 2025-06-01T12:00:00Z to 2025-06-01T12:10:00Z, logged at 2025-06-01T11:59:00Z",
            ),
            ("unknown-log.sig", IDENTITY, ISSUER, "invalid: the entry is in a transparency log the trusted root does not list (log ID "),
            ("entry-mismatch.sig", IDENTITY, ISSUER, "invalid: the transparency log entry records another signature"),
            ("no-sct.sig", IDENTITY, ISSUER, "invalid: the signing certificate's signed certificate timestamp does not verify"),
            ("bad-sct.sig", IDENTITY, ISSUER, "invalid: the signing certificate's signed certificate timestamp does not verify"),
            ("other-ca.sig", IDENTITY, ISSUER, "invalid: the signing certificate does not chain to a certificate authority of the trusted root"),
            (
                "expired-intermediate.sig",
                IDENTITY,
                ISSUER,
                "invalid: the certificate authority that issued the signing certificate (O=example, CN=test-fulcio-intermediate-2024) was not valid when the entry was logged: valid from 2024-01-01T00:00:00Z to 2025-01-01T00:00:00Z, logged at 2025-06-01T12:01:00Z",
            ),
            ("no-codesigning.sig", IDENTITY, ISSUER, "invalid: the signing certificate is not for code signing"),
            ("issuer-v2-only.sig", IDENTITY, ISSUER, "invalid: the signing certificate has no OIDC issuer extension 1.3.6.1.4.1.57264.1.1"),
            ("issuer-v2-differs.sig", IDENTITY, ISSUER, "invalid: the signing certificate's OIDC issuer is https://other-issuer.example.com, not https://issuer.example.com"),
            ("second-san.sig", IDENTITY, ISSUER, "invalid: the signing certificate's identity is someone@example.com, not signer@example.com"),
            ("timestamped.sig", IDENTITY, ISSUER, "ok"),
            (
                "timestamp-other-bytes.sig",
                IDENTITY,
                ISSUER,
                "invalid: the signing time: invalid RFC 3161 timestamp: TSA timestamp verification failed: Timestamp message hash mismatch",
            ),
            (
                "timestamp-after-expiry.sig",
                IDENTITY,
                ISSUER,
                "invalid: the signing certificate was not valid at the time an RFC 3161 timestamp of the bundle gives: valid from 2025-06-01T12:00:00Z to 2025-06-01T12:10:00Z (",
            ),
            (
                "timestamp-unknown-tsa.sig",
                IDENTITY,
                ISSUER,
                "invalid: the signing time: invalid RFC 3161 timestamp: TSA timestamp verification failed: Failed to verify timestamp signature: CMS signer does not match any trusted TSA certificate",
            ),
        ];
        let cases: serde_json::Value =
            serde_json::from_slice(&std::fs::read(data("cases.json")).expect("cases.json")).expect("JSON");
        let cases = cases.as_array().expect("a list");
        assert_eq!(cases.len(), expected.len(), "cases.json and this table list the same cases");
        let files = signed_files().files;
        for (case, &(bundle, identity, issuer, want)) in cases.iter().zip(expected) {
            assert_eq!(
                (case["bundle"].as_str(), case["identity"].as_str(), case["issuer"].as_str()),
                (Some(bundle), Some(identity), Some(issuer)),
                "cases.json's order"
            );
            let python = case["sigstore_python"].as_str().expect("a verdict");
            let ours = read(bundle, &keyless(identity, issuer));
            let label = format!("{bundle} ({identity}, {issuer})");
            if want == "ok" {
                let m = ours.unwrap_or_else(|e| panic!("{label}: {e}"));
                assert_eq!(m.files, files, "{label}");
                assert_eq!(m.origin, format!("{bundle} (sigstore identity {identity})"));
            } else {
                let got = refusal(ours);
                assert!(got.starts_with(want), "{label}: got '{got}', want '{want}...'");
                assert!(!got.contains('\n'), "{label}: one line: {got}");
            }
            let stricter = STRICTER.contains(&bundle);
            assert_eq!(python == "ok", want == "ok" || stricter, "{label}: sigstore-python says {python}");
        }
    }

    fn edited(bundle: &str, edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(data(bundle)).expect("fixture")).unwrap();
        edit(&mut json);
        serde_json::to_vec(&json).unwrap()
    }

    fn refused(bytes: &[u8], trust: &Trust) -> String {
        refusal(read_signature(bytes, "x.sig", trust))
    }

    #[test]
    fn bundles_that_are_not_keyless_ones_say_what_they_are() {
        let oms = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/oms");
        let trust = keyless(IDENTITY, ISSUER);
        let cases = [
            ("key.sig", "invalid: the bundle is signed with a key, not keylessly: verify it with the public key"),
            ("cert.sig", "invalid: the bundle carries a certificate chain, not a Sigstore signing certificate"),
            ("bad-json.sig", "invalid: not a sigstore bundle: "),
        ];
        for (file, want) in cases {
            let got = refused(&std::fs::read(oms.join(file)).unwrap(), &trust);
            assert!(got.starts_with(want), "{file}: got '{got}', want '{want}...'");
        }
        let two_entries = edited("good.sig", |b| {
            let entry = b["verificationMaterial"]["tlogEntries"][0].clone();
            b["verificationMaterial"]["tlogEntries"].as_array_mut().unwrap().push(entry);
        });
        let got = refused(&two_entries, &trust);
        assert!(got.starts_with("invalid: the bundle has 2 transparency log entries"), "{got}");
        let no_proof = edited("good.sig", |b| {
            b["verificationMaterial"]["tlogEntries"][0].as_object_mut().unwrap().remove("inclusionProof");
        });
        let got = refused(&no_proof, &trust);
        assert!(got.starts_with("invalid: the bundle is malformed: ") && got.contains("inclusion proof"), "{got}");
        let not_json = edited("good.sig", |b| b["dsseEnvelope"]["payload"] = serde_json::json!("bm90IEpTT04="));
        let got = refused(&not_json, &trust);
        assert!(got.starts_with("invalid: the envelope's payload is not an in-toto statement"), "{got}");
        // A keyless bundle given to the key and certificate verifiers.
        let good = std::fs::read(data("good.sig")).unwrap();
        for trust in [Trust::PublicKey(oms.join("key.pub")), Trust::CertificateChain(vec![oms.join("root.pem")])] {
            let got = refused(&good, &trust);
            assert!(got.starts_with("invalid: the bundle is a keyless (Sigstore) one"), "{got}");
        }
    }

    #[test]
    fn the_trusted_root_is_read_whole_or_refused_in_one_line() {
        let good = std::fs::read(data("good.sig")).unwrap();
        let dir = std::env::temp_dir().join(format!("fst-keyless-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root: serde_json::Value =
            serde_json::from_slice(&std::fs::read(data("trusted_root.json")).unwrap()).unwrap();
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let with_root =
            |path: PathBuf| Trust::Sigstore { trusted_root: path, identity: IDENTITY.into(), issuer: ISSUER.into() };
        // model_signing's --trust_config: a client trust configuration holding the root.
        let config = serde_json::json!({
            "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
            "trustedRoot": root,
            "signingConfig": {},
        });
        let m = read_signature(&good, "good.sig", &with_root(write("config.json", config.to_string())));
        assert_eq!(m.expect("a client trust configuration").files, signed_files().files);

        let missing = refusal(read_signature(&good, "good.sig", &with_root(dir.join("absent.json"))));
        assert!(missing.starts_with("other: ") && missing.contains("absent.json"), "{missing}");
        let cases = [
            ("not JSON", "{".to_owned(), "invalid: the trusted root bad.json is not JSON"),
            ("a list", "[]".to_owned(), "invalid: bad.json is not a Sigstore trusted root"),
            (
                "no logs, no authorities",
                "{\"mediaType\": \"x\"}".to_owned(),
                "invalid: the entry is in a transparency log the trusted root does not list",
            ),
        ];
        for (case, text, want) in cases {
            let got = refusal(read_signature(&good, "good.sig", &with_root(write("bad.json", text))));
            assert!(got.starts_with(want), "{case}: got '{got}', want '{want}...'");
            assert!(!got.contains('\n'), "{case}: {got}");
        }
        // Another root: Sigstore's production one, as the crate ships it, trusts none of the
        // test services.
        let production = write("production.json", sigstore_verify::trust_root::SIGSTORE_PRODUCTION_TRUSTED_ROOT.into());
        let got = refusal(read_signature(&good, "good.sig", &with_root(production)));
        assert!(got.starts_with("invalid: the entry is in a transparency log the trusted root does not list"), "{got}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// One byte of the bundle changed, wherever it is: refused, or (where the byte is one no
    /// check covers: the name on the checkpoint's signature line, a field name the bundle reader
    /// does not know and so skips) the same files listed.
    #[test]
    fn a_flipped_byte_anywhere_never_changes_what_is_accepted() {
        let good = std::fs::read(data("good.sig")).unwrap();
        let files = signed_files().files;
        let trust = keyless(IDENTITY, ISSUER);
        let (mut refused, mut same) = (0, 0);
        for at in (0..good.len()).step_by(13) {
            let mut bytes = good.clone();
            bytes[at] ^= 0x01;
            match read_signature(&bytes, "good.sig", &trust) {
                Ok(m) => {
                    assert_eq!(m.files, files, "byte {at}");
                    same += 1;
                }
                Err(e) => {
                    assert!(!e.to_string().contains('\n'), "byte {at}: {e}");
                    refused += 1;
                }
            }
        }
        assert!(refused > 10 * same, "{refused} refused, {same} accepted");
    }
}
