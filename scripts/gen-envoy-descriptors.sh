#!/usr/bin/env bash
# Regenerates proto/envoy-descriptors.bin from the descriptor set that the envoy-types
# crate ships (the same protos as its Rust types), cut down to the Envoy messages ray-xds
# emits. Run it after upgrading envoy-types; tests/xds/descriptors.rs explains the rest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dir=$(cargo metadata --format-version 1 --locked \
  | python3 -c 'import json,sys; m=json.load(sys.stdin); print(next(p["manifest_path"] for p in m["packages"] if p["name"]=="envoy-types").rsplit("/",1)[0])')
ENVOY_TYPES_DIR="$dir" cargo test --test xds -- --ignored descriptors::regenerate --nocapture
