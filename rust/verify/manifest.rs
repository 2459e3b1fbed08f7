//! Manifests from digests the caller gives and from a Hugging Face cache's blob names.
