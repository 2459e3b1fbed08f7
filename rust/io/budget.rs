//! How much host memory a load may allocate, so that an oversized load fails with a clear
//! error instead of being killed by the OOM killer halfway through.

use crate::error::{Error, Result};

/// Environment variable capping the host memory a load allocates: bytes, with an optional
/// K/M/G/T suffix (powers of 1024), or `unlimited`.
pub const MAX_HOST_MEMORY_ENV: &str = "FASTSAFETENSORS_MAX_HOST_MEMORY";

/// The cap on owned host memory: `Some(Some(bytes))`, `Some(None)` for `unlimited`, None
/// when `$FASTSAFETENSORS_MAX_HOST_MEMORY` is not set; an error when it is malformed.
pub fn limit_from_env() -> Result<Option<Option<u64>>> {
    super::setting(MAX_HOST_MEMORY_ENV, "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'", parse_size)
}

/// Fails if `needed` bytes of owned host buffers exceed the configured cap or, when none is
/// set, the memory the kernel reports as available. Zero-copy mappings do not count: they
/// are page cache the kernel can reclaim.
pub fn check(needed: u64) -> Result<()> {
    let (limit, why) = match limit_from_env()? {
        Some(None) => return Ok(()),
        Some(Some(limit)) => (limit, "allowed by FASTSAFETENSORS_MAX_HOST_MEMORY"),
        None => match mem_available() {
            Some(available) => (available, "available (MemAvailable)"),
            None => return Ok(()),
        },
    };
    if needed > limit {
        return Err(Error::OutOfMemory { needed, limit, why });
    }
    Ok(())
}

/// `Some(None)` for unlimited, `Some(Some(bytes))` for a size, `None` if unparseable.
fn parse_size(text: &str) -> Option<Option<u64>> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("unlimited") {
        return Some(None);
    }
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'k' | 'K') => (&text[..i], 10),
        (i, 'm' | 'M') => (&text[..i], 20),
        (i, 'g' | 'G') => (&text[..i], 30),
        (i, 't' | 'T') => (&text[..i], 40),
        _ => (text, 0),
    };
    let n: u64 = digits.trim().parse().ok()?;
    n.checked_mul(1u64 << shift).map(Some)
}

fn mem_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Some(Some(4096)));
        assert_eq!(parse_size("64K"), Some(Some(64 << 10)));
        assert_eq!(parse_size(" 3g "), Some(Some(3 << 30)));
        assert_eq!(parse_size("2T"), Some(Some(2 << 40)));
        assert_eq!(parse_size("unlimited"), Some(None));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_size("99999999999T"), None, "overflow is an error, not a wrap");
    }
}
