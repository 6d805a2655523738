#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the patched stack on the GPU host from one carry folder per call
# (scripts/gpu_host/build_wheelhouse.sh makes them; docs/GPU_HOST.md has the procedure).
#
# Usage, on the host, in the repo root:  scripts/gpu_host/install.sh .whl-e2e-N
# Each call stashes its part under $STAGE; the call that brings the last part checks the
# archive's sha256, unpacks it into $SITE, applies the overlay and patch series there
# (scripts/apply_patches.sh --target) and writes $SITE/.ddtree-installed. Once installed,
# a call re-applies the series only (idempotent), so a changed tree is picked up. Every call that
# finds the stack installed checks it against the lock (scripts/gpu_host/lock_check.py installed).
# Then: export PYTHONPATH=$SITE  (scripts/gpu_host/env.sh does it).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE=${DDTREE_SITE:-/tmp/site}
STAGE=${DDTREE_STAGE:-/tmp/ddtree-parts}
PY=${PYTHON:-python3}
# What must import once unpacked. sgl_kernel loads the CUDA driver at import, so a rehearsal on a
# machine without a GPU (scripts/gpu_host/rehearse_host.sh) names the others only.
IMPORTS=${DDTREE_INSTALL_IMPORTS:-sglang transformers sgl_kernel flashinfer}
die() { echo "install.sh: $*" >&2; exit 1; }

apply_series() {
    PYTHON="$PY" bash "$REPO/scripts/apply_patches.sh" --target "$SITE" --quiet \
        || die "the patch series did not apply to $SITE"
}

# The GPU tier must run the image's wheel set: every carried and host-provided package at the
# version of the one lock (constraints/dev.txt). DDTREE_ALLOW_LOCK_DRIFT=1 goes on regardless;
# results from such a host are not results for the image's set.
check_lock() {
    if ! PYTHONPATH="$SITE" "$PY" "$REPO/scripts/gpu_host/lock_check.py" installed; then
        [ "${DDTREE_ALLOW_LOCK_DRIFT:-0}" = 1 ] || die "the host drifts from the lock (above); DDTREE_ALLOW_LOCK_DRIFT=1 to go on anyway"
        echo "install.sh: going on despite the drift (DDTREE_ALLOW_LOCK_DRIFT=1)"
    fi
}

if [ -f "$SITE/.ddtree-installed" ]; then
    apply_series
    check_lock
    echo "install.sh: $SITE already installed; series re-applied"
    exit 0
fi

carry=${1:?usage: install.sh CARRY_DIR}
[ -f "$carry/NPARTS" ] || die "$carry has no NPARTS: not a folder made by build_wheelhouse.sh"
mkdir -p "$STAGE"
cp "$carry"/site.tar.xz.* "$carry/SHA256SUMS" "$STAGE/"
want=$(cat "$carry/NPARTS")
have=$(ls "$STAGE"/site.tar.xz.* | wc -l)
if [ "$have" -lt "$want" ]; then
    echo "install.sh: have $have of $want parts; run the next call at once (the host stays warm ~30 s)"
    exit 0
fi

t0=$(date +%s)
cat "$STAGE"/site.tar.xz.* >"$STAGE/site.tar.xz"
(cd "$STAGE" && sha256sum -c --quiet SHA256SUMS) || die "archive checksum mismatch: rebuild or resend the parts"
rm -rf "$SITE"
mkdir -p "$SITE"
xz -d -T0 <"$STAGE/site.tar.xz" | tar -x -C "$SITE"
rm -rf "$STAGE"
apply_series
PYTHONPATH="$SITE" "$PY" -c 'import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
import sglang, transformers, numpy
print("imported:", *sys.argv[1:], "| sglang", sglang.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)' $IMPORTS \
    || die "the installed stack does not import ($IMPORTS)"
date -u +%Y-%m-%dT%H:%M:%SZ >"$SITE/.ddtree-installed"
echo "install.sh: installed into $SITE in $(( $(date +%s) - t0 )) s"
check_lock
