//! The per-file check readers feed.
pub struct FileCheck;
pub struct Verifier;
