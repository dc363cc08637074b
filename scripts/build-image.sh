#!/usr/bin/env bash
# Builds the ray-xds container image without a Docker daemon and without pulling anything:
# the release binary (cargo build --release --locked --bin ray-xds), then an OCI image
# FROM scratch, one layer, holding exactly
#   /ray-xds                           the binary
#   the shared libraries it links      as `ldd` lists them, the dynamic loader included,
#                                      each at the path the binary asks for
#   /etc/passwd, /etc/group            root and nonroot (65532), no login shell
# and nothing else: no shell, no package manager, no CA bundle (in a cluster ray-xds
# trusts the service account's ca.crt; it needs no system roots).
#   ENTRYPOINT ["/ray-xds"]  CMD ["serve", "--config", "/etc/ray-xds/ray-xds.yaml"]
#   USER 65532:65532         EXPOSE 18000 19000
# The libraries are the build machine's (Debian 12: glibc 2.36, libgcc), the ones the
# binary was linked against. The Dockerfile builds the same on a machine that can pull
# base images (distroless/cc); deploy/ runs either.
#
#   bash scripts/build-image.sh [--tag NAME] [--binary PATH] [--archive FILE]
#     --tag NAME      image name (default localhost/ray-xds:<version in Cargo.toml>)
#     --binary PATH   put this binary in instead of building one
#     --archive FILE  also write the image as an OCI archive, for a registry:
#                       skopeo copy oci-archive:FILE docker://registry.example.com/ray-xds:0.1.0
#                     (or `podman push NAME docker://...` from this machine's storage)
# Prints the image name on stdout. Installs buildah (Debian) when it is missing (a fresh
# machine, CI), so it needs root there. Storage: containers/storage's overlay driver
# in its default place; where overlay cannot mount, vfs in /var/lib/containers/storage-vfs
# (RAY_XDS_IMAGE_STORAGE_DRIVER=overlay|vfs forces one). scripts/check-image.sh checks
# and runs the result.
#
# Sourced (by check-image.sh), it only defines its functions.
set -euo pipefail
# A failure inside $(...) (check-image.sh runs `image=$(build_image ...)`) fails the script.
shopt -s inherit_errexit

image_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { echo "build-image: $*" >&2; }

# What to undo when the script ends, however it ends (last added, first run). A script
# that sources this one runs run_cleanup from its own EXIT trap.
CLEANUP=()
cleanup_add() { CLEANUP=("$1" "${CLEANUP[@]}"); }
run_cleanup() {
    local c
    for c in "${CLEANUP[@]}"; do eval "$c" >/dev/null 2>&1 || true; done
    CLEANUP=()
}
die() {
    log "$*"
    exit 1
}

# shellcheck source=scripts/lib/debian-packages.sh
source "$image_root/scripts/lib/debian-packages.sh"

# Sets STORAGE (global flags for buildah and podman): overlay where an overlay mount
# works on the storage's file system, else vfs (slower, copies every layer) in a folder
# of its own, since one storage folder holds one driver's layers.
choose_storage() {
    [ -z "${STORAGE_CHOSEN:-}" ] || return 0
    STORAGE_CHOSEN=1
    local driver=${RAY_XDS_IMAGE_STORAGE_DRIVER:-}
    if [ -z "$driver" ]; then
        driver=vfs
        if grep -qw overlay /proc/filesystems 2>/dev/null; then
            mkdir -p /var/lib/containers
            local t
            t=$(mktemp -d /var/lib/containers/.overlay-probe.XXXXXX)
            mkdir "$t/lower" "$t/upper" "$t/work" "$t/merged"
            if mount -t overlay overlay \
                -o "lowerdir=$t/lower,upperdir=$t/upper,workdir=$t/work" "$t/merged" 2>/dev/null; then
                umount "$t/merged"
                driver=overlay
            fi
            rm -rf "$t"
        fi
    fi
    case "$driver" in
        # The default store (podman's own database there records that it was opened
        # without a --storage-driver, and refuses one given later).
        overlay) STORAGE=() ;;
        vfs) STORAGE=(--storage-driver vfs --root /var/lib/containers/storage-vfs) ;;
        *) die "RAY_XDS_IMAGE_STORAGE_DRIVER: overlay or vfs, not $driver" ;;
    esac
    log "image storage: $driver"
}

# The version in Cargo.toml's [package].
crate_version() {
    sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$image_root/Cargo.toml" | head -n1
}

# The files a dynamically linked binary needs: every path `ldd` prints (libraries and
# the dynamic loader; the vDSO has none). Fails on a library it cannot find.
linked_files() {
    local out
    out=$(ldd "$1" 2>&1) || {
        # A static binary: ldd says so and fails; it needs nothing.
        if grep -q 'not a dynamic executable\|statically linked' <<<"$out"; then return 0; fi
        die "ldd $1: $out"
    }
    if grep -q 'not found' <<<"$out"; then die "ldd $1: $out"; fi
    awk '$2 == "=>" && $3 ~ /^\// { print $3; next } $1 ~ /^\// { print $1 }' <<<"$out"
}

# Lays out the image's file system in $1 from the binary $2, every file owned by root,
# every time stamp $3 (seconds), so that the same binary gives the same layer.
stage_rootfs() {
    local dir=$1 binary=$2 epoch=$3 lib
    install -d -m 0755 "$dir/etc"
    install -m 0755 "$binary" "$dir/ray-xds"
    while read -r lib; do
        [ -n "$lib" ] || continue
        install -d -m 0755 "$dir$(dirname "$lib")"
        # The file itself, not a symlink (/lib64/ld-linux-x86-64.so.2 is one on Debian):
        # the image has none of the folders such a link points into.
        local real
        real=$(readlink -f "$lib")
        install -m "$(stat -c %a "$real")" "$real" "$dir$lib"
    done < <(linked_files "$binary")
    cat >"$dir/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOF
    cat >"$dir/etc/group" <<'EOF'
root:x:0:
nonroot:x:65532:
EOF
    chmod 0644 "$dir/etc/passwd" "$dir/etc/group"
    chown -R 0:0 "$dir"
    find "$dir" -exec touch -h -d "@$epoch" {} +
}

# Builds the image; prints its name. Arguments as the script's.
build_image() {
    local tag="" binary="" archive=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --tag) tag=$2; shift 2 ;;
            --binary) binary=$2; shift 2 ;;
            --archive) archive=$2; shift 2 ;;
            -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
            *) die "unknown argument $1 (see --help)" ;;
        esac
    done
    # In `$(build_image)` (check-image.sh), the caller's EXIT trap does not see what this
    # adds to clean up: the subshell cleans up after itself, however it ends.
    if [ "$BASH_SUBSHELL" -gt 0 ]; then trap run_cleanup EXIT; fi
    local version
    version=$(crate_version)
    [ -n "$version" ] || die "no version in Cargo.toml"
    tag=${tag:-localhost/ray-xds:$version}

    need_packages scripts/build-image.sh \
        "buildah /usr/bin/buildah builds the image from scratch, with no daemon and no pull" \
        "libc-bin /usr/bin/ldd lists the shared libraries the binary links, which the image carries"
    if [ -z "$binary" ]; then
        log "cargo build --release --locked --bin ray-xds"
        (cd "$image_root" && cargo build --release --locked --bin ray-xds >&2)
        binary="$image_root/target/release/ray-xds"
    fi
    [ -x "$binary" ] || die "$binary: not an executable"

    # Time stamps (files and the image's `created`) from the last commit: the same
    # binary on the same commit gives the same image ID.
    local epoch revision
    epoch=${SOURCE_DATE_EPOCH:-$(git -C "$image_root" log -1 --format=%ct 2>/dev/null || echo 0)}
    revision=$(git -C "$image_root" rev-parse HEAD 2>/dev/null || echo unknown)

    local staging
    staging=$(mktemp -d)
    cleanup_add "rm -rf '$staging'"
    stage_rootfs "$staging/rootfs" "$binary" "$epoch"

    choose_storage
    local ctr
    ctr=$(buildah "${STORAGE[@]}" from --quiet scratch)
    cleanup_add "buildah ${STORAGE[*]} rm '$ctr'"
    buildah "${STORAGE[@]}" copy --quiet --chown 0:0 "$ctr" "$staging/rootfs/" / >/dev/null
    buildah "${STORAGE[@]}" config \
        --entrypoint '["/ray-xds"]' \
        --cmd '["serve", "--config", "/etc/ray-xds/ray-xds.yaml"]' \
        --user 65532:65532 \
        --port 18000 --port 19000 \
        --workingdir / \
        --env RAY_XDS_LOG=info \
        --os linux --arch amd64 \
        --label org.opencontainers.image.title=ray-xds \
        --label org.opencontainers.image.description="xDS control plane for Envoy in front of Ray Serve" \
        --label "org.opencontainers.image.version=$version" \
        --label "org.opencontainers.image.revision=$revision" \
        --created-by "scripts/build-image.sh" \
        "$ctr"
    local previous
    previous=$(buildah "${STORAGE[@]}" images --noheading --no-trunc --format '{{.ID}}' "$tag" 2>/dev/null || true)
    buildah "${STORAGE[@]}" commit --quiet --format oci --squash --identity-label=false \
        --timestamp "$epoch" "$ctr" "$tag" >/dev/null
    # The image this tag named before, now nameless (a rebuild): not kept.
    if [ -n "$previous" ] && [ "$previous" != "$(buildah "${STORAGE[@]}" images --noheading --no-trunc --format '{{.ID}}' "$tag")" ] &&
        [ -z "$(buildah "${STORAGE[@]}" images --noheading --format '{{.Name}}' --filter "id=$previous" | grep -v '<none>' || true)" ]; then
        buildah "${STORAGE[@]}" rmi "$previous" >/dev/null 2>&1 || true
    fi
    if [ -n "$archive" ]; then
        rm -f "$archive"
        buildah "${STORAGE[@]}" push --quiet "$tag" "oci-archive:$archive:$tag" >/dev/null
        log "wrote $archive"
    fi
    log "built $tag ($(buildah "${STORAGE[@]}" images --noheading --format '{{.ID}} {{.Size}}' "$tag"))"
    # The staging folder and the working container, done with.
    run_cleanup
    echo "$tag"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    trap run_cleanup EXIT
    trap 'exit 130' INT TERM
    build_image "$@"
fi
