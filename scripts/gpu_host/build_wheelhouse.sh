#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the wheel set for an offline GPU host (docs/GPU_HOST.md), on a machine with network.
#
# The host already has python 3.12, torch 2.11.0+cu130 and triton 3.6.0
# (scripts/gpu_host/host_provided.txt); this brings the rest of what sglang 0.5.17 needs
# (scripts/gpu_host/wheels.txt), slimmed with docker/wheelhouse.py:
#   sglang-kernel without sgl_kernel/flash_ops (FA3, 1.1 GB unpacked) and sgl_kernel/sm100/
#   (sm_90 loads sm90/), xgrammar without its static C++ archive (lib/, link time only),
#   tokenspeed-triton without its AMD code generator (backends/amd/lib/libtriton_amd_codegen.so,
#   loaded only to compile for a HIP target; its other files stay, so the backend still registers).
# The wheels are installed here for cp312 (pip --target, cross platform) and the tree is packed as
# one xz archive (317 MiB with xz -9 for the set of 2026-12-02, 2.0 GB unpacked):
#   DIR/site.tar.xz, DIR/SHA256SUMS                        (the default)
#   DIR-1/ DIR-2/ ...  each: site.tar.xz.NN, SHA256SUMS (of the whole archive), NPARTS
#                                                          (with --part-mib N: parts of N MiB)
# Copy DIR (or the DIR-N folders) to the host and run scripts/gpu_host/install.sh there.
#
# Usage: scripts/gpu_host/build_wheelhouse.sh [--out DIR] [--part-mib N] [--xz-level L] [--python PY]
#   --out DIR       where the archive goes (default: .whl-e2e in the repository root)
#   --part-mib N    split the archive into parts of N MiB, one folder each (DIR-1, DIR-2, ...),
#                   for a host that receives files in pieces (environment: PART_MIB)
#   --xz-level L    the xz preset, 1-9 (default 9: smallest; 1: faster, larger;
#                   environment: XZ_LEVEL)
#   --python PY     the interpreter that runs pip (default: .venv/bin/python, or PYTHON)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() { echo "build_wheelhouse.sh: $*" >&2; exit 1; }
usage() { sed -n '3,25p' "$0" | sed 's/^# \{0,1\}//'; }
PY=${PYTHON:-$REPO/.venv/bin/python}
PART_MIB=${PART_MIB:-}
XZ_LEVEL=${XZ_LEVEL:-9}
DEST="$REPO/.whl-e2e"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) DEST=${2:?--out needs a directory}; shift 2 ;;
        --part-mib) PART_MIB=${2:?--part-mib needs a size in MiB}; shift 2 ;;
        --xz-level) XZ_LEVEL=${2:?--xz-level needs 1-9}; shift 2 ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument $1" ;;
    esac
done
[ -z "$PART_MIB" ] || [[ "$PART_MIB" =~ ^[1-9][0-9]*$ ]] || die "--part-mib takes a whole number of MiB, got '$PART_MIB'"
[[ "$XZ_LEVEL" =~ ^[1-9]$ ]] || die "--xz-level takes 1-9, got '$XZ_LEVEL'"
DEST=$(mkdir -p "$(dirname "$DEST")" && cd "$(dirname "$DEST")" && pwd)/$(basename "$DEST")
is_ours() {  # a folder this script wrote (it is replaced): the archive or one part, with its sums
    local f
    for f in "$1"/* "$1"/.[!.]*; do
        [ -e "$f" ] || continue
        case $(basename "$f") in site.tar.xz|site.tar.xz.[0-9]*|SHA256SUMS|NPARTS) ;; *) return 1 ;; esac
    done
}
[ ! -e "$DEST" ] || { [ -d "$DEST" ] && is_ours "$DEST"; } \
    || die "$DEST exists and is not a wheel-set folder made by this script: choose another --out"
RAW="$REPO/.cache/gpu-wheels/raw"  # as downloaded (pip re-downloads a file whose hash changed)
WHEELS="$REPO/.cache/gpu-wheels/slim"
STAGE="$REPO/.cache/gpu-site"
command -v xz >/dev/null || die "xz not found"

PLATS=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for n in 17 24 26 27 28 31 34; do PLATS+=(--platform "manylinux_2_${n}_x86_64"); done
TARGET=(--only-binary=:all: --implementation cp --python-version 3.12 "${PLATS[@]}")

echo "== download (cp312, manylinux x86_64)"
mkdir -p "$RAW"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$RAW" -r "$REPO/scripts/gpu_host/wheels.txt" \
    2> >(grep -v "is ignored: it is neither" >&2) || die "pip download failed"
rm -rf "$WHEELS" && mkdir -p "$WHEELS" && cp "$RAW"/*.whl "$WHEELS/"

echo "== slim"
"$PY" - "$REPO/docker" "$WHEELS" <<'PY'
import pathlib, sys
sys.path.insert(0, sys.argv[1])
import wheelhouse  # the image's wheel rewriter (keeps RECORD consistent)
drop = {"sglang_kernel": ["sgl_kernel/flash_ops", "sgl_kernel/sm100/"], "xgrammar": ["xgrammar/lib/"],
        "tokenspeed_triton": ["tokenspeed_triton/backends/amd/lib/libtriton_amd_codegen.so"]}
for prefix, paths in drop.items():
    for whl in pathlib.Path(sys.argv[2]).glob(f"{prefix}-*.whl"):
        saved, _ = wheelhouse.slim_wheel(whl, paths)
        wheelhouse.verify_record(whl)
        print(f"   {whl.name}: -{saved / 2**20:.0f} MiB")
PY

echo "== install for cp312 into $STAGE"
rm -rf "$STAGE"
"$PY" -m pip install -q --no-deps --no-compile --target "$STAGE" "${TARGET[@]}" "$WHEELS"/*.whl
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +

echo "== pack (xz -$XZ_LEVEL)"
ARCHIVE="$REPO/.cache/gpu-site.tar.xz"
tar -C "$STAGE" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | nice xz -"$XZ_LEVEL" -T2 >"$ARCHIVE"
SUM=$(cd "$(dirname "$ARCHIVE")" && sha256sum "$(basename "$ARCHIVE")" | cut -d' ' -f1)
# One build leaves one form: the archive folder or its part folders, not both.
rm -rf "$DEST"
for d in "$DEST"-[0-9]*; do
    if [ -d "$d" ] && [ -f "$d/NPARTS" ] && is_ours "$d"; then rm -rf "$d"; fi
done

if [ -z "$PART_MIB" ]; then
    mkdir -p "$DEST"
    mv "$ARCHIVE" "$DEST/site.tar.xz"
    echo "$SUM  site.tar.xz" >"$DEST/SHA256SUMS"
    du -sh "$DEST" | sed 's/^/   /'
    echo "== one archive in $DEST; copy that folder to the host, then there: scripts/gpu_host/install.sh $(basename "$DEST")"
    exit 0
fi

TMP=$(mktemp -d)
# Two-digit suffixes (site.tar.xz.00, .01, ...) unless there are more than 100 parts.
NEED=$(( ($(stat -c %s "$ARCHIVE") + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
SUFFIX=2
[ "$NEED" -le 100 ] || SUFFIX=${#NEED}
split -b "${PART_MIB}M" -d -a "$SUFFIX" "$ARCHIVE" "$TMP/site.tar.xz."
NPARTS=$(ls "$TMP" | wc -l)
i=1
for part in "$TMP"/site.tar.xz.*; do
    d="$DEST-$i"
    mkdir -p "$d"
    mv "$part" "$d/"
    echo "$SUM  site.tar.xz" >"$d/SHA256SUMS"
    echo "$NPARTS" >"$d/NPARTS"
    i=$((i + 1))
done
rmdir "$TMP"
du -sh "$DEST"-[0-9]* | sed 's/^/   /'
echo "== $NPARTS parts of at most $PART_MIB MiB in $(basename "$DEST")-1 ... $(basename "$DEST")-$NPARTS;" \
     "on the host: scripts/gpu_host/install.sh with those folders, in any order, together or one at a time"
