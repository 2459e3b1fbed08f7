//! Differential: this crate's parser against the reference `safetensors` crate. Both must
//! accept the same files and read the same tensors and metadata from them.
//!
//! Two differences are known and skipped: a header naming a tensor twice is rejected here,
//! while the reference keeps the last entry silently; and a tensor entry's unknown fields
//! are skipped here at any depth, while the reference rejects them when nested deeper than
//! serde_json's recursion limit (it buffers them first).
#![no_main]

use std::collections::HashMap;

use fastsafetensors::format::{self, FormatError, Header, LEN_PREFIX};
use libfuzzer_sys::fuzz_target;
use safetensors::{SafeTensorError, SafeTensors};

fuzz_target!(|file: &[u8]| {
    match (format::parse(file), SafeTensors::read_metadata(file)) {
        (Ok(ours), Ok((header_len, theirs))) => compare(&ours, header_len as u64, &theirs),
        (Err(_), Err(_)) => {}
        (Err(ours), Ok(_)) if names_a_tensor_twice(&ours) => {}
        (Ok(_), Err(theirs)) if too_deep_for_the_reference(&theirs) => {}
        (Ok(ours), Err(theirs)) => panic!("accepted a file the reference rejects ({theirs:?}): {ours:?}"),
        (Err(ours), Ok(_)) => panic!("rejected a file the reference accepts: {ours}"),
    }
});

fn names_a_tensor_twice(e: &FormatError) -> bool {
    matches!(e, FormatError::InvalidJson(msg) if msg.contains("duplicate tensor name"))
}

fn too_deep_for_the_reference(e: &SafeTensorError) -> bool {
    matches!(e, SafeTensorError::InvalidHeaderDeserialization(e) if e.to_string().contains("recursion limit"))
}

fn compare(ours: &Header, header_len: u64, theirs: &safetensors::tensor::Metadata) {
    assert_eq!(ours.data_start, LEN_PREFIX + header_len);
    let their_tensors: HashMap<String, &safetensors::tensor::TensorInfo> = theirs.tensors();
    assert_eq!(ours.tensors.len(), their_tensors.len());
    for t in &ours.tensors {
        let other = their_tensors.get(&t.name).unwrap_or_else(|| panic!("'{}' missing from the reference", t.name));
        assert_eq!(t.dtype.name(), format!("{:?}", other.dtype), "'{}'", t.name);
        assert!(t.shape.iter().map(|&d| d as usize).eq(other.shape.iter().copied()), "'{}'", t.name);
        assert_eq!((t.begin as usize, t.end as usize), other.data_offsets, "'{}'", t.name);
    }
    let their_metadata = theirs.metadata().as_ref().map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    assert_eq!(ours.metadata, their_metadata);
}
