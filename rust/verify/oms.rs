//! OpenSSF model-signing (OMS) signatures: a sigstore bundle whose DSSE envelope holds an
//! in-toto statement listing every file's digest.

use std::path::PathBuf;

use super::Manifest;
use crate::error::{Error, Result};

/// What a signature is checked against.
#[derive(Debug, Clone)]
pub enum Trust {
    /// A PEM public key (`model_signing sign key`).
    PublicKey(PathBuf),
    /// PEM certificates: the signing certificate's issuers up to a root (`sign certificate`).
    CertificateChain(Vec<PathBuf>),
    /// A sigstore (keyless) bundle checked offline against a trusted root and the expected
    /// signer identity and OIDC issuer.
    Sigstore { trusted_root: PathBuf, identity: String, issuer: String },
}

/// The manifest a signature (the bundle's bytes; `name` is what errors call it) lists, once
/// its envelope verifies against `trust`.
pub fn read_signature(bundle: &[u8], name: &str, trust: &Trust) -> Result<Manifest> {
    let _ = (bundle, trust);
    Err(Error::ManifestUnsupported { signature: name.to_owned(), why: "not yet".into() })
}
