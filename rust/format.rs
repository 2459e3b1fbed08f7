//! The safetensors format: the dtype table, the header, and its validation.
//!
//! A file is `[u64 LE header length N][N bytes of JSON header][data]`. The header maps
//! tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to
//! the start of the data) plus an optional `"__metadata__"` map of strings.
//!
//! [`parse`] checks every rule safetensors enforces, in one place, and returns a [`Header`]
//! whose tensors are sorted by offset. Nothing else in the crate re-validates a header.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// Largest header accepted, as in safetensors: bigger ones are treated as hostile.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Bytes of the little-endian header length that opens every file.
pub const LEN_PREFIX: u64 = 8;

/// Bytes at the start of a file that [`header_len`] looks at to say what a file that is not
/// a safetensors file is instead (enough for the longest signature, a Git LFS pointer's).
pub const SNIFF_LEN: usize = 64;

/// The reserved header key for free-form string metadata.
const METADATA_KEY: &str = "__metadata__";

/// A violation of the safetensors format. The caller adds the file path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The file cannot even hold the 8-byte header length.
    #[error("file is {0} bytes, too small for the 8-byte header length")]
    FileTooSmall(u64),
    /// The file starts like another format (a PyTorch checkpoint, JSON, text, ...).
    #[error("not a safetensors file: {0}")]
    NotSafetensors(Foreign),
    /// The header length exceeds [`MAX_HEADER_LEN`].
    #[error("header length {0} exceeds the limit of {MAX_HEADER_LEN} bytes (not a safetensors file, or its first 8 bytes are damaged)")]
    HeaderTooLarge(u64),
    /// The header length points past the end of the file.
    #[error("header length {len} runs past the end of the file ({file_len} bytes)")]
    HeaderPastEnd { len: u64, file_len: u64 },
    /// The header is not valid UTF-8.
    #[error("header is not valid UTF-8 (byte {0})")]
    HeaderNotUtf8(usize),
    /// The header is not a JSON object of the expected form.
    #[error("header is not valid safetensors JSON: {0}")]
    InvalidJson(String),
    /// A tensor names a dtype safetensors does not define.
    #[error("tensor '{name}': unknown dtype '{dtype}'")]
    UnknownDtype { name: String, dtype: String },
    /// `numel × bits` does not fit in 64 bits.
    #[error("tensor '{name}': shape {shape:?} overflows the byte count")]
    ShapeOverflow { name: String, shape: Vec<u64> },
    /// A packed sub-byte dtype whose element count does not fill whole bytes.
    #[error("tensor '{name}': {numel} elements of {dtype} do not fill a whole number of bytes")]
    PartialByte { name: String, dtype: Dtype, numel: u64 },
    /// `data_offsets` has end before begin.
    #[error("tensor '{name}': data_offsets [{begin}, {end}] end before they begin")]
    ReversedOffsets { name: String, begin: u64, end: u64 },
    /// The byte range is not the size the dtype and shape require.
    #[error("tensor '{name}': data_offsets span {actual} bytes but {dtype} {shape:?} needs {expected}")]
    LengthMismatch { name: String, dtype: Dtype, shape: Vec<u64>, expected: u64, actual: u64 },
    /// The byte range ends past the end of the file.
    #[error("tensor '{name}': data ends at {end}, past the end of the data ({data_len} bytes)")]
    OutOfBounds { name: String, end: u64, data_len: u64 },
    /// Two tensors share bytes.
    #[error("tensor '{name}' (starting at {begin}) overlaps tensor '{previous}' (ending at {previous_end})")]
    Overlap { name: String, begin: u64, previous: String, previous_end: u64 },
    /// Bytes between two tensors belong to no tensor.
    #[error("tensor '{name}' starts at {begin}, leaving a gap after byte {expected}")]
    Gap { name: String, begin: u64, expected: u64 },
    /// Bytes after the last tensor belong to no tensor.
    #[error("{trailing} trailing bytes after the last tensor (data is {data_len} bytes)")]
    TrailingBytes { trailing: u64, data_len: u64 },
}

/// Element types of safetensors, with their on-disk names.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    BOOL,
    /// FP4 E2M1, two values packed per byte.
    F4,
    /// FP6 E2M3, packed.
    F6_E2M3,
    /// FP6 E3M2, packed.
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bits per element.
    pub fn bits(self) -> u64 {
        use Dtype::*;
        match self {
            F4 => 4,
            F6_E2M3 | F6_E3M2 => 6,
            BOOL | U8 | I8 | F8_E5M2 | F8_E4M3 | F8_E8M0 | F8_E4M3FNUZ | F8_E5M2FNUZ => 8,
            I16 | U16 | F16 | BF16 => 16,
            I32 | U32 | F32 => 32,
            C64 | F64 | I64 | U64 => 64,
        }
    }

    /// Byte alignment a tensor's data needs: its element size (1 for packed sub-byte types),
    /// which is what torch asks of a byte buffer reinterpreted as this dtype.
    pub fn alignment(self) -> u64 {
        (self.bits() / 8).max(1)
    }

    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            BOOL => "BOOL",
            F4 => "F4",
            F6_E2M3 => "F6_E2M3",
            F6_E3M2 => "F6_E3M2",
            U8 => "U8",
            I8 => "I8",
            F8_E5M2 => "F8_E5M2",
            F8_E4M3 => "F8_E4M3",
            F8_E8M0 => "F8_E8M0",
            F8_E4M3FNUZ => "F8_E4M3FNUZ",
            F8_E5M2FNUZ => "F8_E5M2FNUZ",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            C64 => "C64",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
        }
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a header. Offsets are relative to the start of the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub begin: u64,
    pub end: u64,
}

impl TensorInfo {
    pub fn nbytes(&self) -> u64 {
        self.end - self.begin
    }
}

/// A validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// `None` when the header has no `__metadata__` or it is `null`.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Sorted by offset; contiguous from 0 to `data_len`.
    pub tensors: Vec<TensorInfo>,
    /// File offset of the data section: 8 + header length.
    pub data_start: u64,
    /// Bytes in the data section.
    pub data_len: u64,
    /// The header's JSON as it was read: what a verified load hashes for the file's first
    /// bytes, so that the header checked is the header parsed.
    pub json: Vec<u8>,
}

impl Header {
    pub fn file_len(&self) -> u64 {
        self.data_start + self.data_len
    }
}

/// What a file that is not a safetensors file is, judged from its first bytes.
///
/// Only files whose header length is already impossible are judged ([`header_len`]), so a
/// valid safetensors file can never be mistaken for one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Foreign {
    /// A zip archive: what `torch.save` writes (`.bin`, `.pt`, `.pth` since PyTorch 1.6).
    TorchZip,
    /// A pickle: what `torch.save` wrote before it used zip archives.
    TorchPickle,
    /// A Git LFS pointer: a repository cloned without fetching its large files.
    LfsPointer,
    /// JSON text, e.g. a checkpoint index (`model.safetensors.index.json`) or a config.
    Json,
    /// Other text.
    Text,
    /// A GGUF file (llama.cpp).
    Gguf,
    /// An HDF5 file (e.g. a Keras `.h5` checkpoint).
    Hdf5,
    /// A NumPy `.npy` array.
    Numpy,
    /// gzip-compressed data.
    Gzip,
}

impl Foreign {
    /// The format `prefix` (the first bytes of a file, of which [`SNIFF_LEN`] are looked at)
    /// starts like, if any.
    pub fn sniff(prefix: &[u8]) -> Option<Foreign> {
        let p = &prefix[..prefix.len().min(SNIFF_LEN)];
        // A pickle opens with PROTO (0x80) and its protocol, gzip with 1f 8b 08: read as a
        // header length, those bytes can also open a damaged safetensors file, so they count
        // only when the length they make is impossible.
        let impossible_len =
            p.len() >= LEN_PREFIX as usize && u64::from_le_bytes(p[..8].try_into().expect("8 bytes")) > MAX_HEADER_LEN;
        let magic: [(&[u8], Foreign); 5] = [
            (b"PK\x03\x04", Foreign::TorchZip),
            (b"PK\x05\x06", Foreign::TorchZip), // an empty archive
            (b"GGUF", Foreign::Gguf),
            (b"\x89HDF\r\n\x1a\n", Foreign::Hdf5),
            (b"\x93NUMPY", Foreign::Numpy),
        ];
        if let Some(&(_, found)) = magic.iter().find(|(m, _)| p.starts_with(m)) {
            return Some(found);
        }
        if impossible_len && p[0] == 0x80 && (2..=5).contains(&p[1]) {
            return Some(Foreign::TorchPickle);
        }
        if impossible_len && p.starts_with(b"\x1f\x8b\x08") {
            return Some(Foreign::Gzip);
        }
        let text = as_text(p)?;
        Some(if text.starts_with("version https://git-lfs.github.com/spec/") {
            Foreign::LfsPointer
        } else if text.trim_start_matches(|c: char| c.is_whitespace() || c == '\u{feff}').starts_with(['{', '[']) {
            Foreign::Json
        } else {
            Foreign::Text
        })
    }
}

/// `bytes` as text: UTF-8 (a character cut off at the end allowed) without control
/// characters other than whitespace. A safetensors file never starts like this: its header
/// length has zero bytes.
fn as_text(bytes: &[u8]) -> Option<&str> {
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&bytes[..e.valid_up_to()]).ok()?,
        Err(_) => return None,
    };
    let printable = text.chars().all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r' | '\x0c'));
    (printable && !text.is_empty()).then_some(text)
}

impl fmt::Display for Foreign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const CONVERT: &str = "load it with torch.load, or convert it to .safetensors (safetensors.torch.save_file)";
        match self {
            Foreign::TorchZip => write!(f, "it looks like a PyTorch zip checkpoint (torch.save); {CONVERT}"),
            Foreign::TorchPickle => {
                write!(f, "it looks like a PyTorch pickle checkpoint (torch.save, legacy format); {CONVERT}")
            }
            Foreign::LfsPointer => {
                f.write_str("it is a Git LFS pointer, not the data: fetch the file itself (git lfs pull)")
            }
            Foreign::Json => f.write_str(
                "it is JSON text. A checkpoint index (*.safetensors.index.json) loads with load()/load_file() \
                 (pass the index or its directory); safe_open opens one of the shards it lists",
            ),
            Foreign::Text => f.write_str("it is text"),
            Foreign::Gguf => f.write_str("it is a GGUF file (llama.cpp)"),
            Foreign::Hdf5 => f.write_str("it is an HDF5 file (e.g. a Keras .h5 checkpoint)"),
            Foreign::Numpy => f.write_str("it is a NumPy .npy file"),
            Foreign::Gzip => f.write_str("it is gzip-compressed; decompress it first"),
        }
    }
}

/// Reads the header length from the first bytes of a file of `file_len` bytes and checks it
/// against the limit and the file size. Returns the header length N (the JSON is bytes 8..8+N).
///
/// `prefix` holds at least the first 8 bytes (all of them for a shorter file); given up to
/// [`SNIFF_LEN`] bytes, an impossible length is reported as [`FormatError::NotSafetensors`]
/// where the file starts like another format.
pub fn header_len(prefix: &[u8], file_len: u64) -> Result<u64, FormatError> {
    let or_foreign = |e: FormatError| Foreign::sniff(prefix).map_or(e, FormatError::NotSafetensors);
    if file_len < LEN_PREFIX || prefix.len() < LEN_PREFIX as usize {
        return Err(or_foreign(FormatError::FileTooSmall(file_len)));
    }
    let len = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    if len > MAX_HEADER_LEN {
        return Err(or_foreign(FormatError::HeaderTooLarge(len)));
    }
    if len > file_len - LEN_PREFIX {
        return Err(or_foreign(FormatError::HeaderPastEnd { len, file_len }));
    }
    Ok(len)
}

/// Parses and validates the JSON header of a file of `file_len` bytes.
pub fn parse_header(json: &[u8], file_len: u64) -> Result<Header, FormatError> {
    let text = std::str::from_utf8(json).map_err(|e| FormatError::HeaderNotUtf8(e.valid_up_to()))?;
    let raw: RawHeader = serde_json::from_str(text).map_err(|e| FormatError::InvalidJson(e.to_string()))?;
    let data_start = LEN_PREFIX + json.len() as u64;
    let data_len =
        file_len.checked_sub(data_start).ok_or(FormatError::HeaderPastEnd { len: json.len() as u64, file_len })?;
    let tensors = raw
        .tensors
        .into_iter()
        .map(|(name, t)| match Dtype::from_name(&t.dtype) {
            Some(dtype) => {
                Ok(TensorInfo { name, dtype, shape: t.shape, begin: t.data_offsets.0, end: t.data_offsets.1 })
            }
            None => Err(FormatError::UnknownDtype { name, dtype: t.dtype }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tensors = validate(tensors, data_len)?;
    Ok(Header { metadata: raw.metadata, tensors, data_start, data_len, json: json.to_vec() })
}

/// Parses a whole file held in memory.
pub fn parse(file: &[u8]) -> Result<Header, FormatError> {
    let file_len = file.len() as u64;
    let len = header_len(file, file_len)?;
    parse_header(&file[LEN_PREFIX as usize..(LEN_PREFIX + len) as usize], file_len)
}

/// Number of bytes `shape` of `dtype` occupies, overflow-checked.
pub fn byte_len(name: &str, dtype: Dtype, shape: &[u64]) -> Result<u64, FormatError> {
    let overflow = || FormatError::ShapeOverflow { name: name.to_owned(), shape: shape.to_vec() };
    let numel = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
    let bits = numel.checked_mul(dtype.bits()).ok_or_else(overflow)?;
    if bits % 8 != 0 {
        return Err(FormatError::PartialByte { name: name.to_owned(), dtype, numel });
    }
    Ok(bits / 8)
}

/// The single validation pass: every tensor in offset order, first violation wins.
fn validate(mut tensors: Vec<TensorInfo>, data_len: u64) -> Result<Vec<TensorInfo>, FormatError> {
    for t in &tensors {
        if t.end < t.begin {
            return Err(FormatError::ReversedOffsets { name: t.name.clone(), begin: t.begin, end: t.end });
        }
    }
    tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut expected = 0u64;
    let mut previous: Option<&TensorInfo> = None;
    for t in &tensors {
        if t.end > data_len {
            return Err(FormatError::OutOfBounds { name: t.name.clone(), end: t.end, data_len });
        }
        if t.begin < expected {
            let p = previous.expect("expected > 0 implies a previous tensor");
            return Err(FormatError::Overlap {
                name: t.name.clone(),
                begin: t.begin,
                previous: p.name.clone(),
                previous_end: p.end,
            });
        }
        if t.begin > expected {
            return Err(FormatError::Gap { name: t.name.clone(), begin: t.begin, expected });
        }
        let needed = byte_len(&t.name, t.dtype, &t.shape)?;
        if needed != t.nbytes() {
            return Err(FormatError::LengthMismatch {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                expected: needed,
                actual: t.nbytes(),
            });
        }
        expected = t.end;
        previous = Some(t);
    }
    if expected != data_len {
        return Err(FormatError::TrailingBytes { trailing: data_len - expected, data_len });
    }
    Ok(tensors)
}

/// The header as written, before offsets are checked. Deserialised by hand so that duplicate
/// keys are an error (serde's maps keep the last one silently) and each tensor's errors name it.
struct RawHeader {
    metadata: Option<BTreeMap<String, String>>,
    tensors: Vec<(String, RawTensor)>,
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    #[serde(deserialize_with = "begin_end")]
    data_offsets: (u64, u64),
}

/// `data_offsets`: exactly `[begin, end]` (a pair would otherwise fail as "trailing characters").
fn begin_end<'de, D: Deserializer<'de>>(deserializer: D) -> Result<(u64, u64), D::Error> {
    let offsets = Vec::<u64>::deserialize(deserializer)?;
    match offsets[..] {
        [begin, end] => Ok((begin, end)),
        _ => Err(de::Error::custom(format!("data_offsets must be [begin, end], not {} numbers", offsets.len()))),
    }
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(RawHeaderVisitor)
    }
}

struct RawHeaderVisitor;

impl<'de> Visitor<'de> for RawHeaderVisitor {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object mapping tensor names to {dtype, shape, data_offsets}")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let mut metadata = None;
        let mut seen_metadata = false;
        let mut tensors = Vec::new();
        let mut names = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == METADATA_KEY {
                if seen_metadata {
                    return Err(de::Error::custom("duplicate key '__metadata__'"));
                }
                seen_metadata = true;
                metadata = map
                    .next_value::<Option<BTreeMap<String, String>>>()
                    .map_err(|e| de::Error::custom(format!("'__metadata__' must map strings to strings: {e}")))?;
                continue;
            }
            if !names.insert(key.clone()) {
                return Err(de::Error::custom(format!("duplicate tensor name '{key}'")));
            }
            let raw: RawTensor = map.next_value().map_err(|e| de::Error::custom(format!("tensor '{key}': {e}")))?;
            tensors.push((key, raw));
        }
        Ok(RawHeader { metadata, tensors })
    }
}

/// What opens a file as safetensors writes it: the 8-byte length, then the header JSON for
/// `tensors` in the order given, `__metadata__` first (keys sorted), compact, with spaces to
/// a multiple of 8 bytes so that the data starts aligned. safetensors' own writer and this one
/// both escape names with serde_json, so the same tensors give the same bytes.
pub fn serialize_header(tensors: &[TensorInfo], metadata: Option<&BTreeMap<String, String>>) -> Vec<u8> {
    let quoted = |s: &str| serde_json::to_string(s).expect("a string always serializes");
    let mut json = String::from("{");
    if let Some(metadata) = metadata {
        json.push_str(&format!("\"{METADATA_KEY}\":"));
        json.push_str(&serde_json::to_string(metadata).expect("a map of strings always serializes"));
    }
    for t in tensors {
        if json.len() > 1 {
            json.push(',');
        }
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        json.push_str(&format!(
            r#"{}:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}}"#,
            quoted(&t.name),
            t.dtype.name(),
            shape.join(","),
            t.begin,
            t.end
        ));
    }
    json.push('}');
    let padded = align_to_8(json.len() as u64);
    let mut out = Vec::with_capacity(LEN_PREFIX as usize + padded as usize);
    out.extend_from_slice(&padded.to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(LEN_PREFIX as usize + padded as usize, b' ');
    out
}

fn align_to_8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file made of `json` and `data_len` zero bytes.
    fn file(json: &str, data_len: usize) -> Vec<u8> {
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.resize(out.len() + data_len, 0);
        out
    }

    fn info(name: &str, dtype: Dtype, shape: &[u64], begin: u64, end: u64) -> TensorInfo {
        TensorInfo { name: name.into(), dtype, shape: shape.to_vec(), begin, end }
    }

    /// The bytes `serialize_header` writes, as safetensors 0.8's `save_file` wrote them for
    /// the same tensors (recorded from it).
    #[test]
    fn headers_are_the_bytes_safetensors_writes() {
        let expect = |bytes: Vec<u8>, json: &str, data_len: usize| {
            assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()), json.len() as u64);
            assert_eq!(std::str::from_utf8(&bytes[8..]).unwrap(), json);
            parse_header(&bytes[8..], (bytes.len() + data_len) as u64).expect("what we write parses");
        };
        expect(serialize_header(&[], None), "{}      ", 0);
        let pt = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        expect(serialize_header(&[], Some(&pt)), r#"{"__metadata__":{"format":"pt"}}"#, 0);
        let escaped = BTreeMap::from([("k\"".to_string(), "v\u{e9}\n".to_string())]);
        let tensors = [
            info("e", Dtype::I64, &[0, 3], 0, 0),
            info("s", Dtype::F32, &[], 0, 4),
            info("q\"\\\n\t\u{1}/\u{fc}", Dtype::BF16, &[2], 4, 8),
            info("b", Dtype::BOOL, &[1], 8, 9),
        ];
        expect(
            serialize_header(&tensors, Some(&escaped)),
            concat!(
                r#"{"__metadata__":{"k\"":"vé\n"},"e":{"dtype":"I64","shape":[0,3],"data_offsets":[0,0]},"#,
                r#""s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"#,
                r#""q\"\\\n\t\u0001/ü":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},"#,
                r#""b":{"dtype":"BOOL","shape":[1],"data_offsets":[8,9]}}"#
            ),
            9,
        );
        expect(
            serialize_header(&[info("x", Dtype::F4, &[3, 4], 0, 6)], None),
            r#"{"x":{"dtype":"F4","shape":[3,4],"data_offsets":[0,6]}} "#,
            6,
        );
    }

    /// safetensors 0.8 writes `{},"__metadata__":{}}` for an empty metadata map, which no
    /// reader parses; the header written here is the valid one.
    #[test]
    fn empty_metadata_is_valid_json() {
        let bytes = serialize_header(&[], Some(&BTreeMap::new()));
        assert_eq!(&bytes[8..], br#"{"__metadata__":{}}     "#);
        assert_eq!(parse_header(&bytes[8..], bytes.len() as u64).unwrap().metadata, Some(BTreeMap::new()));
    }

    #[test]
    fn data_offsets_are_a_pair() {
        for (offsets, n) in [("[0,8,9]", 3), ("[0]", 1), ("[]", 0)] {
            let json = format!(r#"{{"x":{{"dtype":"U8","shape":[8],"data_offsets":{offsets}}}}}"#);
            let err = parse(&file(&json, 8)).unwrap_err().to_string();
            assert!(err.contains(&format!("tensor 'x': data_offsets must be [begin, end], not {n} numbers")), "{err}");
        }
    }

    #[test]
    fn valid_file_parses_sorted_by_offset() {
        let json = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},
                      "a":{"dtype":"I16","shape":[2],"data_offsets":[0,4]},
                      "__metadata__":{"format":"pt"}}"#;
        let h = parse(&file(json, 12)).unwrap();
        assert_eq!(h.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(h.tensors[1].dtype, Dtype::F32);
        assert_eq!(h.tensors[1].shape, [2]);
        assert_eq!(h.metadata.unwrap()["format"], "pt");
        assert_eq!(h.data_start, 8 + json.len() as u64);
        assert_eq!(h.data_len, 12);
    }

    #[test]
    fn empty_object_with_no_data_is_valid() {
        let h = parse(&file("{}", 0)).unwrap();
        assert!(h.tensors.is_empty());
        assert_eq!(h.metadata, None);
        assert_eq!(h.file_len(), 10);
    }

    #[test]
    fn null_metadata_is_none() {
        let h = parse(&file(r#"{"__metadata__":null}"#, 0)).unwrap();
        assert_eq!(h.metadata, None);
    }

    #[test]
    fn padded_header_is_valid() {
        let h = parse(&file(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}    "#, 1)).unwrap();
        assert_eq!(h.tensors.len(), 1);
    }

    #[test]
    fn file_too_small() {
        assert_eq!(parse(&[]), Err(FormatError::FileTooSmall(0)));
        assert_eq!(parse(&[1, 0, 0, 0, 0, 0, 0]), Err(FormatError::FileTooSmall(7)));
    }

    #[test]
    fn header_len_past_end() {
        let mut f = file("{}", 0);
        f[0] = 3;
        assert_eq!(parse(&f), Err(FormatError::HeaderPastEnd { len: 3, file_len: 10 }));
        assert_eq!(parse(&u64::MAX.to_le_bytes()), Err(FormatError::HeaderTooLarge(u64::MAX)));
    }

    #[test]
    fn header_longer_than_the_file_it_claims() {
        assert_eq!(parse_header(b"{}", 0), Err(FormatError::HeaderPastEnd { len: 2, file_len: 0 }));
        assert_eq!(parse_header(b"{}", 9), Err(FormatError::HeaderPastEnd { len: 2, file_len: 9 }));
    }

    #[test]
    fn header_over_limit() {
        let f = (MAX_HEADER_LEN + 1).to_le_bytes();
        assert_eq!(parse(&f), Err(FormatError::HeaderTooLarge(MAX_HEADER_LEN + 1)));
        // The limit itself is allowed (then it must fit in the file).
        assert_eq!(header_len(&MAX_HEADER_LEN.to_le_bytes(), MAX_HEADER_LEN + 8), Ok(MAX_HEADER_LEN));
    }

    #[test]
    fn non_utf8_header() {
        let mut f = file("{\"a\":1}", 0);
        f[10] = 0xff;
        assert_eq!(parse(&f), Err(FormatError::HeaderNotUtf8(2)));
    }

    #[test]
    fn not_json() {
        assert!(matches!(parse(&file("{not json", 0)), Err(FormatError::InvalidJson(_))));
        assert!(matches!(parse(&file("", 0)), Err(FormatError::InvalidJson(_))));
    }

    #[test]
    fn not_an_object() {
        for json in ["[]", "3", "\"x\"", "null"] {
            assert!(matches!(parse(&file(json, 0)), Err(FormatError::InvalidJson(_))), "{json}");
        }
    }

    #[test]
    fn tensor_entry_of_wrong_shape() {
        for json in [
            r#"{"a":1}"#,
            r#"{"a":{"dtype":"F32","shape":[1]}}"#,
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
            r#"{"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}}"#,
        ] {
            let err = parse(&file(json, 4)).unwrap_err();
            assert!(matches!(&err, FormatError::InvalidJson(m) if m.contains("tensor 'a'")), "{json}: {err}");
        }
    }

    #[test]
    fn bad_metadata() {
        for json in [
            r#"{"__metadata__":{"a":1}}"#,
            r#"{"__metadata__":[]}"#,
            r#"{"__metadata__":"x"}"#,
            r#"{"__metadata__":{"a":{"b":"c"}}}"#,
        ] {
            let err = parse(&file(json, 0)).unwrap_err();
            assert!(matches!(&err, FormatError::InvalidJson(m) if m.contains("__metadata__")), "{json}: {err}");
        }
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                      "a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        let err = parse(&file(json, 1)).unwrap_err();
        assert!(matches!(&err, FormatError::InvalidJson(m) if m.contains("duplicate tensor name 'a'")), "{err}");
        let json = r#"{"__metadata__":{},"__metadata__":{}}"#;
        assert!(matches!(parse(&file(json, 0)), Err(FormatError::InvalidJson(_))));
    }

    #[test]
    fn unknown_dtype() {
        let err = parse(&file(r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#, 16));
        assert_eq!(err, Err(FormatError::UnknownDtype { name: "a".into(), dtype: "F128".into() }));
    }

    #[test]
    fn shape_length_mismatch() {
        let err = parse(&file(r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#, 12)).unwrap_err();
        assert_eq!(
            err,
            FormatError::LengthMismatch {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![2, 2],
                expected: 16,
                actual: 12
            }
        );
    }

    #[test]
    fn overflowing_shape() {
        let json = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#;
        assert!(matches!(parse(&file(json, 4)), Err(FormatError::ShapeOverflow { .. })));
        // numel fits, numel × bits does not.
        let json = r#"{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]}}"#;
        assert!(matches!(parse(&file(json, 4)), Err(FormatError::ShapeOverflow { .. })));
    }

    #[test]
    fn reversed_offsets() {
        let json = r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#;
        assert_eq!(parse(&file(json, 4)), Err(FormatError::ReversedOffsets { name: "a".into(), begin: 4, end: 0 }));
    }

    #[test]
    fn gap_between_tensors() {
        let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                      "b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#;
        assert_eq!(parse(&file(json, 5)), Err(FormatError::Gap { name: "b".into(), begin: 3, expected: 2 }));
        let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        assert_eq!(parse(&file(json, 3)), Err(FormatError::Gap { name: "a".into(), begin: 1, expected: 0 }));
    }

    #[test]
    fn overlapping_tensors() {
        let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                      "b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
        assert_eq!(
            parse(&file(json, 4)),
            Err(FormatError::Overlap { name: "b".into(), begin: 2, previous: "a".into(), previous_end: 4 })
        );
        // Same range twice.
        let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                      "b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(matches!(parse(&file(json, 4)), Err(FormatError::Overlap { .. })));
    }

    #[test]
    fn out_of_bounds() {
        let json = r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
        assert_eq!(parse(&file(json, 4)), Err(FormatError::OutOfBounds { name: "a".into(), end: 8, data_len: 4 }));
        let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}}"#;
        assert!(matches!(parse(&file(json, 4)), Err(FormatError::OutOfBounds { .. })));
    }

    #[test]
    fn trailing_bytes() {
        let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
        assert_eq!(parse(&file(json, 5)), Err(FormatError::TrailingBytes { trailing: 3, data_len: 5 }));
        assert_eq!(parse(&file("{}", 1)), Err(FormatError::TrailingBytes { trailing: 1, data_len: 1 }));
    }

    #[test]
    fn zero_sized_tensors() {
        let json = r#"{"a":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},
                      "b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                      "c":{"dtype":"F16","shape":[4,0],"data_offsets":[2,2]},
                      "s":{"dtype":"I64","shape":[],"data_offsets":[2,10]}}"#;
        let h = parse(&file(json, 10)).unwrap();
        let order: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(order, ["a", "b", "c", "s"]);
        assert_eq!(h.tensors[3].shape, Vec::<u64>::new());
    }

    #[test]
    fn packed_dtypes() {
        let json = r#"{"a":{"dtype":"F4","shape":[2,6],"data_offsets":[0,6]},
                      "b":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[6,9]},
                      "c":{"dtype":"F8_E8M0","shape":[3],"data_offsets":[9,12]}}"#;
        let h = parse(&file(json, 12)).unwrap();
        assert_eq!(h.tensors[0].dtype, Dtype::F4);
        let json = r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
        assert_eq!(
            parse(&file(json, 2)),
            Err(FormatError::PartialByte { name: "a".into(), dtype: Dtype::F4, numel: 3 })
        );
    }

    #[test]
    fn every_dtype_round_trips_its_name_and_size() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            let json = format!(r#"{{"t":{{"dtype":"{}","shape":[8],"data_offsets":[0,{}]}}}}"#, d, d.bits());
            let h = parse(&file(&json, d.bits() as usize)).unwrap();
            assert_eq!(h.tensors[0].nbytes(), d.bits(), "{d}");
        }
        assert_eq!(Dtype::from_name("f32"), None);
    }

    fn not_safetensors(file: &[u8]) -> Option<Foreign> {
        match parse(file) {
            Err(FormatError::NotSafetensors(found)) => Some(found),
            _ => None,
        }
    }

    #[test]
    fn torch_checkpoints_are_named() {
        // The first bytes of torch.save's zip archive and of its legacy pickle format.
        let zip = b"PK\x03\x04\x00\x00\x08\x08\x00\x00\x00\x00\x00\x00archive/data.pkl";
        assert_eq!(not_safetensors(zip), Some(Foreign::TorchZip));
        let pickle = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02}q\x00";
        assert_eq!(not_safetensors(pickle), Some(Foreign::TorchPickle));
        assert_eq!(not_safetensors(b"\x80\x04\x95\x1c\x01\x00\x00\x00\x00\x00\x00}\x94"), Some(Foreign::TorchPickle));
        let msg = parse(pickle).unwrap_err().to_string();
        assert!(
            msg.starts_with("not a safetensors file: it looks like a PyTorch pickle checkpoint (torch.save"),
            "{msg}"
        );
        assert!(msg.contains("torch.load"), "{msg}");
    }

    #[test]
    fn text_files_are_named() {
        let index = b"{\n  \"metadata\": {\n    \"total_size\": 16\n  },\n  \"weight_map\": {\"w\": \"model.safetensors\"}\n}\n";
        assert_eq!(not_safetensors(index), Some(Foreign::Json));
        assert!(parse(index).unwrap_err().to_string().contains("load()/load_file()"));
        assert_eq!(not_safetensors(b"\xef\xbb\xbf  [1, 2, 3]"), Some(Foreign::Json));
        let lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 548105171\n";
        assert_eq!(not_safetensors(lfs), Some(Foreign::LfsPointer));
        assert_eq!(not_safetensors(b"hello, world\n"), Some(Foreign::Text));
        assert_eq!(not_safetensors("poids du modèle: é".as_bytes()), Some(Foreign::Text));
        // Short files too, and a multi-byte character cut off by the sniffing window.
        assert_eq!(not_safetensors(b"{}\n"), Some(Foreign::Json));
        let mut long = vec![b'a'; SNIFF_LEN - 1];
        long.extend_from_slice("é and more".as_bytes());
        assert_eq!(not_safetensors(&long), Some(Foreign::Text));
    }

    #[test]
    fn other_formats_are_named() {
        assert_eq!(not_safetensors(b"GGUF\x03\x00\x00\x00\x10\x00\x00\x00"), Some(Foreign::Gguf));
        assert_eq!(not_safetensors(b"\x89HDF\r\n\x1a\n\x00\x00\x00\x00"), Some(Foreign::Hdf5));
        assert_eq!(not_safetensors(b"\x93NUMPY\x01\x00v\x00{'descr'"), Some(Foreign::Numpy));
        assert_eq!(not_safetensors(b"\x1f\x8b\x08\x00\x12\x34\x56\x78\x00\x03"), Some(Foreign::Gzip));
    }

    #[test]
    fn unknown_bytes_keep_the_length_error() {
        let binary = [0xde, 0xad, 0xbe, 0xef, 0x01, 0x02, 0x03, 0x04, 0x00];
        assert_eq!(parse(&binary), Err(FormatError::HeaderTooLarge(0x0403_0201_efbe_adde)));
        assert!(parse(&binary)
            .unwrap_err()
            .to_string()
            .contains("not a safetensors file, or its first 8 bytes are damaged"));
        // Control characters are not text.
        assert_eq!(not_safetensors(b"abc\x01defghij"), None);
        assert_eq!(parse(&[]), Err(FormatError::FileTooSmall(0)));
    }

    #[test]
    fn a_possible_header_length_is_never_called_a_pickle() {
        // 0x280 = 640: the bytes a pickle opens with, but also a plausible header length.
        let mut f = vec![0x80, 0x02, 0, 0, 0, 0, 0, 0];
        f.extend_from_slice(b"{}");
        assert_eq!(parse(&f), Err(FormatError::HeaderPastEnd { len: 640, file_len: 10 }));
        // And a valid file whose header is 640 bytes long parses.
        let json = format!("{{{}}}", " ".repeat(638));
        let valid = file(&json, 0);
        assert_eq!(&valid[..2], &[0x80, 0x02]);
        assert!(parse(&valid).is_ok());
        // Same for gzip's 1f 8b 08 with a zero timestamp.
        let f = [0x1f, 0x8b, 0x08, 0, 0, 0, 0, 0, b'{', b'}'];
        assert!(matches!(parse(&f), Err(FormatError::HeaderPastEnd { .. })));
    }

    #[test]
    fn errors_name_the_tensor() {
        let json = r#"{"weight.0":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}}"#;
        let msg = parse(&file(json, 4)).unwrap_err().to_string();
        assert!(msg.contains("'weight.0'") && msg.contains("needs 6"), "{msg}");
    }
}
