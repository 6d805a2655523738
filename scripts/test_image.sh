#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build ddtree-sglang:sm120 and smoke-test it in containers, on a machine without a GPU.
#
# Usage: scripts/test_image.sh [options]
#   --tag TAG          image to build (default ddtree-sglang:sm120-test)
#   --base IMAGE       base image (default: ddtree-base:bookworm, made by
#                      scripts/make_base_image.sh when missing: no registry needed)
#   --worktree         build from the working tree (tracked + untracked files) instead of
#                      the committed HEAD
#   --wheel-cache DIR  local wheelhouse served to the build on 127.0.0.1, filled by
#                      scripts/build_wheelhouse.sh on first use
#                      (default ~/.cache/ddtree/wheelhouse-<python>-<arch>)
#   --no-wheel-cache   let the build download from PyPI itself
#   --skip-build       only run the smoke tests against an existing TAG
#   --rm-image         remove the image and the build cache afterwards (CI)
#   --setup-docker     install docker.io and debootstrap with apt when missing, and start a
#                      Docker daemon (overlay2) for this run when none answers (CI)
#
# Smoke tests: sglang imports patched and the stamp matches the series; `--help` shows ours
# and upstream's flags; `doctor` reports the missing GPU cleanly; the server refuses to start
# without a GPU with a clear message; every FlashInfer module and sglang JIT kernel the server
# builds on sm_12x and every Triton kernel of the series compile in the image
# (docker/compile_kernels.py, 20-40 min on 2 cores); the image metadata (healthcheck, port,
# labels). Prints build time and image size.
# Needs: a running Docker daemon with BuildKit (docker buildx, or a 20.10 client).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

TAG=ddtree-sglang:sm120-test BASE="" WORKTREE=0 CACHE="" USE_CACHE=1 SKIP_BUILD=0 RM_IMAGE=0 SETUP=0
usage() { sed -n '3,26p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG=$2; shift 2 ;;
        --base) BASE=$2; shift 2 ;;
        --worktree) WORKTREE=1; shift ;;
        --wheel-cache) CACHE=$2; shift 2 ;;
        --no-wheel-cache) USE_CACHE=0; shift ;;
        --skip-build) SKIP_BUILD=1; shift ;;
        --rm-image) RM_IMAGE=1; shift ;;
        --setup-docker) SETUP=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "test_image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
NICE=(nice -n 15 ionice -c3)
log() { echo "== $*"; }
die() { echo "test_image.sh: $*" >&2; exit 1; }

# ---------------------------------------------------------------- docker with BuildKit
DOCKER=${DOCKER:-docker}
DOCKERD_PID=""
if [ "$SETUP" = 1 ]; then
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
        log "installing docker.io and debootstrap"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            docker.io debootstrap >/dev/null
    fi
    command -v "$DOCKER" >/dev/null || DOCKER=/usr/bin/docker
    if ! "$DOCKER" info >/dev/null 2>&1; then
        log "starting dockerd (overlay2)"
        "${NICE[@]}" dockerd --storage-driver=overlay2 >/var/tmp/ddtree-dockerd.log 2>&1 &
        DOCKERD_PID=$!
        for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
    fi
fi
"$DOCKER" info >/dev/null 2>&1 || die "no Docker daemon answers (start dockerd, or pass --setup-docker; see docs/docker.md)"
if "$DOCKER" buildx version >/dev/null 2>&1; then
    BUILD=("$DOCKER" buildx build --load)
else
    # Without buildx, a 20.10 client drives the daemon's built-in BuildKit.
    BK_DOCKER=""
    for c in "$DOCKER" /usr/bin/docker; do
        v=$("$c" version -f '{{.Client.Version}}' 2>/dev/null || true)
        if [ -n "$v" ] && [ "${v%%.*}" -lt 23 ]; then BK_DOCKER=$c; break; fi
    done
    [ -n "$BK_DOCKER" ] || die "BuildKit is needed: install docker-buildx (or Debian's docker.io client)"
    BUILD=(env DOCKER_BUILDKIT=1 "$BK_DOCKER" build --progress=plain)
fi

WORK=$(mktemp -d /var/tmp/ddtree-image-test.XXXXXX)
SERVER_PID=""
cleanup() {
    [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
    [ -z "$DOCKERD_PID" ] || { kill "$DOCKERD_PID" 2>/dev/null; wait "$DOCKERD_PID" 2>/dev/null || true; }
    rm -rf "$WORK"
}
trap cleanup EXIT

# ---------------------------------------------------------------- build
BUILD_S=""
if [ "$SKIP_BUILD" = 0 ]; then
    CTX="$WORK/context"
    mkdir -p "$CTX"
    if [ "$WORKTREE" = 1 ]; then
        log "context: working tree of $REPO"
        (cd "$REPO" && git ls-files -co --exclude-standard -z | tar --null -T - -c) | tar -x -C "$CTX"
        REF="$(git -C "$REPO" rev-parse --short HEAD)+worktree"
    else
        log "context: committed HEAD of $REPO"
        git -C "$REPO" archive HEAD | tar -x -C "$CTX"
        REF="$(git -C "$REPO" rev-parse --short HEAD)"
    fi
    DIGEST=$(python3 "$CTX/docker/wheelhouse.py" series-digest --repo "$CTX")
    log "series digest $DIGEST"

    if [ -z "$BASE" ]; then
        BASE=ddtree-base:bookworm
        DOCKER="$DOCKER" "${NICE[@]}" bash "$CTX/scripts/make_base_image.sh" --tag "$BASE"
    fi

    ARGS=(--build-arg "BASE_IMAGE=$BASE" --build-arg "SERIES_DIGEST=$DIGEST" --build-arg "VCS_REF=$REF")
    if [ "$USE_CACHE" = 1 ]; then
        # The wheels for the base image's python, fetched once on the host and reused.
        read -r PYV ARCH < <("$DOCKER" run --rm --entrypoint python3 "$BASE" -c \
            'import platform, sys; print("%d.%d" % sys.version_info[:2], platform.machine())')
        CACHE=${CACHE:-$HOME/.cache/ddtree/wheelhouse-cp${PYV/./}-$ARCH}
        HOSTV=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        if [ "$HOSTV" = "$PYV" ] && [ "$(uname -m)" = "$ARCH" ]; then TARGET=(); else
            TARGET=(--python-version "$PYV" --platform "$ARCH"); fi
        log "wheel cache $CACHE (python $PYV, $ARCH)"
        "${NICE[@]}" bash "$CTX/scripts/build_wheelhouse.sh" --out "$CACHE" ${TARGET[@]+"${TARGET[@]}"} \
            | sed 's/^/   /'
        # A fixed port keeps the build argument, and so the wheels stage's build cache, stable.
        PORT=$(python3 -c 'import socket, sys
for port in (int(sys.argv[1]), 0):
    try:
        s = socket.socket(); s.bind(("127.0.0.1", port)); print(s.getsockname()[1]); break
    except OSError:
        pass' "${DDTREE_WHEEL_PORT:-38017}")
        python3 -m http.server --bind 127.0.0.1 --directory "$CACHE" "$PORT" >"$WORK/http.log" 2>&1 &
        SERVER_PID=$!
        ARGS+=(--network host --build-arg "WHEELHOUSE_URL=http://127.0.0.1:$PORT/")
    fi

    log "docker build $TAG (base $BASE)"
    t0=$(date +%s)
    if ! "${NICE[@]}" "${BUILD[@]}" -f "$CTX/docker/Dockerfile" -t "$TAG" "${ARGS[@]}" "$CTX" >"$WORK/build.log" 2>&1; then
        tail -40 "$WORK/build.log" >&2
        die "docker build failed"
    fi
    BUILD_S=$(( $(date +%s) - t0 ))
    [ -z "$SERVER_PID" ] || { kill "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; }
    grep -E "^#[0-9]+ [0-9.]+ (series [0-9a-f]{12} \(|slimmed|nvcc: )" "$WORK/build.log" | sed 's/^#[0-9]* [0-9.]* /   /' || true
else
    # An existing image is checked against the series it says it was built from.
    DIGEST=$("$DOCKER" image inspect -f '{{index .Config.Labels "ddtree.series.digest"}}' "$TAG") \
        || die "no image $TAG to test"
fi

# ---------------------------------------------------------------- smoke tests
# One container for all checks: without copy-on-write storage (vfs) every container start
# copies the whole image. It is started through the image's ENTRYPOINT, which must hand
# `sleep` on to exec; the checks then run that same ENTRYPOINT command with docker exec.
PASS=0 FAIL=0
check() {  # check NAME EXPECTED_RC GREP_PATTERN -- docker exec args...
    local name=$1 want_rc=$2 pattern=$3; shift 4
    local out rc=0 why=""
    out=$("$DOCKER" exec "$@" 2>&1) || rc=$?
    [ "$rc" = "$want_rc" ] || why="exit status $rc, expected $want_rc"
    [ -n "$why" ] || grep -Eq -- "$pattern" <<<"$out" || why="output lacks /$pattern/"
    if [ -z "$why" ] && [ "$want_rc" != 0 ] && grep -q "^Traceback" <<<"$out"; then
        why="a traceback instead of a clean message"
    fi
    if [ -z "$why" ]; then
        PASS=$((PASS + 1)); echo "PASS  $name"
        grep -E -- "$pattern" <<<"$out" | tail -1 | cut -c1-160 | sed 's/^/      /'
    else
        FAIL=$((FAIL + 1)); echo "FAIL  $name: $why"; sed 's/^/      | /' <<<"$out" | tail -25
    fi
}

log "smoke tests on $TAG"
C=ddtree-smoke-$$
mapfile -t EP < <("$DOCKER" image inspect -f '{{range .Config.Entrypoint}}{{println .}}{{end}}' "$TAG" | sed '/^$/d')
"$DOCKER" run -d --name "$C" "$TAG" sleep infinity >/dev/null
trap '"$DOCKER" rm -f "$C" >/dev/null 2>&1 || true; cleanup' EXIT
if [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$C")" = true ]; then
    PASS=$((PASS + 1)); echo "PASS  the entrypoint execs other programs (sleep)"
else
    FAIL=$((FAIL + 1)); echo "FAIL  the entrypoint did not exec sleep"; "$DOCKER" logs "$C" 2>&1 | tail -20
fi

check "sglang imports patched; stamp matches the series" 0 "^stamp ok" -- \
    -e "EXPECT_DIGEST=$DIGEST" "$C" python -W ignore -c '
import importlib, importlib.util, json, os, pathlib, sglang
pkg = pathlib.Path(sglang.__file__).parent
stamp = json.loads((pkg / ".ddtree-series.json").read_text())
assert stamp["digest"] == os.environ["EXPECT_DIGEST"], (stamp["digest"], os.environ["EXPECT_DIGEST"])
build = json.loads(pathlib.Path("/opt/ddtree/build.json").read_text())
assert build["series_digest"] == stamp["digest"], build
mods = [o["path"][:-3].replace("/", ".").removesuffix(".__init__")
        for o in stamp["overlay"] if o["path"].endswith(".py")]
for m in mods:
    importlib.import_module(m)
from sglang.srt.server_args import ServerArgs
import sglang.launch_server
kernel = pathlib.Path(importlib.util.find_spec("sgl_kernel").origin).parent
assert not list(kernel.glob("flash_ops*")) and not (kernel / "sm90").exists(), "FA3/sm90 still there"
assert list((kernel / "sm100").glob("common_ops*")), "sm100 kernels missing"
digest, npatch = stamp["digest"][:12], len(stamp["patches"])
print(f"stamp ok: {digest}, {npatch} patches, {len(mods)} overlay modules import, "
      "sgl_kernel without FA3/sm90")'
check "--help shows our flags and env vars" 0 "DRAFT_MODEL_PATH" -- "$C" "${EP[@]}" --help
check "--help lists upstream flags" 0 "--speculative-draft-model-path" -- "$C" "${EP[@]}" --help
check "doctor reports no GPU cleanly (exit 2)" 2 "^NO GPU VISIBLE" -- "$C" "${EP[@]}" doctor
check "doctor --capability 12.0: sm_120 verdicts, stamp matches" 0 '"is_sm120": true' -- \
    "$C" "${EP[@]}" doctor --json --capability 12.0
check "server refuses to start without a GPU (exit 3)" 3 "no NVIDIA GPU is visible" -- \
    "$C" "${EP[@]}" --model-path /models/target --speculative-draft-model-path /models/draft
check "no model given is a usage error (exit 2)" 2 "no model given" -- "$C" "${EP[@]}"
check "env vars become flags; bad values are refused (exit 2)" 2 "TP_SIZE='two' is not a positive integer" -- \
    -e MODEL_PATH=/m -e TP_SIZE=two "$C" "${EP[@]}"
# Every FlashInfer module and sglang JIT kernel the server builds on sm_12x (docker/jit_modules.json)
# and every Triton kernel configuration of the series, compiled with the image's own toolchain.
check "the server's JIT kernels and the series' Triton kernels compile for sm_12x" 0 "^[0-9]+ passed, 0 failed" -- \
    "$C" python /opt/ddtree/compile_kernels.py --json /tmp/compile_kernels.json
"$DOCKER" exec "$C" python -c 'import json
for r in json.load(open("/tmp/compile_kernels.json")):
    print("      %-10s %-5s %7.1f s  %s" % (r["kind"], r["arch"], r["seconds"], r["name"][:100]))' 2>/dev/null || true
"$DOCKER" rm -f "$C" >/dev/null

meta_out=$("$DOCKER" image inspect -f \
    '{{json .Config.Healthcheck.Test}} {{json .Config.ExposedPorts}} {{index .Config.Labels "ddtree.series.digest"}} {{index .Config.Labels "ddtree.upstream.version"}}' "$TAG")
if grep -q healthcheck <<<"$meta_out" && grep -q '30000/tcp' <<<"$meta_out" \
    && grep -q "$DIGEST" <<<"$meta_out" && grep -q "0.5.17" <<<"$meta_out"; then
    PASS=$((PASS + 1)); echo "PASS  image metadata: healthcheck, port 30000, labels"
else
    FAIL=$((FAIL + 1)); echo "FAIL  image metadata: $meta_out"
fi

SIZE=$("$DOCKER" image inspect -f '{{.Size}}' "$TAG")
log "image $TAG: $(awk -v s="$SIZE" 'BEGIN { printf "%.2f GB (%.0f bytes)", s / 1e9, s }')${BUILD_S:+, built in ${BUILD_S} s}"
if [ "$RM_IMAGE" = 1 ]; then
    "$DOCKER" rmi "$TAG" >/dev/null
    "$DOCKER" builder prune -af >/dev/null 2>&1 || true
fi
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
