#!/usr/bin/env bash
# The project's test command (README, .ci/run): formatting, lints, then every test,
# including the ones that run the real Envoy (installed into .venv/ first) and real Ray
# Serve 2.60 (installed into .venv-ray/ first; its tests need root for the network
# namespaces their worker nodes run in).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install-envoy.sh >/dev/null
bash scripts/install-ray.sh >/dev/null
bash scripts/install-protoc.sh
# Every step has a deadline of its own, so a hang fails the step that hung (and says
# which) instead of running into CI's overall limit.
step() {
    local limit=$1
    shift
    timeout --kill-after=30 "$limit" "$@" || {
        local rc=$?
        if [ "$rc" -ge 124 ]; then echo "test.sh: '$*' did not finish within $limit" >&2; fi
        exit "$rc"
    }
}
cargo fmt --check
cargo clippy --all-targets -- -D warnings
# The fan-out benchmark, small and unoptimized: a smoke test that it still runs, both
# servers (the peer, rust-control-plane, is built from bench/peer/ the first time) and
# both protocols; it fails when a client misses a change from ray-xds. A node id per
# stream: with one shared, rust-control-plane 0.1.2 loses changes (README, fan-out).
step 20m cargo test --bench fanout -- --streams 20 --changes 2 --node-id-per-stream
step 8m cargo test --bench soak -- --duration 20
step 8m cargo test --bench scale -- --proxies 300 --steady 4 --edits 2
# The detection benchmark, tiny (about 10 s once built): a killed, a hung and a slow but
# live proxy still go end to end, through real Envoys.
step 5m cargo test --bench detection -- --trials 3 --lanes 3 --cost-proxies 0 --slow-window 2
# One short chaos scenario per fault family (a proxy dies, a proxy hangs, a proxy drains,
# a cluster is upgraded, the control plane is down while a proxy dies or hangs): fails
# when ray-xds loses a request or runs one twice; the baseline's count is printed, not
# asserted.
step 20m cargo test --bench chaos -- --scenario head-crash --scenario proxy-hang \
    --scenario proxy-drain --scenario upgrade --scenario control-plane-down-crash \
    --scenario control-plane-down-hang \
    --arm ray-xds --arm ray-xds-head-include --arm baseline-kuberay \
    --duration 10 --fault-at 2 --deploy 4 --rps 50 --client-timeout 5 --assert
# The same rule for gRPC calls (each node's gRPC proxy): a proxy dies, a cluster is upgraded.
step 10m cargo test --bench chaos -- --protocol grpc --scenario worker-crash --scenario upgrade \
    --arm ray-xds --arm baseline-kuberay \
    --duration 10 --fault-at 2 --deploy 4 --rps 50 --client-timeout 5 --assert
step 35m cargo test --lib --bins --tests -- --skip real_ray_
# deploy/ against the Kubernetes OpenAPI schema (1.30 and the newest), strict, and the
# cert-manager objects against the cert-manager v1 fields (kubernetes-validate from PyPI).
step 5m bash scripts/validate-deploy.sh
# The container image (scripts/build-image.sh, from scratch, no daemon, no pull) checked
# and run read-only as user 65532 (podman + runc): the release build is most of it.
step 15m bash scripts/check-image.sh
# Real Ray Serve clusters (about 1 GB and 15 s per node): one test at a time.
step 20m cargo test --test real_ray -- --test-threads=1
