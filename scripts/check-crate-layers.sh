#!/usr/bin/env bash
# The crates are the layers: the xDS server crate (crates/xds-server) depends on nothing
# of Ray or Kubernetes, as `cargo tree` shows it. Fails naming what crept in.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(cargo tree -p xds-server -e normal,build --prefix none)
ray_side=$(printf '%s\n' "$tree" | grep -E '^(ray-xds|ray-serve-sim|kube|kube-[a-z-]+|k8s-openapi) ' | sort -u || true)
if [ -n "$ray_side" ]; then
    echo "check-crate-layers: xds-server depends on the Ray side:" >&2
    printf '%s\n' "$ray_side" >&2
    exit 1
fi
echo "check-crate-layers: xds-server's $(printf '%s\n' "$tree" | sort -u | wc -l) crates hold nothing of Ray or Kubernetes"
