//! Compiles the protos the simulated gRPC proxy serves (`src/grpc.rs`) into Rust with a
//! pure-Rust protobuf compiler (`protox`), as the root `build.rs` does, so a fresh machine
//! needs no system `protoc`: Ray Serve's own API (`ray.serve.RayServeAPIService`) and the
//! demo application (`ray_xds.demo.Echo`), servers and clients both.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTOS: [&str; 2] = ["ray/serve/serve.proto", "ray_xds/demo/echo.proto"];
    for proto in PROTOS {
        println!("cargo:rerun-if-changed=../proto/{proto}");
    }
    let descriptors = protox::compile(PROTOS, ["../proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
