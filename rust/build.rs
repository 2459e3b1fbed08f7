// Compiles the C++ half of the cxx bridge into this crate, so the staticlib carries it.
fn main() {
    cxx_build::bridge("rust/bridge.rs").std("c++17").flag_if_supported("-fPIC").compile("fastsafetensors_bridge");
    println!("cargo:rerun-if-changed=rust/bridge.rs");
}
