#!/usr/bin/env bash
# The GPU e2e tests in one command on the host (after install.sh), logs under $OUT (or /tmp/ddtree-out).
#   scripts/gpu_host/run_e2e.sh [pytest args...]
#   DDTREE_E2E_CONFIGS=triton-nospec,triton-dflash scripts/gpu_host/run_e2e.sh -x
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
source scripts/gpu_host/env.sh
OUTDIR=${OUT:-/tmp/ddtree-out}
mkdir -p "$OUTDIR"
export DDTREE_GPU_LOG_DIR=/tmp/ddtree-logs
mkdir -p "$DDTREE_GPU_LOG_DIR"
t0=$(date +%s)
[ -f "$DDTREE_TEST_MODELS/manifest.json" ] || python3 scripts/make_test_models.py "$DDTREE_TEST_MODELS" \
    || { echo "run_e2e.sh: model generation failed" >&2; exit 1; }
echo "models ready after $(( $(date +%s) - t0 )) s"
python3 -m pytest tests/gpu/e2e -q -rA -p no:cacheprovider "$@" 2>&1 | tee "$OUTDIR/e2e-pytest.log"
rc=${PIPESTATUS[0]}
tar -czf "$OUTDIR/e2e-server-logs.tgz" -C "$DDTREE_GPU_LOG_DIR" . 2>/dev/null
echo "run_e2e.sh: pytest rc=$rc after $(( $(date +%s) - t0 )) s"
exit $rc
