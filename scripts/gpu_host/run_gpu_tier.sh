#!/usr/bin/env bash
# The whole GPU test tier in one command on the GPU host (after scripts/gpu_host/install.sh).
#
#   scripts/gpu_host/run_gpu_tier.sh [--only DIR,DIR] [--dir-timeout SECONDS] [--] [pytest args...]
#
# Runs pytest over each tests/gpu/<dir> in turn, one pytest session per dir. Logs go to
# $OUT (or /tmp/ddtree-out): <dir>-pytest.log, <dir>-server-logs.tgz for dirs that start
# servers, gpu-tier-summary.txt with one line per dir (rc, passed/failed/skipped/errors,
# seconds). Exits nonzero if any dir failed, timed out or collected nothing (pytest rc 5),
# or if no test passed at all. Test-selection variables (DDTREE_E2E_CONFIGS,
# DDTREE_E2E_SERVERS, ...) pass through: docs/GPU_HOST.md lists them. Server logs go under
# $DDTREE_GPU_LOG_ROOT (default /tmp/ddtree-logs); give concurrent runs their own root and OUT.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
ALL_DIRS=(tree_verify tree_verify_integration ddtree_logic arch_gating e2e ddtree)
SERVER_DIRS=" e2e ddtree "  # start sglang servers: need the tiny models, leave server logs

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; echo "dirs: ${ALL_DIRS[*]}"; }
only="" dir_timeout=0
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only=${2:?--only needs a comma list}; shift 2 ;;
        --only=*) only=${1#--only=}; shift ;;
        --dir-timeout) dir_timeout=${2:?--dir-timeout needs seconds}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) break ;;  # the rest goes to pytest
    esac
done
if [ -n "$only" ]; then
    IFS=, read -r -a dirs <<<"$only"
    for d in "${dirs[@]}"; do
        [ -d "tests/gpu/$d" ] || { echo "run_gpu_tier.sh: no tests/gpu/$d; dirs: ${ALL_DIRS[*]}" >&2; exit 2; }
    done
else
    dirs=("${ALL_DIRS[@]}")
fi

source scripts/gpu_host/env.sh
unset TRITON_INTERPRET  # the CPU tier's interpreter switch would break every GPU kernel test
OUTDIR=${OUT:-/tmp/ddtree-out}
mkdir -p "$OUTDIR"
summary="$OUTDIR/gpu-tier-summary.txt"
: >"$summary"
export DDTREE_LOGIC_BENCH_JSON=${DDTREE_LOGIC_BENCH_JSON:-$OUTDIR/ddtree_logic_bench.json}

t_all=$(date +%s)
models_ready() {  # all pairs, not just a manifest: `make_test_models.py --only shapes` writes one too
    local m
    for m in manifest.json tiny-mla/config.json tiny-mla-dflash/config.json tiny-qwen3/config.json \
             tiny-qwen3-dflash/config.json; do
        [ -f "$DDTREE_TEST_MODELS/$m" ] || return 1
    done
}
for d in "${dirs[@]}"; do
    if [[ "$SERVER_DIRS" == *" $d "* ]] && ! models_ready; then
        t0=$(date +%s)
        python3 scripts/make_test_models.py "$DDTREE_TEST_MODELS" \
            || { echo "run_gpu_tier.sh: model generation failed" >&2; exit 1; }
        echo "test models ready in $DDTREE_TEST_MODELS after $(( $(date +%s) - t0 )) s"
        break
    fi
done

overall=0 passed_total=0
for d in "${dirs[@]}"; do
    log="$OUTDIR/$d-pytest.log"
    export DDTREE_GPU_LOG_DIR="${DDTREE_GPU_LOG_ROOT:-/tmp/ddtree-logs}/$d"
    rm -rf "$DDTREE_GPU_LOG_DIR" && mkdir -p "$DDTREE_GPU_LOG_DIR"
    echo "=== tests/gpu/$d ($(date -u +%H:%M:%S))"
    t0=$(date +%s)
    cmd=(python3 -m pytest "tests/gpu/$d" -q -rfEs -p no:cacheprovider "$@")
    if [ "$dir_timeout" -gt 0 ]; then
        # SIGINT first: pytest then runs its teardown, which stops the servers it started.
        cmd=(timeout -s INT -k 60 "$dir_timeout" "${cmd[@]}")
    fi
    "${cmd[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    secs=$(( $(date +%s) - t0 ))
    if [ -n "$(ls -A "$DDTREE_GPU_LOG_DIR" 2>/dev/null)" ]; then
        tar -czf "$OUTDIR/$d-server-logs.tgz" -C "$DDTREE_GPU_LOG_DIR" . 2>/dev/null
    fi
    # counts from pytest's final line, e.g. "3 failed, 40 passed, 2 skipped in 61.2s"
    last=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran' "$log" | tail -1)
    count() { grep -oE "[0-9]+ $1" <<<"$last" | grep -oE '^[0-9]+' || echo 0; }
    p=$(count passed) f=$(count failed) s=$(count skipped) e=$(count 'errors?')
    status=ok
    case $rc in
        0) ;;
        5) status="nothing collected" ;;
        124|130|137) status="timed out after ${dir_timeout} s" ;;
        *) status=failed ;;
    esac
    [ "$rc" -ne 0 ] && overall=1
    passed_total=$(( passed_total + p ))
    line=$(printf 'gpu-tier %-24s %-18s passed=%-4s failed=%-3s skipped=%-3s errors=%-3s %5d s' \
        "$d" "rc=$rc($status)" "$p" "$f" "$s" "$e" "$secs")
    echo "$line" | tee -a "$summary"
done

echo "--- summary ($(( $(date +%s) - t_all )) s), logs in $OUTDIR"
cat "$summary"
if [ "$overall" -eq 0 ] && [ "$passed_total" -eq 0 ]; then
    echo "run_gpu_tier.sh: no test passed (all skipped?): nothing was shown" | tee -a "$summary"
    exit 5
fi
exit "$overall"
