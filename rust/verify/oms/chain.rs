//! Certificate chains judged as model_signing judges them: its certificate verifier puts the
//! given certificates in a pyOpenSSL `X509Store`, sets the store's time to the signing
//! certificate's notBefore and calls `X509StoreContext(store, leaf, bundled)
//! .verify_certificate()`: OpenSSL's default rules, with no purpose and no flags.
//!
//! The certificates are read by x509-parser, and their signatures checked by its `verify`
//! feature (ring). What is here is OpenSSL's decision, in its order:
//!
//! 1. The chain is built up from the signing certificate. Each certificate's issuer is taken
//!    from the given certificates first, then from the bundle's (OpenSSL's "trusted first"): a
//!    certificate whose subject is the issuer's name (names compared as OpenSSL compares them:
//!    string values without case and runs of white space), that the authority key identifier,
//!    where there is one, names, and whose key verifies the signature. The chain ends at a
//!    self-signed certificate (its issuer is its own name and its authority key identifier, if
//!    any, names its own key: the signature is not checked), which must be one of the given
//!    ones: a chain that ends at a given certificate that is not self-signed does not verify
//!    (no partial chains).
//! 2. Every certificate of the chain, the root's included, is valid at the signing time:
//!    notBefore ≤ t ≤ notAfter.
//! 3. No certificate has a critical extension OpenSSL does not know.
//! 4. Every issuer is a CA: its key usage, where present, allows certificate signing, and its
//!    basicConstraints say CA:TRUE; the root may instead have no basicConstraints and be a v1
//!    certificate, or carry a key usage, or a Netscape CA type. The signing certificate may be
//!    anything, a CA included.
//! 5. An issuer's pathLenConstraint bounds the issuers below it that are not self-issued (whose
//!    subject is not their issuer's name).
//!
//! The root's own signature is not checked (OpenSSL does not check it either).

use x509_parser::certificate::X509Certificate;
use x509_parser::error::X509Error;
use x509_parser::extensions::{AuthorityKeyIdentifier, GeneralName, ParsedExtension};
use x509_parser::x509::X509Name;

use super::{invalid, unsupported, Check, Fail};

/// A certificate read from DER, all of it: trailing bytes are refused, as cryptography does.
pub(super) fn parse(der: &[u8]) -> Result<X509Certificate<'_>, String> {
    match x509_parser::parse_x509_certificate(der) {
        Ok(([], cert)) => Ok(cert),
        Ok((rest, _)) => Err(format!("{} bytes follow the certificate", rest.len())),
        Err(e) => Err(e.to_string()),
    }
}

/// The longest chain built (OpenSSL's default depth limit is 100; real chains have 2 to 4).
const MAX_CHAIN: usize = 16;

/// That `leaf` chains, through `bundled` certificates, to one of `given` (PEM files named
/// `names`) at `at` (seconds since 1970).
pub(super) fn verify(
    leaf: &X509Certificate<'_>,
    bundled: &[X509Certificate<'_>],
    given: &[X509Certificate<'_>],
    names: &str,
    at: i64,
) -> Check<()> {
    if !given.iter().any(self_signed) {
        return invalid(format!(
            "none of the given certificates ({names}) is self-signed: OpenSSL, and so model_signing, needs the chain to end at a given root"
        ));
    }
    let refuse = |fail: Fail| match fail {
        Fail::Invalid(why) => Fail::Invalid(format!(
            "the signing certificate does not chain to {names} at its notBefore ({}): {why}",
            super::format_time(at)
        )),
        other => other,
    };
    let chain = build(leaf, bundled, given).map_err(refuse)?;
    judge(&chain, at).map_err(refuse)
}

/// The chain from `leaf` up to a given self-signed certificate.
fn build<'c, 'a>(
    leaf: &'c X509Certificate<'a>,
    bundled: &'c [X509Certificate<'a>],
    given: &'c [X509Certificate<'a>],
) -> Check<Vec<&'c X509Certificate<'a>>> {
    let mut chain = vec![leaf];
    loop {
        let cert = chain[chain.len() - 1];
        let at = chain.len() - 1;
        if self_signed(cert) {
            if given.iter().any(|g| g.as_raw() == cert.as_raw()) {
                return Ok(chain);
            }
            return invalid(format!("{} is self-signed, and not one of the given certificates", describe(cert, at)));
        }
        if chain.len() == MAX_CHAIN {
            return invalid(format!("no given root within {MAX_CHAIN} certificates"));
        }
        let in_chain = |c: &X509Certificate<'_>| chain.iter().any(|d| d.as_raw() == c.as_raw());
        let candidates: Vec<&X509Certificate<'a>> = given
            .iter()
            .chain(bundled)
            .filter(|c| !in_chain(c) && same_name(c.subject(), cert.issuer()) && key_id_names(cert, c))
            .collect();
        let mut unchecked = None;
        let issuer = candidates.iter().find(|c| match cert.verify_signature(Some(c.public_key())) {
            Ok(()) => true,
            Err(X509Error::SignatureUnsupportedAlgorithm) => {
                unchecked = Some(cert.signature_algorithm.algorithm.to_id_string());
                false
            }
            Err(_) => false,
        });
        match (issuer, unchecked) {
            (Some(issuer), _) => chain.push(issuer),
            (None, Some(algorithm)) => {
                return unsupported(format!(
                    "{} is signed with an algorithm ({algorithm}) or key that is not checked here (ECDSA P-256 and P-384, RSA, Ed25519 are)",
                    describe(cert, at)
                ))
            }
            (None, None) if !candidates.is_empty() => {
                return invalid(format!(
                    "the signature of {} does not verify with the key of {}",
                    describe(cert, at),
                    cert.issuer()
                ))
            }
            (None, None) => {
                return invalid(format!(
                    "no issuer of {} ({}) among the given certificates and the bundle's",
                    describe(cert, at),
                    cert.issuer()
                ))
            }
        }
    }
}

/// The chain (signing certificate first, root last) checked as OpenSSL checks it at `at`.
fn judge(chain: &[&X509Certificate<'_>], at: i64) -> Check<()> {
    // Issuers between the signing certificate and the one judged that are not self-issued.
    let mut below = 0u32;
    for (i, cert) in chain.iter().enumerate() {
        let who = describe(cert, i);
        let validity = cert.validity();
        let (from, until) = (validity.not_before.timestamp(), validity.not_after.timestamp());
        if at < from {
            return invalid(format!("{who} is valid from {} only", super::format_time(from)));
        }
        if at > until {
            return invalid(format!("{who} expired at {}", super::format_time(until)));
        }
        let ext = Extensions::of(cert).map_err(|why| Fail::Invalid(format!("{who}: {why}")))?;
        if let Some(oid) = ext.unknown_critical {
            return invalid(format!("{who} has a critical extension OpenSSL does not know ({oid})"));
        }
        if i == 0 {
            continue;
        }
        let root = i + 1 == chain.len();
        match ext.ca(cert) {
            Ca::No => {
                return invalid(format!(
                    "{who} issues a certificate of the chain but is not a CA ({})",
                    ext.why_not_ca()
                ))
            }
            Ca::Tolerated if !root => {
                return invalid(format!("{who} issues a certificate of the chain but has no basicConstraints CA:TRUE"))
            }
            _ => {}
        }
        if ext.name_constraints {
            return unsupported(format!(
                "{who} has name constraints, which are not checked here (model_signing's OpenSSL checks them)"
            ));
        }
        if i > 1 {
            if let Some(limit) = ext.path_len.filter(|&limit| below > limit) {
                return invalid(format!(
                    "{who} allows {limit} issuers below it (pathLenConstraint), and the chain has {below}"
                ));
            }
        }
        if !same_name(cert.subject(), cert.issuer()) {
            below += 1;
        }
    }
    Ok(())
}

/// How a certificate reads as an issuer (OpenSSL's `X509_check_ca`).
#[derive(Debug, PartialEq, Eq)]
enum Ca {
    No,
    /// basicConstraints CA:TRUE.
    Yes,
    /// No basicConstraints, but a v1 root, a key usage or a Netscape CA type: a root only.
    Tolerated,
}

/// The extensions OpenSSL's verification reads.
#[derive(Default)]
pub(super) struct Extensions<'a> {
    /// (digitalSignature, keyCertSign), where there is a key usage.
    key_usage: Option<(bool, bool)>,
    /// CA:TRUE, where there are basicConstraints.
    ca: Option<bool>,
    path_len: Option<u32>,
    /// Whether the extended key usages include codeSigning, where there are some.
    code_signing: Option<bool>,
    netscape_ca: bool,
    name_constraints: bool,
    subject_key_id: Option<&'a [u8]>,
    authority_key_id: Option<&'a AuthorityKeyIdentifier<'a>>,
    unknown_critical: Option<String>,
}

/// The extensions OpenSSL 3 acts on (`X509_supported_extension`): a critical one of any other
/// kind fails the chain.
const KNOWN: [&str; 15] = [
    "2.16.840.1.113730.1.1", // Netscape certificate type
    "2.5.29.15",             // key usage
    "2.5.29.17",             // subject alternative name
    "2.5.29.19",             // basic constraints
    "2.5.29.32",             // certificate policies
    "2.5.29.31",             // CRL distribution points
    "2.5.29.37",             // extended key usage
    "1.3.6.1.5.5.7.1.7",     // IP address blocks (RFC 3779)
    "1.3.6.1.5.5.7.1.8",     // AS identifiers (RFC 3779)
    "1.3.6.1.5.5.7.48.1.5",  // OCSP no check
    "2.5.29.36",             // policy constraints
    "1.3.6.1.5.5.7.1.14",    // proxy certificate information
    "2.5.29.30",             // name constraints
    "2.5.29.33",             // policy mappings
    "2.5.29.54",             // inhibit any policy
];

impl<'a> Extensions<'a> {
    pub(super) fn of(cert: &'a X509Certificate<'_>) -> Result<Extensions<'a>, String> {
        cert.extensions_map().map_err(|_| "an extension appears twice".to_owned())?;
        let mut ext = Extensions::default();
        for e in cert.extensions() {
            match e.parsed_extension() {
                ParsedExtension::KeyUsage(ku) => ext.key_usage = Some((ku.digital_signature(), ku.key_cert_sign())),
                ParsedExtension::BasicConstraints(bc) => {
                    ext.ca = Some(bc.ca);
                    ext.path_len = bc.path_len_constraint;
                }
                ParsedExtension::ExtendedKeyUsage(eku) => ext.code_signing = Some(eku.code_signing),
                ParsedExtension::NSCertType(t) => ext.netscape_ca = t.ssl_ca() || t.smime_ca() || t.object_signing_ca(),
                ParsedExtension::NameConstraints(_) => ext.name_constraints = true,
                ParsedExtension::SubjectKeyIdentifier(id) => ext.subject_key_id = Some(id.0),
                ParsedExtension::AuthorityKeyIdentifier(id) => ext.authority_key_id = Some(id),
                ParsedExtension::ParseError { error } => {
                    return Err(format!("its extension {} cannot be read: {error}", e.oid.to_id_string()))
                }
                _ => {}
            }
            let oid = e.oid.to_id_string();
            if e.critical && ext.unknown_critical.is_none() && !KNOWN.contains(&oid.as_str()) {
                ext.unknown_critical = Some(oid);
            }
        }
        Ok(ext)
    }

    /// Whether the certificate may be used to sign: the digitalSignature key usage, or the
    /// codeSigning extended key usage (model_signing's own rule for the signing certificate).
    pub(super) fn signs(&self) -> bool {
        self.key_usage.is_some_and(|(digital_signature, _)| digital_signature) || self.code_signing == Some(true)
    }

    fn ca(&self, cert: &X509Certificate<'_>) -> Ca {
        if self.key_usage.is_some_and(|(_, cert_sign)| !cert_sign) {
            return Ca::No;
        }
        match self.ca {
            Some(true) => Ca::Yes,
            Some(false) => Ca::No,
            None if self.key_usage.is_some() || self.netscape_ca => Ca::Tolerated,
            None if cert.version().0 == 0 && self_signed(cert) => Ca::Tolerated,
            None => Ca::No,
        }
    }

    fn why_not_ca(&self) -> &'static str {
        match (self.key_usage, self.ca) {
            (Some((_, false)), _) => "its key usage does not allow certificate signing",
            (_, Some(false)) => "basicConstraints CA:FALSE",
            _ => "no basicConstraints",
        }
    }
}

/// Whether `issuer` issued `cert`: its subject is `cert`'s issuer name, `cert`'s authority key
/// identifier (if any) fits it, and its key verifies `cert`'s signature.
pub(super) fn issued_by(cert: &X509Certificate<'_>, issuer: &X509Certificate<'_>) -> bool {
    same_name(issuer.subject(), cert.issuer())
        && key_id_names(cert, issuer)
        && cert.verify_signature(Some(issuer.public_key())).is_ok()
}

/// Whether the certificate names itself as its issuer and its authority key identifier, if any,
/// names its own key: what OpenSSL takes for self-signed, without checking the signature.
fn self_signed(cert: &X509Certificate<'_>) -> bool {
    same_name(cert.subject(), cert.issuer()) && key_id_names(cert, cert)
}

/// Whether `cert`'s authority key identifier, where it has one, fits `issuer`: its key
/// identifier, serial number and issuer name (OpenSSL's `X509_check_akid`).
fn key_id_names(cert: &X509Certificate<'_>, issuer: &X509Certificate<'_>) -> bool {
    let (Ok(ext), Ok(of_issuer)) = (Extensions::of(cert), Extensions::of(issuer)) else {
        return false;
    };
    let Some(akid) = ext.authority_key_id else { return true };
    if let (Some(id), Some(skid)) = (&akid.key_identifier, of_issuer.subject_key_id) {
        if id.0 != skid {
            return false;
        }
    }
    if akid.authority_cert_serial.is_some_and(|serial| serial != issuer.raw_serial()) {
        return false;
    }
    let named = akid.authority_cert_issuer.iter().flatten().find_map(|n| match n {
        GeneralName::DirectoryName(name) => Some(name),
        _ => None,
    });
    named.is_none_or(|name| same_name(name, issuer.issuer()))
}

/// `the signing certificate`, or the subject of the `i`th certificate up the chain.
fn describe(cert: &X509Certificate<'_>, i: usize) -> String {
    if i == 0 {
        "the signing certificate".to_owned()
    } else {
        format!("certificate '{}'", cert.subject())
    }
}

/// Whether two names are the same as OpenSSL compares them (`X509_NAME_cmp` on canonical
/// encodings): the same attributes in the same relative distinguished names, string values
/// compared without ASCII case and without leading, trailing and repeated white space.
fn same_name(a: &X509Name<'_>, b: &X509Name<'_>) -> bool {
    a.as_raw() == b.as_raw() || matches!((canonical(a), canonical(b)), (Some(a), Some(b)) if a == b)
}

/// Each relative distinguished name's attributes, sorted: (type, value tag, canonical value).
type Canonical = Vec<Vec<(String, u32, Vec<u8>)>>;

fn canonical(name: &X509Name<'_>) -> Option<Canonical> {
    name.iter_rdn()
        .map(|rdn| {
            let mut set = rdn
                .iter()
                .map(|attr| {
                    let value = attr.attr_value();
                    let (tag, bytes) = (value.tag().0, value.as_bytes());
                    Some(match string_value(tag, bytes) {
                        Some(text) => (attr.attr_type().to_id_string(), 0, fold(&text?)),
                        None => (attr.attr_type().to_id_string(), tag, bytes.to_vec()),
                    })
                })
                .collect::<Option<Vec<_>>>()?;
            set.sort();
            Some(set)
        })
        .collect()
}

/// The text of a value of one of the string types OpenSSL canonicalizes (`None` for another
/// type; `Some(None)` for a string that is not what its type says).
fn string_value(tag: u32, bytes: &[u8]) -> Option<Option<String>> {
    Some(match tag {
        12 => String::from_utf8(bytes.to_vec()).ok(), // UTF8String
        19 | 20 | 22 | 26 => Some(bytes.iter().map(|&b| char::from(b)).collect()), // Printable, T61, IA5, Visible
        30 => (bytes.len() % 2 == 0)
            .then(|| char::decode_utf16(bytes.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]]))).collect())
            .and_then(Result::ok), // BMPString
        28 => (bytes.len() % 4 == 0)
            .then(|| bytes.chunks(4).map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]]))).collect())
            .flatten(), // UniversalString
        _ => return None,
    })
}

/// OpenSSL's canonical form of a string: ASCII lower case, no leading or trailing white space,
/// each run of white space one space.
fn fold(text: &str) -> Vec<u8> {
    let space = |c: char| matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r');
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(space).filter(|w| !w.is_empty()).enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.extend(word.chars().map(|c| c.to_ascii_lowercase()));
    }
    out.into_bytes()
}
