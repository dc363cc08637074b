#!/usr/bin/env bash
# Installs real Ray Serve 2.60.0 (ray[serve] from PyPI) into a project-local virtual
# environment, .venv-ray/, together with grpcio-tools (for generating the Python gRPC
# stubs of proto/ray_xds/demo/echo.proto, see tests/ray_apps/gen_grpc_stubs.sh), and
# prints the path of its `ray` command. About a minute the first time; idempotent
# afterwards (the Ray version and the grpc_tools import are checked).
# The real-Ray tests (tests/real_ray/serve.rs) call this.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-ray"
want="2.60.0"
ray_bin="$venv/bin/ray"
py="$venv/bin/python"
# Several test binaries may call this at once: one installs, the others wait.
mkdir -p "$venv"
exec 9>"$venv/.install.lock"
flock 9
ray_ok() {
  [ -x "$ray_bin" ] && "$py" -c "import ray, sys; sys.exit(ray.__version__ != '$want')" 2>/dev/null
}
tools_ok() {
  "$py" -c "import grpc, grpc_tools.protoc" 2>/dev/null
}
if ray_ok && tools_ok; then
  echo "$ray_bin"
  exit 0
fi
if ! ray_ok; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "ray[serve]==$want" >&2
fi
if ! tools_ok; then
  # grpcio-tools X.Y.Z requires grpcio>=X.Y.Z and a protobuf range, and its patch
  # releases do not track grpcio's (Ray 2.60 pulls in grpcio 1.85.3; the newest
  # grpcio-tools 1.85 is 1.85.1). So: the same minor as Ray's grpcio, with Ray's grpcio
  # and protobuf pinned, so that pip never changes what Ray runs on.
  read -r grpcio protobuf < <("$py" -c "import importlib.metadata as m; print(m.version('grpcio'), m.version('protobuf'))")
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "grpcio==$grpcio" "protobuf==$protobuf" "grpcio-tools==${grpcio%.*}.*" >&2
fi
"$py" -c "import ray, grpc, grpc_tools; print('ray', ray.__version__, 'grpcio', grpc.__version__)" >&2
echo "$ray_bin"
