//! Generates the tonic examples' `demo.Catalog` code from `proto/catalog.proto`, as
//! tonic's own examples do, with protox compiling the file: no `protoc` to install.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/catalog.proto");
    let descriptors = protox::compile(["proto/catalog.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
