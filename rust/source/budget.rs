//! How much memory a load may hold.
//!
//! Two limits, one for each kind of load:
//! - a load that returns everything at once owns the buffers of every directly read file; when
//!   they exceed the host-memory limit ([`host_limit`]), `auto` maps the files that do not fit
//!   instead (a mapping is page cache the kernel can reclaim), and an explicit `direct`
//!   reader fails with a clear error rather than be killed by the OOM killer halfway through;
//! - a streaming load holds at most its budget ([`stream_budget`]) of buffers: being read,
//!   read and waiting, or handed out and still referenced by a tensor.

use crate::error::{Error, Result};

/// Environment variable capping the host memory a load that returns everything at once
/// reads into: a size (see [`parse_size`]) or `unlimited`.
pub const MAX_HOST_MEMORY_ENV: &str = "FASTSAFETENSORS_MAX_HOST_MEMORY";

/// Environment variable setting a streaming load's memory budget when the caller gives none:
/// a size (see [`parse_size`]) or `unlimited`.
pub const MAX_MEMORY_ENV: &str = "FASTSAFETENSORS_MAX_MEMORY";

/// A stream's budget when none is set: enough to keep the disk busy while the consumer
/// works, small beside the memory of any machine that loads models.
pub const DEFAULT_STREAM_BUDGET: u64 = 1 << 30;

/// What the size settings accept.
const SIZE: &str = "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'";

/// The cap on owned host memory: `Some(Some(bytes))`, `Some(None)` for `unlimited`, None
/// when `$FASTSAFETENSORS_MAX_HOST_MEMORY` is not set; an error when it is malformed.
pub fn limit_from_env() -> Result<Option<Option<u64>>> {
    crate::settings::setting(MAX_HOST_MEMORY_ENV, SIZE, parse_size)
}

/// A stream's budget from `$FASTSAFETENSORS_MAX_MEMORY`: as [`limit_from_env`].
pub fn stream_limit_from_env() -> Result<Option<Option<u64>>> {
    crate::settings::setting(MAX_MEMORY_ENV, SIZE, parse_size)
}

/// The host-memory limit of a load that returns everything: `$FASTSAFETENSORS_MAX_HOST_MEMORY`
/// if set, else the memory the kernel reports as available; `None` when unlimited or unknown.
/// The second value says where the limit comes from.
pub fn host_limit() -> Result<Option<(u64, &'static str)>> {
    match limit_from_env()? {
        Some(limit) => Ok(limit.map(|l| (l, "allowed by FASTSAFETENSORS_MAX_HOST_MEMORY"))),
        None => Ok(mem_available().map(|available| (available, "available (MemAvailable)"))),
    }
}

/// Fails if `needed` bytes of owned host buffers exceed [`host_limit`]. Zero-copy mappings do
/// not count: they are page cache the kernel can reclaim.
pub fn check(needed: u64) -> Result<()> {
    match host_limit()? {
        Some((limit, why)) if needed > limit => Err(Error::OutOfMemory { needed, limit, why }),
        _ => Ok(()),
    }
}

/// A streaming load's budget in bytes (`u64::MAX` for unlimited): `requested` if given (the
/// `max_memory` argument), else `$FASTSAFETENSORS_MAX_MEMORY`, else
/// [`DEFAULT_STREAM_BUDGET`], but never more than half the memory available then, so that
/// reading ahead cannot push the machine into swapping. Malformed values are errors naming
/// where they came from.
pub fn stream_budget(requested: Option<&str>) -> Result<u64> {
    let explicit = match requested {
        Some(text) => Some(
            parse_size(text)
                .ok_or_else(|| Error::InvalidArgument(format!("max_memory='{text}' is not valid: expected {SIZE}")))?,
        ),
        None => stream_limit_from_env()?,
    };
    Ok(match explicit {
        Some(limit) => limit.unwrap_or(u64::MAX),
        None => DEFAULT_STREAM_BUDGET.min(mem_available().map_or(u64::MAX, |a| a / 2)),
    })
}

/// Parses a size: a whole number of bytes, optionally followed by `K`, `M`, `G` or `T`
/// (powers of 1024, any case, optionally followed by `B` or `iB`: `256M`, `256MB`,
/// `256MiB`), or `B` alone; or `unlimited`. `Some(None)` for unlimited, `Some(Some(bytes))`
/// for a size, `None` if malformed or too large.
pub fn parse_size(text: &str) -> Option<Option<u64>> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("unlimited") {
        return Some(None);
    }
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1u64 << shift).map(Some)
}

/// The machine's memory (`MemTotal`), if the kernel says.
pub(crate) fn mem_total() -> Option<u64> {
    meminfo("MemTotal:")
}

fn mem_available() -> Option<u64> {
    meminfo("MemAvailable:")
}

fn meminfo(field: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Some(Some(4096)));
        assert_eq!(parse_size("4096B"), Some(Some(4096)));
        assert_eq!(parse_size("64K"), Some(Some(64 << 10)));
        assert_eq!(parse_size(" 3g "), Some(Some(3 << 30)));
        assert_eq!(parse_size("2T"), Some(Some(2 << 40)));
        assert_eq!(parse_size("256MB"), Some(Some(256 << 20)));
        assert_eq!(parse_size("256 MiB"), Some(Some(256 << 20)));
        assert_eq!(parse_size("0"), Some(Some(0)));
        assert_eq!(parse_size("unlimited"), Some(None));
        assert_eq!(parse_size("UNLIMITED"), Some(None));
        for bad in ["lots", "-1", "", "M", "1.5G", "12X", "256 M B", "0x10", "1e9"] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
        assert_eq!(parse_size("99999999999T"), None, "overflow is an error, not a wrap");
    }

    #[test]
    fn stream_budget_takes_the_argument_first_and_rejects_malformed_ones() {
        assert_eq!(stream_budget(Some("256M")).unwrap(), 256 << 20);
        assert_eq!(stream_budget(Some("unlimited")).unwrap(), u64::MAX);
        let err = stream_budget(Some("256 megs")).unwrap_err().to_string();
        assert!(err.contains("max_memory='256 megs' is not valid") && err.contains("K/M/G/T"), "{err}");
    }
}
