#!/usr/bin/env bash
# shellcheck disable=SC2016  # bash -c '...' _ "$x": expanded by that shell, on purpose
# Checks the ray-xds image: builds it (scripts/build-image.sh) or takes one, reads what is
# in it, and runs it as Kubernetes would (deploy/ray-xds.yaml).
#
#   bash scripts/check-image.sh [--image NAME] [--build-only] [build-image.sh arguments...]
#     --image NAME   check this image (in this machine's containers storage) instead of
#                    building one
#     --build-only   install what the check needs and build the image, then stop (what
#                    `scripts/test.sh --build-only` runs)
#
# What it checks:
# - the config: user 65532:65532, ENTRYPOINT ["/ray-xds"], CMD serve --config
#   /etc/ray-xds/ray-xds.yaml, ports 18000 and 19000, linux/amd64, one layer;
# - the files: exactly /ray-xds, /etc/passwd, /etc/group (user and group 65532) and the
#   libraries the image's own dynamic loader resolves for /ray-xds, with their folders;
#   all root's, none writable by others, no setuid; so no /bin/sh; the binary is the one
#   just built;
# - a run, with the image's own USER, entrypoint and CMD: a read-only root file system,
#   no capabilities, no new privileges, host network (loopback only: ray-xds listens on
#   127.0.0.1, on free ports), a config folder mounted read-only at /etc/ray-xds with the
#   file source and a tiny services.yaml. /healthz and /readyz must answer 200, the xDS
#   port accept; the process runs as 65532 (real, effective, saved; groups) with no
#   capabilities; a write to / and to /etc/ray-xds fails with EROFS, as 65532 and even as
#   root; SIGTERM stops it with status 0 within 10 s.
#
# The runner: `podman run` with runc. On this kind of machine crun cannot start a
# container (the cgroup hierarchy is hybrid v1/v2: "crun: cgroups in hybrid mode not
# supported, drop all controllers from cgroupv2", with or without --cgroups disabled),
# and podman's default limits cannot be set ("setrlimit `RLIMIT_NOFILE`: Operation not
# permitted": no CAP_SYS_RESOURCE here), so the limits are given within the ones this
# shell has. Where podman cannot run a container at all, the same run happens without
# it: the image mounted (podman image mount) under a read-only overlay, in new mount and
# PID namespaces, through chroot --userspec=65532:65532 and setpriv --no-new-privs
# (RAY_XDS_CHECK_RUNNER=podman|chroot forces one). Every process it starts goes with it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/build-image.sh
source "$here/build-image.sh"
log() { echo "check-image: $*" >&2; }
trap run_cleanup EXIT
trap 'exit 130' INT TERM

failures=0
ok() { echo "  ok   $*"; }
bad() {
    echo "  FAIL $*"
    failures=$((failures + 1))
}
check() { # check DESCRIPTION COMMAND...: ok when the command succeeds
    local what=$1
    shift
    if "$@"; then ok "$what"; else bad "$what"; fi
}

image=""
build_only=""
build_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --image) image=$2; shift 2 ;;
        --build-only) build_only=1; shift ;;
        -h | --help) sed -n '3,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) build_args+=("$1"); shift ;;
    esac
done

need_packages scripts/check-image.sh \
    "podman /usr/bin/podman runs the image as Kubernetes would" \
    "runc /usr/sbin/runc is podman's OCI runtime here (crun cannot run on hybrid cgroups)" \
    "curl /usr/bin/curl asks the running image's /healthz and /readyz" \
    "util-linux /usr/bin/setpriv drops privileges in the runner without podman" \
    "procps /usr/bin/pgrep finds the image's process in the runner without podman"
started=$SECONDS
choose_storage
binary=""
if [ -z "$image" ]; then
    image=$(build_image "${build_args[@]}")
    binary="$image_root/target/release/ray-xds"
    for ((i = 0; i < ${#build_args[@]}; i++)); do
        [ "${build_args[i]}" = --binary ] && binary=${build_args[i + 1]}
    done
    log "built $image in $((SECONDS - started)) s"
fi
package_versions podman runc buildah curl | sed 's/^/check-image: debian /' >&2
pm() { podman "${STORAGE[@]}" "$@"; }
pm image exists "$image" || die "no image $image"
[ -z "$build_only" ] || exit 0

echo "== $image: config"
config=$(pm image inspect "$image" --format '{{json .}}')
python3 - "$config" <<'EOF' || failures=$((failures + 1))
import json, sys
img = json.loads(sys.argv[1])
img = img[0] if isinstance(img, list) else img
c = img["Config"]
want = {
    "User": "65532:65532",
    "Entrypoint": ["/ray-xds"],
    "Cmd": ["serve", "--config", "/etc/ray-xds/ray-xds.yaml"],
    "ExposedPorts": ["18000/tcp", "19000/tcp"],
}
got = {
    "User": c.get("User"),
    "Entrypoint": c.get("Entrypoint"),
    "Cmd": c.get("Cmd"),
    # podman shows "18000/tcp" (docker format) or "18000" (OCI): the same port.
    "ExposedPorts": sorted(p if "/" in p else p + "/tcp" for p in (c.get("ExposedPorts") or {})),
}
failed = False
for k, v in want.items():
    good = got[k] == v
    failed |= not good
    print(f"  {'ok  ' if good else 'FAIL'} {k}: {got[k]!r}" + ("" if good else f", want {v!r}"))
for k, v in [("Os", "linux"), ("Architecture", "amd64")]:
    good = img.get(k) == v
    failed |= not good
    print(f"  {'ok  ' if good else 'FAIL'} {k}: {img.get(k)!r}")
layers = img["RootFS"]["Layers"]
good = len(layers) == 1
failed |= not good
print(f"  {'ok  ' if good else 'FAIL'} one layer: {len(layers)}")
sys.exit(1 if failed else 0)
EOF

echo "== $image: files"
mnt=$(pm image mount "$image")
cleanup_add "podman ${STORAGE[*]} image unmount '$image'"
# What the image's own loader resolves for its binary, inside the image: a library it
# lacks shows as "not found".
linked=$(chroot "$mnt" /lib64/ld-linux-x86-64.so.2 --list /ray-xds 2>&1) || true
if grep -q 'not found' <<<"$linked" || ! grep -q 'libc.so' <<<"$linked"; then
    bad "the image's loader resolves /ray-xds: $linked"
else
    ok "the image's loader resolves every library of /ray-xds"
fi
expected=$(
    {
        printf '%s\n' /ray-xds /etc/passwd /etc/group
        awk '$2 == "=>" && $3 ~ /^\// { print $3; next } $1 ~ /^\// { print $1 }' <<<"$linked"
    } | while read -r f; do
        echo "$f"
        d=$(dirname "$f")
        while [ "$d" != / ]; do echo "$d"; d=$(dirname "$d"); done
    done | sort -u
)
actual=$(cd "$mnt" && find . -mindepth 1 | sed 's|^\.||' | sort)
if [ "$expected" = "$actual" ]; then
    ok "exactly the binary, its libraries, passwd and group: $(tr '\n' ' ' <<<"$actual")"
else
    bad "files differ from the expected ones (< expected, > in the image):"
    diff <(echo "$expected") <(echo "$actual") | sed 's/^/         /' || true
fi
check "no /bin/sh, no shell anywhere" \
    test -z "$(cd "$mnt" && find . -name sh -o -name bash -o -name busybox -o -name dash)"
check "every file root's, none writable by group or others, no setuid/setgid" \
    test -z "$(find "$mnt" -mindepth 1 \( ! -user 0 -o ! -group 0 -o -perm /022 -o -perm /6000 \))"
check "/etc/passwd has user 65532 with no shell, /etc/group group 65532" \
    bash -c 'grep -qx "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin" "$1/etc/passwd" &&
             grep -qx "nonroot:x:65532:" "$1/etc/group" && ! grep -q "/bin/.*sh$" "$1/etc/passwd"' _ "$mnt"
if [ -n "$binary" ]; then
    check "/ray-xds is $binary" cmp -s "$binary" "$mnt/ray-xds"
fi

echo "== $image: a run"
work=$(mktemp -d)
cleanup_add "rm -rf '$work'"
ports=$(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))')
read -r xds_port admin_port proxy_port <<<"$ports"
cfg="$work/etc-ray-xds"
mkdir -m 0755 "$cfg"
cat >"$cfg/ray-xds.yaml" <<EOF
xds: { listen: 127.0.0.1:$xds_port }
admin: { listen: 127.0.0.1:$admin_port }
source: { file: { path: services.yaml } }
EOF
# One RayService, one proxy where nothing listens: enough for a first snapshot (/readyz).
cat >"$cfg/services.yaml" <<EOF
rayservices:
  - name: check
    active_cluster: check-a
    clusters:
      - name: check-a
        proxies: [ { address: 127.0.0.1:$proxy_port, node_type: head } ]
EOF
chmod 0644 "$cfg"/*

runner=${RAY_XDS_CHECK_RUNNER:-}
name="ray-xds-check-$$"
pid=""
# The limits podman sets must fit within this shell's hard limits (see above); 4096
# threads is far above what ray-xds starts.
limits=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)
start_podman() {
    cleanup_add "podman ${STORAGE[*]} rm -f -t 0 '$name'"
    pm run -d --name "$name" --runtime runc "${limits[@]}" \
        --network host --read-only --read-only-tmpfs=false \
        --cap-drop all --security-opt no-new-privileges \
        -v "$cfg:/etc/ray-xds:ro" "$image" >/dev/null 2>"$work/podman.err" || return 1
    # 0 when it has exited already: the checks below fail and show its log.
    pid=$(pm inspect --format '{{.State.Pid}}' "$name" 2>/dev/null || true)
    [ "$pid" != 0 ] || pid=""
}
# The image's USER, the number of its Env entries, the entries, then ENTRYPOINT + CMD,
# NUL-separated: the process the run without podman starts.
image_process() {
    python3 - "$config" <<'EOF'
import json, sys
img = json.loads(sys.argv[1])
c = (img[0] if isinstance(img, list) else img)["Config"]
env = c.get("Env") or []
out = [c.get("User") or "0:0", str(len(env))] + env
out += (c.get("Entrypoint") or []) + (c.get("Cmd") or [])
sys.stdout.write("\0".join(out) + "\0")
EOF
}
start_chroot() {
    local base="$work/chroot" process user
    mkdir "$base"
    readarray -d '' process < <(image_process)
    user=${process[0]}
    [[ "$user" == *:* ]] || user="$user:$user"
    # In new mount and PID namespaces (everything mounted here vanishes with them):
    # the image under an overlay whose only change is the mount points, then remounted
    # read-only; the config bound read-only; chroot switches to the image's user (for a
    # non-root user that clears every capability at the exec) under no_new_privs.
    unshare --mount --pid --fork --kill-child --propagation private -- bash -c '
        set -e
        base=$1 mnt=$2 cfg=$3 user=$4 envs=$5
        shift 5
        env=("${@:1:envs}")
        shift "$envs"
        mount -t tmpfs tmpfs "$base"
        mkdir "$base/upper" "$base/work" "$base/root"
        mount -t overlay overlay -o "lowerdir=$mnt,upperdir=$base/upper,workdir=$base/work" "$base/root"
        r=$base/root
        mkdir -p "$r/proc" "$r/dev" "$r/etc/ray-xds"
        mount -t proc proc "$r/proc"
        for d in null zero random urandom; do touch "$r/dev/$d"; mount --bind "/dev/$d" "$r/dev/$d"; done
        mount --bind "$cfg" "$r/etc/ray-xds"
        mount -o remount,bind,ro "$r/etc/ray-xds"
        mount -o remount,ro "$r"
        exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "${env[@]}" \
            setpriv --no-new-privs -- \
            chroot --userspec="$user" --groups="${user#*:}" "$r" "$@"
    ' _ "$base" "$mnt" "$cfg" "$user" "${process[@]:1}" >"$work/chroot.log" 2>&1 &
    local unshare_pid=$!
    cleanup_add "kill -KILL $unshare_pid"
    echo "$unshare_pid" >"$work/unshare.pid"
    # unshare's child execs its way (env, setpriv, chroot) into the entrypoint.
    local i comm
    for ((i = 0; i < 100; i++)); do
        pid=$(pgrep -P "$unshare_pid" 2>/dev/null | head -n1 || true)
        comm=$(cat "/proc/${pid:-0}/comm" 2>/dev/null || true)
        case "$comm" in
            "" | bash | env | setpriv | chroot) ;;
            *) return 0 ;;
        esac
        kill -0 "$unshare_pid" 2>/dev/null || break
        sleep 0.1
    done
    pid=""
}
container_log() {
    case "$runner" in
        podman) pm logs "$name" 2>&1 ;;
        chroot) cat "$work/chroot.log" ;;
    esac
}

# The fallback is for a podman that cannot start containers here, not for an image that
# fails: once `podman run` has started it, what happens to it is the image's doing.
case "$runner" in
    "" | podman)
        if start_podman; then
            runner=podman
        elif [ -z "$runner" ]; then
            log "podman run could not start a container: $(cat "$work/podman.err")"
            log "running the image without podman (unshare + chroot) instead"
            runner=chroot
            start_chroot
        else
            die "podman run: $(cat "$work/podman.err")"
        fi
        ;;
    chroot) start_chroot ;;
    *) die "RAY_XDS_CHECK_RUNNER: podman or chroot, not $runner" ;;
esac
echo "  runner: $runner (pid ${pid:-none: it exited} on the host)"

# Answers within 30 s, or the log says why not.
wait_for() { # wait_for PATH: 200 from the admin port
    local deadline=$((SECONDS + 30)) code
    while [ $SECONDS -lt $deadline ]; do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$admin_port$1" || true)
        [ "$code" = 200 ] && return 0
        # Gone: no point waiting.
        if [ -z "$pid" ] || [ ! -d "/proc/$pid" ]; then break; fi
        sleep 0.2
    done
    echo "    GET $1: $code; the log:" >&2
    container_log | tail -n 20 | sed 's/^/    /' >&2
    return 1
}
check "GET /healthz answers 200" wait_for /healthz
check "GET /readyz answers 200 (file source loaded, first snapshot built)" wait_for /readyz
check "the xDS port accepts connections" timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$xds_port"
status=$(cat "/proc/${pid:-0}/status" 2>/dev/null || true)
check "uid 65532 (real, effective, saved, fs)" grep -qP '^Uid:\t65532\t65532\t65532\t65532$' <<<"$status"
check "gid 65532, supplementary groups none but 65532" \
    bash -c 'grep -qP "^Gid:\t65532\t65532\t65532\t65532$" <<<"$1" && grep -qP "^Groups:\t(65532 ?)?$" <<<"$1"' _ "$status"
check "no capabilities (effective, permitted)" \
    bash -c 'grep -q "^CapEff:\s*0*$" <<<"$1" && grep -q "^CapPrm:\s*0*$" <<<"$1"' _ "$status"
check "no new privileges" grep -qP '^NoNewPrivs:\t1$' <<<"$status"
# Writes through the process's own root (its mount namespace): EROFS, not EACCES.
write_fails() { # write_fails AS PATH
    local out
    if [ "$1" = root ]; then
        out=$(touch "/proc/$pid/root$2" 2>&1) && return 1
    else
        out=$(setpriv --reuid 65532 --regid 65532 --clear-groups -- touch "/proc/$pid/root$2" 2>&1) && return 1
    fi
    grep -q 'Read-only file system' <<<"$out" || {
        echo "    $out" >&2
        return 1
    }
}
check "a write to / fails (Read-only file system), as 65532" write_fails 65532 /write-test
check "a write to / fails (Read-only file system), even as root" write_fails root /write-test
check "a write to /etc/ray-xds fails (Read-only file system)" write_fails root /etc/ray-xds/write-test
check "the log says it started" bash -c 'grep -q "ray-xds started" <<<"$1"' _ "$(container_log)"

if [ "$runner" = podman ]; then
    no_shell_runs() {
        local out
        out=$(pm run --rm --runtime runc "${limits[@]}" --network none \
            --entrypoint /bin/sh "$image" -c true 2>&1) && return 1
        grep -qi 'no such file\|not found' <<<"$out" || {
            echo "    $out" >&2
            return 1
        }
    }
    check "no shell to run: podman run --entrypoint /bin/sh fails (not found)" no_shell_runs
    stop_started=$SECONDS
    pm stop -t 10 "$name" >/dev/null
    code=$(pm inspect --format '{{.State.ExitCode}}' "$name")
    check "SIGTERM: exit status 0 in $((SECONDS - stop_started)) s (got $code)" test "$code" = 0
else
    stop_started=$SECONDS
    [ -z "$pid" ] || kill -TERM "$pid"
    unshare_pid=$(cat "$work/unshare.pid")
    code=0
    timeout 10 tail --pid="$unshare_pid" -f /dev/null || code=timeout
    [ "$code" = timeout ] || { wait "$unshare_pid" || code=$?; }
    check "SIGTERM: exit status 0 in $((SECONDS - stop_started)) s (got $code)" test "$code" = 0
fi

echo "check-image: $image, runner $runner: $failures failed, $((SECONDS - started)) s in all"
[ "$failures" -eq 0 ]
