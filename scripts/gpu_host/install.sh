#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the patched stack on an offline GPU host from the wheel set that
# scripts/gpu_host/build_wheelhouse.sh builds (docs/GPU_HOST.md has the procedure).
#
# Usage, on the host, in the repository root:
#   scripts/gpu_host/install.sh .whl-e2e                 the whole archive (its folder, or
#                                                        site.tar.xz with SHA256SUMS beside it)
#   scripts/gpu_host/install.sh .whl-e2e-3 .whl-e2e-1 ...  parts (build_wheelhouse.sh --part-mib N),
#                                                        in any order, all at once or a few at a time
#   scripts/gpu_host/install.sh                          once installed: re-apply the series
# Parts are kept under $DDTREE_STAGE (/tmp/ddtree-parts) until the last one is there. With the whole
# archive, it checks the archive's sha256, unpacks it into $DDTREE_SITE (/tmp/site), applies the
# overlay and patch series there (scripts/apply_patches.sh --target), byte-compiles it, checks
# that the stack imports and writes $DDTREE_SITE/.ddtree-installed; with a GPU visible it then
# builds the JIT kernel modules the servers build on their first start (build_jit_caches.py;
# DDTREE_JIT_BUILD=0 leaves them to the servers). On a site that has that marker it only
# re-applies the series (idempotent), so a changed working tree is picked up; remove the site to
# install another wheel set. Every run that finds the stack installed checks it against the lock
# (scripts/gpu_host/lock_check.py installed). Then: source scripts/gpu_host/env.sh.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE=${DDTREE_SITE:-/tmp/site}
STAGE=${DDTREE_STAGE:-/tmp/ddtree-parts}
PY=${PYTHON:-python3}
# What must import once unpacked. sgl_kernel loads the CUDA driver at import, so a rehearsal on a
# machine without a GPU (scripts/gpu_host/rehearse_host.sh) names the others only.
IMPORTS=${DDTREE_INSTALL_IMPORTS:-sglang transformers sgl_kernel flashinfer}
die() { echo "install.sh: $*" >&2; exit 1; }
USAGE="usage: install.sh WHEEL_SET_DIR | ARCHIVE | PART_DIR... (folders made by build_wheelhouse.sh)"

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

[ $# -gt 0 ] || die "$USAGE"
sum_of() { awk 'NR == 1 {print $1}' "$1"; }
archive=""   # the whole archive, when given
for src in "$@"; do
    if [ -f "$src" ] && [[ "$(basename "$src")" != site.tar.xz.[0-9]* ]]; then
        dir=$(dirname "$src") whole=$src  # an archive file: its SHA256SUMS lies beside it
    elif [ -d "$src" ] && [ -f "$src/site.tar.xz" ]; then
        dir=$src whole=$src/site.tar.xz
    elif [ -d "$src" ] && [ -f "$src/NPARTS" ]; then
        dir=$src whole=""
    else
        die "$src is neither an archive folder (site.tar.xz, SHA256SUMS) nor a part folder (NPARTS) made by build_wheelhouse.sh"
    fi
    [ -f "$dir/SHA256SUMS" ] || die "no SHA256SUMS beside $src: copy it with the archive or part"
    if [ -n "$whole" ]; then
        [ -z "$archive" ] || die "two archives given ($archive, $whole): give one"
        archive=$whole archive_sum=$(sum_of "$dir/SHA256SUMS")
        continue
    fi
    mkdir -p "$STAGE"
    if [ -f "$STAGE/SHA256SUMS" ] && [ "$(sum_of "$STAGE/SHA256SUMS")" != "$(sum_of "$dir/SHA256SUMS")" ]; then
        echo "install.sh: $STAGE holds parts of another build; dropped"
        rm -f "$STAGE"/site.tar.xz.* "$STAGE/SHA256SUMS" "$STAGE/NPARTS"
    fi
    cp "$dir"/site.tar.xz.[0-9]* "$dir/SHA256SUMS" "$dir/NPARTS" "$STAGE/"
done

t0=$(date +%s)
if [ -z "$archive" ]; then
    want=$(cat "$STAGE/NPARTS")
    have=$(ls "$STAGE"/site.tar.xz.[0-9]* | wc -l)
    if [ "$have" -lt "$want" ]; then
        echo "install.sh: have $have of $want parts in $STAGE; run install.sh again with the others (any order)"
        exit 0
    fi
    cat "$STAGE"/site.tar.xz.[0-9]* >"$STAGE/site.tar.xz"
    archive=$STAGE/site.tar.xz archive_sum=$(sum_of "$STAGE/SHA256SUMS")
fi
[ "$(sha256sum "$archive" | cut -d' ' -f1)" = "$archive_sum" ] \
    || die "archive checksum mismatch ($archive against its SHA256SUMS): rebuild or copy it again"
rm -rf "$SITE"
mkdir -p "$SITE"
xz -d -T0 <"$archive" | tar -x -C "$SITE"
rm -rf "$STAGE"
apply_series
# Byte-compiled as pip would have left it (the wheel set is packed without __pycache__): else
# every server process of a test that starts several at once compiles the same modules itself.
t1=$(date +%s)
"$PY" -m compileall -q -j 0 "$SITE" >/dev/null \
    || echo "install.sh: some files of $SITE did not byte-compile (they compile when imported)"
echo "install.sh: byte-compiled $SITE in $(( $(date +%s) - t1 )) s"
PYTHONPATH="$SITE" "$PY" -c 'import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
import sglang, transformers, numpy
print("imported:", *sys.argv[1:], "| sglang", sglang.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)' $IMPORTS \
    || die "the installed stack does not import ($IMPORTS)"
date -u +%Y-%m-%dT%H:%M:%SZ >"$SITE/.ddtree-installed"
echo "install.sh: installed into $SITE in $(( $(date +%s) - t0 )) s"
check_lock
# The JIT kernel modules every server builds at its first start, built once here (with a GPU
# visible: they are built for it) so that the first servers and the first sampled request do
# not wait for nvcc. DDTREE_JIT_BUILD=0 leaves them to the servers.
if [ "${DDTREE_JIT_BUILD:-1}" != 0 ] && nvidia-smi -L >/dev/null 2>&1; then
    PYTHONPATH="$SITE" "$PY" "$REPO/scripts/gpu_host/build_jit_caches.py" \
        || echo "install.sh: some JIT modules did not build (above); the servers build them on first use"
fi
