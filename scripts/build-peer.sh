#!/usr/bin/env bash
# Builds the fan-out benchmark's peer, rust-control-plane (bench/peer/, a workspace and
# target folder of its own), and prints the path of its binary: first `protox-protoc`,
# the pure-Rust protoc its data-plane-api compiles Envoy's protos with (named by PROTOC),
# then the peer, so that no system package is needed. bench/fanout.rs runs it when no
# --peer is given; scripts/test.sh runs it beside the timed steps.
set -euo pipefail
dir=$(cd "$(dirname "$0")/../bench/peer" && pwd)
build() { # build PACKAGE [VAR=VALUE...]
    local package=$1
    shift
    env -u CARGO_BUILD_TARGET -u RUSTFLAGS -u PROTOC_INCLUDE "$@" "${CARGO:-cargo}" build \
        --release --locked --quiet --manifest-path "$dir/Cargo.toml" \
        --package "$package" --target-dir "$dir/target" >&2
}
build protox-protoc
build ray-xds-bench-peer PROTOC="$dir/target/release/protox-protoc"
echo "$dir/target/release/rcp-peer"
