//! The loader's environment variables, read one way: unset or blank means the default, and a
//! malformed value is an error naming the variable and what it accepts, never ignored.

use crate::error::{Error, Result};

/// The value of environment variable `var`, parsed: None when unset or blank, an error
/// naming the variable and what it accepts (`expected`) when `parse` refuses it.
pub fn setting<T>(
    var: &'static str,
    expected: &'static str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>> {
    let value = match std::env::var(var) {
        Ok(value) => value,
        Err(std::env::VarError::NotPresent) => return Ok(None),
        Err(std::env::VarError::NotUnicode(raw)) => {
            return Err(Error::InvalidSetting { var, value: raw.to_string_lossy().into_owned(), expected })
        }
    };
    if value.trim().is_empty() {
        return Ok(None);
    }
    match parse(value.trim()) {
        Some(parsed) => Ok(Some(parsed)),
        None => Err(Error::InvalidSetting { var, value, expected }),
    }
}
