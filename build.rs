//! Compiles `proto/` into Rust with a pure-Rust protobuf compiler (`protox`), so a fresh
//! machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/ray/serve/serve.proto");
    let descriptors = protox::compile(["ray/serve/serve.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
