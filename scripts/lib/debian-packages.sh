# shellcheck shell=bash
# Sourced by the scripts that need a Debian package: `need_packages` names each package,
# the file of it that the script reads and why, installs what is missing with apt-get
# (never through a recommendation: --no-install-recommends), and checks afterwards that
# every named file is there, so a missing step fails where it is and says which package.
#
#   source "$root/scripts/lib/debian-packages.sh"
#   need_packages "scripts/test.sh" \
#       "iproute2 /bin/ip the real-Ray tests give each Ray worker a network namespace" \
#       "openssl /usr/bin/openssl tests/xds/tls_hostile.rs makes keys with the openssl CLI"
#
# Each argument after the first is "PACKAGE FILE WHY..." (FILE absolute). A package is
# installed only when its file is missing. Installing needs root and apt-get; without
# them the script stops with the apt-get command a user would run.

need_packages() {
    local who=$1
    shift
    local entry pkg file why missing=() lines=()
    for entry in "$@"; do
        read -r pkg file why <<<"$entry"
        [ -e "$file" ] && continue
        missing+=("$pkg")
        lines+=("  $pkg (for $file: $why)")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    {
        echo "$who: installing Debian packages:"
        printf '%s\n' "${lines[@]}"
    } >&2
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "$who: cannot install them here (needs root and apt-get); run: apt-get install --no-install-recommends ${missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet: update only when the install fails.
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        apt-get update >/dev/null
        apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
    fi
    local failed=0
    for entry in "$@"; do
        read -r pkg file why <<<"$entry"
        if [ ! -e "$file" ]; then
            echo "$who: Debian package $pkg is installed but $file is missing ($why)" >&2
            failed=1
        fi
    done
    [ "$failed" -eq 0 ] || exit 1
}

# The installed version of each Debian package named, one "package version" a line
# ("package -" when it is not installed), for logs that say with what a step ran.
package_versions() {
    local pkg
    for pkg in "$@"; do
        printf '%s %s\n' "$pkg" "$(dpkg-query -W -f '${Version}' "$pkg" 2>/dev/null || echo -)"
    done
}
