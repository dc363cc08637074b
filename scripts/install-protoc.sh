#!/usr/bin/env bash
# protoc, for the fan-out benchmark's peer (bench/peer/: rust-control-plane's
# data-plane-api compiles Envoy's protos when it builds). Debian's protobuf-compiler,
# installed with apt-get when protoc is missing.
set -euo pipefail
command -v protoc >/dev/null 2>&1 && exit 0
die() { echo "install-protoc.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "protoc is missing; install it (apt-get install protobuf-compiler) or run as root"
command -v apt-get >/dev/null 2>&1 || die "protoc is missing and there is no apt-get to install it"
if ! apt-get install -y --no-install-recommends protobuf-compiler >/dev/null 2>&1; then
    apt-get update >/dev/null
    apt-get install -y --no-install-recommends protobuf-compiler >/dev/null
fi
command -v protoc >/dev/null 2>&1 || die "protobuf-compiler installed but protoc is not on PATH"
