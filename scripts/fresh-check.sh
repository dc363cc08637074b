#!/usr/bin/env bash
# The README's two commands on a machine that has nothing: a clean clone of this
# repository's HEAD, run in a root file system made by `debootstrap --variant=minbase`
# (Debian's essential packages and apt, nothing else) plus exactly the prerequisites the
# README lists, so that a package installed by hand on this machine cannot hide a missing
# install step.
#
#   bash scripts/fresh-check.sh [--quick] [--keep] [--dir DIR]
#     --quick     every install step and every build, no test: the demo, then
#                 `scripts/test.sh --build-only` (about 25 minutes; the whole check takes
#                 as long as CI plus a cold build, about an hour on 2 cores)
#     --keep      leave the root file system behind (default: removed at the end)
#     --dir DIR   build it in DIR, which must not exist (default: a new folder under
#                 /var/tmp)
#
# What goes into the root file system, and nothing else:
# - debootstrap's minbase of this machine's Debian release, from this machine's mirror;
#   the package list it starts from is printed;
# - the Debian packages of the README's prerequisites line (`apt-get install
#   --no-install-recommends ...`, read from README.md);
# - this machine's Rust toolchain (the sysroot `rustc --print sysroot` names) and Python
#   (`sys.base_prefix`), mounted read-only at the same paths, with the Debian packages of
#   the shared libraries they link, as this machine has them (printed); a fresh, empty
#   CARGO_HOME, so every crate is downloaded again;
# - this machine's network settings, which no project can choose: resolv.conf, the CA
#   certificates under /usr/local/share/ca-certificates (an egress proxy's, here), apt's
#   sources, /etc/pip.conf, and the PIP_*, CARGO_* and *_proxy variables;
# - /proc (of a PID namespace of its own), /sys, /dev, a fresh /dev/shm and /run (with
#   /run/netns for the real-Ray tests' network namespaces).
# Every mount is made in a mount namespace of the check's own and every process runs in a
# PID namespace of its own, so the mounts and the processes go when the check ends,
# however it ends. The network is this machine's (pip and cargo download; the demo binds
# its fixed ports on 127.0.0.1, so run the check on a quiet machine).
#
# Needs root, and debootstrap (installed from Debian when missing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib/debian-packages.sh
source "$root/scripts/lib/debian-packages.sh"
log() { echo "fresh-check: $*" >&2; }
die() {
    log "$*"
    exit 1
}

quick="" keep="" dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1; shift ;;
        --keep) keep=1; shift ;;
        --dir) dir=$2; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot, mounts)"
need_packages scripts/fresh-check.sh \
    "debootstrap /usr/sbin/debootstrap builds the fresh root file system"

commit=$(git -C "$root" rev-parse HEAD)
[ -z "$(git -C "$root" status --porcelain)" ] ||
    log "the working tree has changes; only the commit $commit is checked"

# The prerequisites, as the README states them: its first line starting with
# `apt-get install --no-install-recommends`.
prereq_line=$(grep -m1 -E '^apt-get install --no-install-recommends ' "$root/README.md") ||
    die "README.md has no 'apt-get install --no-install-recommends ...' line of prerequisites"
prereq_line=${prereq_line%$'\r'}
prereq_line=${prereq_line#apt-get install --no-install-recommends }
prereq_line=${prereq_line%%#*}
case "$prereq_line" in *\\*) die "README.md's prerequisites line continues on the next: keep it on one line" ;; esac
read -r -a prerequisites <<<"$prereq_line"

# This machine's toolchains.
sysroot=$(rustc --print sysroot)
python_prefix=$(python3 -c 'import sys; print(sys.base_prefix)')
python_version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
for tool in cargo rustc cargo-fmt cargo-clippy; do
    [ -x "$sysroot/bin/$tool" ] || die "$sysroot/bin/$tool is missing: the toolchain needs rustfmt and clippy (rustup component add rustfmt clippy)"
done
# A toolchain in a prefix of its own is mounted as it is; one in the system's folders
# cannot be (it would bring the host's /usr along): a system Python is replaced by
# Debian's own (python3, python3-venv), a system Rust is refused.
case "$sysroot" in
    /usr | /usr/local) die "rustc's sysroot is $sysroot, the system's: this check mounts a toolchain installed in a folder of its own (rustup's)" ;;
esac
system_python=""
case "$python_prefix" in
    /usr | /usr/local) system_python=1 ;;
esac

# The Debian packages holding the shared libraries these files link, as this machine has
# them (dpkg knows a library by the path its package ships, /lib or /usr/lib).
packages_linked_by() {
    local f lib
    for f in "$@"; do ldd "$f" 2>/dev/null || true; done |
        awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
        while read -r lib; do
            case "$lib" in "$sysroot"/* | "$python_prefix"/*) continue ;; esac
            dpkg -S "$lib" 2>/dev/null || dpkg -S "/usr$lib" 2>/dev/null ||
                dpkg -S "${lib#/usr}" 2>/dev/null || log "no Debian package has $lib"
        done | cut -d: -f1 | sort -u
}
if [ -n "$system_python" ]; then
    mapfile -t toolchain_packages < <(packages_linked_by \
        "$sysroot"/bin/* "$sysroot"/lib/*.so* "$sysroot"/libexec/*)
    toolchain_packages+=(python3 python3-venv python3-pip)
else
    mapfile -t toolchain_packages < <(packages_linked_by \
        "$sysroot"/bin/* "$sysroot"/lib/*.so* "$sysroot"/libexec/* \
        "$python_prefix/bin/python$python_version" "$python_prefix"/lib/*.so* \
        "$python_prefix/lib/python$python_version"/lib-dynload/*.so)
fi

if [ -z "$dir" ]; then
    dir=$(mktemp -d /var/tmp/ray-xds-fresh-check.XXXXXX)
    rmdir "$dir"
fi
[ ! -e "$dir" ] || die "$dir exists; give a new folder"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# Removes the root file system, but never through a mount: the mounts live in the check's
# own mount namespace, so none should be left, and if one is, nothing is removed.
runner=""
cleanup() {
    local rc=$?
    if [ -n "$runner" ]; then
        # The run's PID namespace goes with its first process (--kill-child).
        kill -TERM "$runner" 2>/dev/null || true
        wait "$runner" 2>/dev/null || true
    fi
    local mounts
    mounts=$(findmnt -rn -o TARGET || true)
    if [ -n "$keep" ]; then
        log "kept $dir"
    elif grep -qF "$dir" <<<"$mounts"; then
        log "something is still mounted under $dir; not removing it"
    else
        rm -rf --one-file-system "$dir"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

. /etc/os-release
suite=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
mirror=${mirror:-http://deb.debian.org/debian}
log "commit $commit; $(rustc --version); Python $python_version from $python_prefix"
log "debootstrap --variant=minbase $suite $dir $mirror"
started=$SECONDS
debootstrap --variant=minbase "$suite" "$dir" "$mirror" >"$dir.debootstrap.log" 2>&1 ||
    die "debootstrap failed: $(tail -n 5 "$dir.debootstrap.log")"
rm -f "$dir.debootstrap.log"
log "debootstrap took $((SECONDS - started)) s"
echo "== fresh-check: the root file system starts with these packages"
chroot "$dir" dpkg-query -W -f '${Package} ${Version}\n' | sed 's/^/  /'

# This machine's network settings.
cp /etc/resolv.conf "$dir/etc/resolv.conf"
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$dir/etc/apt/sources.list.d/"
    rm -f "$dir/etc/apt/sources.list"
fi
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$dir/etc/pip.conf"
mkdir -p "$dir/usr/local/share/ca-certificates"
cp -r /usr/local/share/ca-certificates/. "$dir/usr/local/share/ca-certificates/" 2>/dev/null || true

# The machine's registry and proxy settings (apt, pip, cargo and curl read them).
machine_env() {
    compgen -e | grep -E '^(PIP_|CARGO_(HTTP|NET|REGISTR)|(http|https|no|all)_proxy$|(HTTP|HTTPS|NO|ALL)_PROXY$)' || true
}
proxy_env=()
while IFS= read -r name; do
    case "$name" in *_proxy | *_PROXY) proxy_env+=("$name=${!name}") ;; esac
done < <(machine_env)
[ -d /etc/apt/apt.conf.d ] && for f in /etc/apt/apt.conf.d/*proxy*; do
    [ -f "$f" ] && cp "$f" "$dir/etc/apt/apt.conf.d/"
done

echo "== fresh-check: the README's prerequisites: ${prerequisites[*]}"
echo "== fresh-check: the libraries of the mounted Rust and Python link: ${toolchain_packages[*]}"
chroot "$dir" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "${proxy_env[@]}" \
    sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null' \
    _ "${prerequisites[@]}" "${toolchain_packages[@]}" ||
    die "installing the prerequisites failed"

# The rest of the machine's settings, but for one naming a path the root file system
# lacks (pip would warn about it on every run).
passed_env=()
while IFS= read -r name; do
    case "${!name}" in /*) [ -e "$dir${!name}" ] || continue ;; esac
    passed_env+=("$name=${!name}")
done < <(machine_env)

# Mount points for the toolchains and the project's history (read-only), then the run.
# Only the machine Python's own commands go on PATH (a prefix may hold other tools, curl
# or git among them, that would hide a missing install step).
mkdir -p "$dir$sysroot" "$dir/project.git" "$dir/run" "$dir/root/.cargo" "$dir/opt/machine-python/bin"
if [ -z "$system_python" ]; then
    mkdir -p "$dir$python_prefix"
    for tool in python3 "python$python_version" pip3; do
        [ -e "$python_prefix/bin/$tool" ] && ln -sf "$python_prefix/bin/$tool" "$dir/opt/machine-python/bin/$tool"
    done
fi
cat >"$dir/fresh-check-inner.sh" <<'EOF'
set -euo pipefail
cd /root
# The project's history belongs to whoever cloned it, not to this root.
git config --global --add safe.directory '*'
git clone --quiet /project.git ray-xds
cd ray-xds
git -c advice.detachedHead=false checkout --quiet "$COMMIT"
echo "== fresh-check: $(git log -1 --format='%h %s')"
started=$SECONDS
echo "== fresh-check: bash scripts/demo.sh"
bash scripts/demo.sh
echo "-- the demo took $((SECONDS - started)) s"
if [ -n "$QUICK" ]; then
    echo "== fresh-check: bash scripts/test.sh --build-only"
    bash scripts/test.sh --build-only
else
    echo "== fresh-check: bash scripts/test.sh"
    bash scripts/test.sh
fi
EOF

echo "== fresh-check: running in $dir"
started=$SECONDS
set +e
unshare --mount --propagation private --pid --fork --kill-child -- /bin/bash -euo pipefail -c '
    dir=$1 sysroot=$2 python_prefix=$3 project_git=$4
    shift 4
    ro_bind() { mount --bind "$1" "$2"; mount -o remount,bind,ro "$2"; }
    # The root a mount point of its own, as a real root is: what remounts / (buildah
    # unpacking a layer) needs one.
    mount --bind "$dir" "$dir"
    mount -t proc proc "$dir/proc"
    mount --rbind /sys "$dir/sys"
    mount --rbind /dev "$dir/dev"
    mount -t tmpfs -o mode=1777,nosuid,nodev shm "$dir/dev/shm"
    mount -t tmpfs -o mode=0755,nosuid,nodev run "$dir/run"
    mkdir -p "$dir/run/netns" "$dir/run/lock"
    ro_bind "$sysroot" "$dir$sysroot"
    [ -d "$dir$python_prefix" ] && [ "$python_prefix" != /usr ] && [ "$python_prefix" != /usr/local ] &&
        ro_bind "$python_prefix" "$dir$python_prefix"
    ro_bind "$project_git" "$dir/project.git"
    exec chroot "$dir" /usr/bin/env -i "$@" /bin/bash /fresh-check-inner.sh
' _ "$dir" "$sysroot" "$python_prefix" "$root/.git" \
    HOME=/root USER=root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH="$sysroot/bin:/opt/machine-python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    CARGO_HOME=/root/.cargo COMMIT="$commit" QUICK="$quick" "${passed_env[@]}" &
runner=$!
wait "$runner"
rc=$?
runner=""
set -e
log "the README's commands $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - started)) s, on a fresh root file system, commit $commit$([ -n "$quick" ] && echo ", --quick")"
exit "$rc"
