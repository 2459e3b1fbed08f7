//! Helpers shared by the integration tests: temporary directories and hand-made files.
#![allow(dead_code)]

use std::path::PathBuf;

use fastsafetensors::format::Dtype;

/// A directory of its own under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("fst-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Asks `done` every 20 ms until it says yes or `seconds` have passed; whether it said yes.
/// For what another thread or process does soon but not at once (a keeper counting a closed
/// connection out).
pub fn wait_until(seconds: u64, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    while !done() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// A file with the given (name, dtype, shape) tensors, each filled with a distinct byte pattern.
pub fn safetensors(tensors: &[(&str, &str, &[u64])], header_pad_to: usize) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let bits = Dtype::from_name(dtype).unwrap().bits();
        let len = (shape.iter().product::<u64>() * bits / 8) as usize;
        let begin = data.len();
        data.extend((0..len).map(|j| (j * 31 + i * 7) as u8));
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{begin},{}]}}"#,
            data.len()
        ));
    }
    let mut json = format!("{{{}}}", entries.join(","));
    while (8 + json.len()) % header_pad_to != 0 {
        json.push(' ');
    }
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(json.as_bytes());
    file.extend_from_slice(&data);
    file
}
