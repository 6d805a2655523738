#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the offline install for the H200 GPU test host as carry folders of at most
# $PART_MIB MiB each (a command sent to the GPU host carries 64 MiB, working tree included).
#
# The host already has python 3.12, torch 2.11.0+cu130 and triton 3.6.0; this brings the rest of
# what sglang 0.5.17 needs (scripts/gpu_host/wheels.txt, the set verified on the H200 host),
# slimmed with docker/wheelhouse.py:
#   sglang-kernel without sgl_kernel/flash_ops (FA3, 1.1 GB unpacked) and sgl_kernel/sm100/
#   (sm_90 loads sm90/), xgrammar without its static C++ archive (lib/, link time only),
#   tokenspeed-triton without its AMD code generator (backends/amd/lib/libtriton_amd_codegen.so,
#   loaded only to compile for a HIP target; its other files stay, so the backend still registers).
# The wheels are installed here for cp312 (pip --target, cross platform), then the tree is
# packed as one xz archive (317 MiB with xz -9 for the set of 2026-12-02, 2.0 GB unpacked) and
# split into parts:
#   .whl-e2e-1/ .whl-e2e-2/ ...   each: site.tar.xz.NN, SHA256SUMS (whole archive), NPARTS
# scripts/gpu_host/install.sh takes them one call at a time (docs/GPU_HOST.md).
#
# Usage: scripts/gpu_host/build_wheelhouse.sh [--python PY]   (run from anywhere; needs network)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY=${PYTHON:-$REPO/.venv/bin/python}
[ "${1:-}" = --python ] && PY=$2
PART_MIB=${PART_MIB:-54}
XZ_LEVEL=${XZ_LEVEL:-9}  # the xz preset: -9 packs smallest, -1 many times faster (a busy machine)
RAW="$REPO/.cache/gpu-wheels/raw"  # as downloaded (pip re-downloads a file whose hash changed)
WHEELS="$REPO/.cache/gpu-wheels/slim"
STAGE="$REPO/.cache/gpu-site"
die() { echo "build_wheelhouse.sh: $*" >&2; exit 1; }
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
import wheelhouse  # the docker engineer's wheel rewriter (keeps RECORD consistent)
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
rm -rf "$REPO"/.whl-e2e-*
SUM=$(cd "$(dirname "$ARCHIVE")" && sha256sum "$(basename "$ARCHIVE")" | cut -d' ' -f1)
TMP=$(mktemp -d)
split -b "${PART_MIB}M" -d "$ARCHIVE" "$TMP/site.tar.xz."
NPARTS=$(ls "$TMP" | wc -l)
i=1
for part in "$TMP"/site.tar.xz.*; do
    d="$REPO/.whl-e2e-$i"
    mkdir -p "$d"
    mv "$part" "$d/"
    echo "$SUM  site.tar.xz" >"$d/SHA256SUMS"
    echo "$NPARTS" >"$d/NPARTS"
    i=$((i + 1))
done
rmdir "$TMP"
du -sh "$REPO"/.whl-e2e-* | sed 's/^/   /'
echo "== $NPARTS carry folders; on the host: scripts/gpu_host/install.sh .whl-e2e-1, then -2, ..."
