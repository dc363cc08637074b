#!/usr/bin/env bash
# Generates the Python gRPC stubs of the demo service (proto/ray_xds/demo/echo.proto)
# into OUT_DIR with `python -m grpc_tools.protoc`, laid out as the package
# `ray_xds.demo` (OUT_DIR/ray_xds/demo/echo_pb2.py and echo_pb2_grpc.py, namespace
# packages, no __init__.py), and prints OUT_DIR.
#
# Usage: tests/ray_apps/gen_grpc_stubs.sh OUT_DIR [PYTHON]
#   PYTHON defaults to .venv-ray/bin/python (scripts/install-ray.sh installs grpcio-tools
#   there, matching Ray's grpcio and protobuf: the generated code checks the protobuf
#   runtime's version).
#
# Ray's processes import the stubs: the gRPC proxy imports
# `ray_xds.demo.echo_pb2_grpc.add_EchoServicer_to_server` (grpc_options
# .grpc_servicer_functions) and the replicas unpickle `ray_xds.demo.echo_pb2` messages.
# Neither the proxy nor the controller has an application's runtime_env, so start every
# Ray node with OUT_DIR on PYTHONPATH (`PYTHONPATH=OUT_DIR ray start ...`): Ray's worker
# processes inherit it. tests/ray_apps/grpc_apps.py also adds $RAY_XDS_GRPC_STUBS to
# sys.path, for replicas started with a runtime_env that sets it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:?usage: gen_grpc_stubs.sh OUT_DIR [PYTHON]}
py=${2:-$root/.venv-ray/bin/python}
mkdir -p "$out"
out=$(cd "$out" && pwd)
"$py" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --grpc_python_out="$out" \
  "$root/proto/ray_xds/demo/echo.proto"
PYTHONPATH="$out" "$py" -c "from ray_xds.demo import echo_pb2, echo_pb2_grpc; echo_pb2_grpc.add_EchoServicer_to_server"
echo "$out"
