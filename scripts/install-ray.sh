#!/usr/bin/env bash
# Installs real Ray Serve 2.60.0 (ray[serve] from PyPI) into a project-local virtual
# environment, .venv-ray/, and prints the path of its `ray` command. About a minute the
# first time; idempotent afterwards (only the version is checked). The real-Ray tests
# (tests/real_ray.rs) call this.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-ray"
want="2.60.0"
ray_bin="$venv/bin/ray"
# Several test binaries may call this at once: one installs, the others wait.
mkdir -p "$venv"
exec 9>"$venv/.install.lock"
flock 9
if [ -x "$ray_bin" ] && "$venv/bin/python" -c "import ray, sys; sys.exit(ray.__version__ != '$want')" 2>/dev/null; then
  echo "$ray_bin"
  exit 0
fi
python3 -m venv "$venv" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check "ray[serve]==$want" >&2
"$venv/bin/python" -c "import ray; print('ray', ray.__version__)" >&2
echo "$ray_bin"
