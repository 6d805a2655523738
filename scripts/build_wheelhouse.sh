#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build an offline, hash-pinned wheelhouse of the ddtree-sglang stack: the pinned sglang wheel
# (sha256-checked against upstream.lock) and every dependency it resolves to, pinned to the
# versions in constraints/dev.txt, plus requirements.txt with a --hash for every wheel.
#
# Usage: scripts/build_wheelhouse.sh --out DIR [options] [-- extra pip arguments]
#   --out DIR              where the wheels and requirements.txt go (created)
#   --python PY            interpreter that runs pip and, without the two options below,
#                          defines the target (default: python3)
#   --python-version X.Y   target another Python (cross download: binary wheels only)
#   --platform ARCH        target x86_64 or aarch64 (cross download), e.g. aarch64 for GB10
#   --glibc X.Y            oldest glibc the target host has, for cross downloads (default 2.34)
#   --gpu-arch LIST        leave out kernel libraries no GPU in LIST can load, e.g. 12.0,12.1
#                          (default: keep everything)
#   --constraints FILE     version pins (default: constraints/dev.txt; 'none' to resolve fresh)
#   -- ARGS                passed to pip, e.g. -- --no-index --find-links http://127.0.0.1:8000/
#
# Install on the air-gapped host:
#   python3 -m venv venv && venv/bin/pip install --no-index --find-links DIR \
#       --require-hashes -r DIR/requirements.txt
#   scripts/apply_patches.sh --python venv/bin/python
#
# pip here ignores pip config files and PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL / PIP_CONSTRAINT,
# so a machine's local mirrors cannot change what lands in the wheelhouse; PIP_INDEX_URL and
# PIP_CERT are honoured.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

WH_DIR="" PY=python3 PYVER="" PLAT="" GLIBC=2.34 GPU_ARCH="" CONSTRAINTS="$REPO/constraints/dev.txt"
PIP_EXTRA=()
usage() { sed -n '3,26p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "build_wheelhouse.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --out) WH_DIR=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --python-version) PYVER=$2; shift 2 ;;
        --platform) PLAT=$2; shift 2 ;;
        --glibc) GLIBC=$2; shift 2 ;;
        --gpu-arch) GPU_ARCH=$2; shift 2 ;;
        --constraints) CONSTRAINTS=$2; shift 2 ;;
        --) shift; PIP_EXTRA=("$@"); break ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[ -n "$WH_DIR" ] || die "--out DIR is required (see --help)"
command -v "$PY" >/dev/null || die "python '$PY' not found"

pip_() {
    env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_REQUIRE_VIRTUALENV \
        PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$PY" -m pip "$@" ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"}
}

VERSION=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["upstream"]["version"])' \
    "$REPO/upstream.lock") || die "cannot read the upstream version from upstream.lock (python >= 3.11 needed)"

# Target tags: the interpreter's own, or an explicit cross target.
TARGET=()
if [ -n "$PYVER$PLAT" ]; then
    [ -n "$PYVER" ] || PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ -n "$PLAT" ] || PLAT=$(uname -m)
    case "$PLAT" in x86_64|aarch64) ;; *) die "--platform must be x86_64 or aarch64, not '$PLAT'" ;; esac
    nodot=${PYVER/./}
    TARGET=(--only-binary=:all: --implementation cp --python-version "$PYVER" --abi "cp$nodot" --abi abi3 --abi none)
    gmin=${GLIBC#*.}
    for ((m = gmin; m >= 17; m--)); do TARGET+=(--platform "manylinux_2_${m}_$PLAT"); done
    TARGET+=(--platform "manylinux2014_$PLAT" --platform any)
    [ "$PLAT" = x86_64 ] && TARGET+=(--platform manylinux2010_x86_64 --platform manylinux1_x86_64)
    echo "target: cp$nodot, $PLAT, glibc >= $GLIBC (cross download)"
else
    echo "target: $("$PY" -c 'import platform, sys; print("cp%d%d, %s, glibc %s" % (*sys.version_info[:2], platform.machine(), platform.libc_ver()[1]))') (native)"
fi

CONS=()
if [ "$CONSTRAINTS" != none ]; then
    [ -f "$CONSTRAINTS" ] || die "constraints file $CONSTRAINTS not found"
    CONS=(-c "$CONSTRAINTS")
fi

mkdir -p "$WH_DIR"
WH_DIR="$(cd "$WH_DIR" && pwd)"

echo "== sglang $VERSION: download and verify against upstream.lock"
SGDIR=$(mktemp -d)
trap 'rm -rf "$SGDIR"' EXIT
pip_ download -q --no-deps --only-binary=:all: ${TARGET[@]+"${TARGET[@]}"} "sglang==$VERSION" -d "$SGDIR" \
    || die "pip could not download sglang==$VERSION for this target"
SGWHEEL=$(ls "$SGDIR"/sglang-"$VERSION"-*.whl)
"$PY" - "$REPO/upstream.lock" "$SGWHEEL" <<'PY' || exit 1
import hashlib, pathlib, sys, tomllib
lock, wheel = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
want = tomllib.load(open(lock, "rb"))["upstream"]["sha256"].get(wheel.name)
got = hashlib.sha256(wheel.read_bytes()).hexdigest()
if want is None:
    sys.exit(f"error: {wheel.name} has no sha256 in upstream.lock; refusing to use it")
if got != want:
    sys.exit(f"error: {wheel.name}: sha256 {got} != upstream.lock {want}; refusing to use it")
print(f"   {wheel.name} sha256 {got[:16]}… matches upstream.lock")
PY
rm -f "$WH_DIR"/sglang-*.whl
cp "$SGWHEEL" "$WH_DIR/"

echo "== dependencies"
# pip download keeps wheels already in the --out folder, so a re-run only fetches what is missing.
if ! pip_ download --progress-bar off ${TARGET[@]+"${TARGET[@]}"} ${CONS[@]+"${CONS[@]}"} \
        "$WH_DIR/$(basename "$SGWHEEL")" -d "$WH_DIR" >"$SGDIR/pip.log" 2>&1; then
    grep -v "is ignored: it is neither" "$SGDIR/pip.log" | tail -30 >&2
    die "pip download failed"
fi
grep -c "^  Downloading" "$SGDIR/pip.log" | sed 's/^/   downloaded /; s/$/ files/' || true
# Only wheels go to an air-gapped host: build any sdist pip had to fetch (native target only).
for sd in "$WH_DIR"/*.tar.gz "$WH_DIR"/*.zip; do
    [ -e "$sd" ] || continue
    [ -z "$PYVER$PLAT" ] || die "$(basename "$sd") has no binary wheel for the cross target"
    pip_ wheel -q --no-deps -w "$WH_DIR" "$sd" && rm -f "$sd"
done

if [ -n "$GPU_ARCH" ]; then
    echo "== leaving out kernel libraries compute capability $GPU_ARCH cannot load"
    "$PY" "$REPO/docker/wheelhouse.py" slim "$WH_DIR" --gpu-arch "$GPU_ARCH"
fi

"$PY" "$REPO/docker/wheelhouse.py" requirements "$WH_DIR" >"$WH_DIR/requirements.txt.partial"
mv "$WH_DIR/requirements.txt.partial" "$WH_DIR/requirements.txt"
{
    echo "sglang $VERSION wheelhouse"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/build_wheelhouse.sh"
    echo "target ${PYVER:-native} ${PLAT:-native}; gpu-arch ${GPU_ARCH:-all}; constraints $(basename "$CONSTRAINTS")"
} >"$WH_DIR/WHEELHOUSE"
echo "== $(ls "$WH_DIR"/*.whl | wc -l) wheels, $(du -sh "$WH_DIR" | cut -f1) in $WH_DIR (requirements.txt has the hashes)"
