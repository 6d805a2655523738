#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GPU test tier in one command on the GPU host (after scripts/gpu_host/install.sh).
#
#   scripts/gpu_host/run_gpu_tier.sh [--only DIR,DIR] [--jobs N] [--dir-timeout SECONDS] [--out DIR] [--list] [--] [pytest args...]
#
# The tier is a list of pieces, one pytest session each: a tests/gpu/<dir>, or a share of the
# e2e configurations. Pieces run --jobs at a time (default: all at once), spread round-robin over
# the visible GPUs; a piece that needs every GPU (tensor parallel), a whole GPU's memory (servers
# at the default memory flags) or the GPU to itself (the timed soak) runs alone after the others,
# one such piece at a time. --jobs 1 runs them one after another. Logs go to --out DIR (default:
# the OUT environment variable if set, else /tmp/ddtree-out): <piece>-pytest.log,
# <piece>-server-logs.tgz for pieces that start servers, ddtree_logic_bench.json, soak.json,
# gpu-tier-summary.txt (one line per piece). Exits nonzero if any piece failed, timed
# out (--dir-timeout, per piece) or collected nothing (pytest rc 5), or if no test passed at all;
# a skip is a failure (env.sh sets DDTREE_GPU_HOST=1), and a piece that needs two GPUs is left
# out on a host with one.
# DDTREE_E2E_CONFIGS / DDTREE_E2E_SERVERS set by the caller turn that dir back into one piece
# with the caller's selection. PYTHON picks the interpreter (default python3).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
ALL_DIRS=(tree_verify tree_verify_integration ddtree_logic arch_gating e2e ddtree hybrid swa dflash2 verify_sampling serving_defaults soak)
SERVER_DIRS=" e2e ddtree hybrid swa dflash2 verify_sampling serving_defaults soak "  # start sglang servers: need the test models, leave server logs

# name|dir|environment (space-separated VAR=value)|all-gpus when it runs alone on every GPU and
# needs two (tensor parallel), alone when it runs alone but one GPU is enough
# (serving_defaults: each server sizes its KV pools from the whole GPU's memory; soak: six
# servers under 256 clients for five minutes, timed).
# Longest first: a free slot takes the next piece in this order. The e2e shares together hold
# every configuration of tests/gpu/e2e (a CPU test checks it); each holds two or more, so its
# cross-configuration check runs.
PIECES=(
    "e2e-flashinfer|e2e|DDTREE_E2E_CONFIGS=flashinfer-nospec,flashinfer-dflash|"
    "e2e-qwen3|e2e|DDTREE_E2E_CONFIGS=qwen3-dflash,qwen3-ddtree|"
    "e2e-triton|e2e|DDTREE_E2E_CONFIGS=triton-nospec,triton-dflash,triton-ddtree|"
    "ddtree|ddtree||"
    "hybrid|hybrid||"
    "swa|swa||"
    "dflash2|dflash2||"
    "verify_sampling|verify_sampling||"
    "tree_verify|tree_verify||"
    "tree_verify_integration|tree_verify_integration||"
    "ddtree_logic|ddtree_logic||"
    "arch_gating|arch_gating||"
    "e2e-tp2|e2e|DDTREE_E2E_CONFIGS=triton-nospec-tp2,triton-dflash-tp2|all-gpus"
    "serving_defaults|serving_defaults||alone"
    "soak|soak||alone"
)

usage() { sed -n '3,19p' "$0" | sed 's/^# \{0,1\}//'; echo "dirs: ${ALL_DIRS[*]}"; }
only="" dir_timeout=0 jobs="" list=0 OUTDIR=${OUT:-/tmp/ddtree-out}
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only=${2:?--only needs a comma list}; shift 2 ;;
        --only=*) only=${1#--only=}; shift ;;
        --jobs) jobs=${2:?--jobs needs a number}; shift 2 ;;
        --jobs=*) jobs=${1#--jobs=}; shift ;;
        --dir-timeout) dir_timeout=${2:?--dir-timeout needs seconds}; shift 2 ;;
        --out) OUTDIR=${2:?--out needs a directory}; shift 2 ;;
        --out=*) OUTDIR=${1#--out=}; shift ;;
        --list) list=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) break ;;  # the rest goes to pytest
    esac
done
if [ -n "$jobs" ] && ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_gpu_tier.sh: --jobs takes a positive whole number, got '$jobs'" >&2; exit 2
fi
if ! [[ "$dir_timeout" =~ ^[0-9]+$ ]]; then
    echo "run_gpu_tier.sh: --dir-timeout takes seconds, got '$dir_timeout'" >&2; exit 2
fi
if [ -n "$only" ]; then
    IFS=, read -r -a dirs <<<"$only"
    for d in "${dirs[@]}"; do
        [ -d "tests/gpu/$d" ] || { echo "run_gpu_tier.sh: no tests/gpu/$d; dirs: ${ALL_DIRS[*]}" >&2; exit 2; }
    done
else
    dirs=("${ALL_DIRS[@]}")
fi

# The pieces of the selected dirs; a dir whose selection variable the caller set is one piece.
selected=()
declare -A whole=()  # dirs already added as one piece
for spec in "${PIECES[@]}"; do
    IFS='|' read -r name dir env mode <<<"$spec"
    [[ " ${dirs[*]} " == *" $dir "* ]] || continue
    caller_var=""
    case $dir in e2e) caller_var=${DDTREE_E2E_CONFIGS:-} ;; ddtree) caller_var=${DDTREE_E2E_SERVERS:-} ;; esac
    if [ -z "$caller_var" ]; then
        selected+=("$name|$dir|$env|$mode")
    elif [ -z "${whole[$dir]:-}" ]; then
        whole[$dir]=1
        mode=""
        if [[ "$caller_var" == *tp2* || "${DDTREE_E2E_EXTRA_ARGS:-}" == *--tp-size* ]]; then mode=all-gpus; fi
        selected+=("$dir|$dir||$mode")
    fi
done
if [ "$list" -eq 1 ]; then
    printf '%s\n' "${selected[@]}"
    exit 0
fi

source scripts/gpu_host/env.sh
unset TRITON_INTERPRET  # the CPU tier's interpreter switch would break every GPU kernel test
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
summary="$OUTDIR/gpu-tier-summary.txt"
: >"$summary"
export DDTREE_LOGIC_BENCH_JSON=${DDTREE_LOGIC_BENCH_JSON:-$OUTDIR/ddtree_logic_bench.json}
export DDTREE_SOAK_JSON=${DDTREE_SOAK_JSON:-$OUTDIR/soak.json}
LOG_ROOT=${DDTREE_GPU_LOG_ROOT:-/tmp/ddtree-logs}
STATE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-tier.XXXXXX")
trap 'rm -rf "$STATE"' EXIT

# The GPUs to spread pieces over: the caller's CUDA_VISIBLE_DEVICES, else every GPU.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
else
    mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ')
fi
ngpu=${#gpus[@]}

t_all=$(date +%s)
models_ready() {  # all pairs, not just a manifest: `make_test_models.py --only shapes` writes one too
    local m
    for m in manifest.json tiny-mla/config.json tiny-mla-dflash/config.json tiny-qwen3/config.json \
             tiny-qwen3-dflash/config.json tiny-qwen3next/config.json tiny-qwen3next-dflash/config.json \
             tiny-gptoss/config.json tiny-gptoss-dflash/config.json \
             qwen3-8b-shape/config.json qwen3-8b-shape-dflash/config.json; do
        [ -f "$DDTREE_TEST_MODELS/$m" ] || return 1
    done
}
for spec in "${selected[@]}"; do
    IFS='|' read -r _ dir _ _ <<<"$spec"
    if [[ "$SERVER_DIRS" == *" $dir "* ]] && ! models_ready; then
        t0=$(date +%s)
        "$PY" "$REPO/scripts/make_test_models.py" "$DDTREE_TEST_MODELS" \
            || { echo "run_gpu_tier.sh: model generation failed" >&2; exit 1; }
        echo "test models ready in $DDTREE_TEST_MODELS after $(( $(date +%s) - t0 )) s"
        break
    fi
done

# One piece: its pytest session, its server logs, and "<rc> <passed> <line>" in $STATE/<name>.
run_piece() {
    local name=$1 dir=$2 env=$3 gpu=$4; shift 4
    local log="$OUTDIR/$name-pytest.log" t0 rc secs last p f s e status line
    export DDTREE_GPU_LOG_DIR="$LOG_ROOT/$name"
    rm -rf "$DDTREE_GPU_LOG_DIR" && mkdir -p "$DDTREE_GPU_LOG_DIR"
    local cmd=(env)
    [ -n "$gpu" ] && cmd+=("CUDA_VISIBLE_DEVICES=$gpu")
    # shellcheck disable=SC2206  # the piece's VAR=value words
    [ -n "$env" ] && cmd+=($env)
    [ "$dir_timeout" -gt 0 ] && cmd+=(timeout -s INT -k 60 "$dir_timeout")  # SIGINT: pytest's teardown stops its servers
    cmd+=("$PY" -m pytest "tests/gpu/$dir" -q -rfEs -p no:cacheprovider "$@")
    t0=$(date +%s)
    echo "${cmd[*]}" >"$log"
    "${cmd[@]}" >>"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    if [ -n "$(ls -A "$DDTREE_GPU_LOG_DIR" 2>/dev/null)" ]; then
        tar -czf "$OUTDIR/$name-server-logs.tgz" -C "$DDTREE_GPU_LOG_DIR" . 2>/dev/null
    fi
    # counts from pytest's final line, e.g. "3 failed, 40 passed, 2 skipped in 61.2s"
    last=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran' "$log" | tail -1)
    count() { grep -oE "[0-9]+ $1" <<<"$last" | grep -oE '^[0-9]+' || echo 0; }
    p=$(count passed) f=$(count failed) s=$(count skipped) e=$(count 'errors?')
    case $rc in
        0) status=ok ;;
        5) status="nothing collected" ;;
        124|130|137) status="timed out after ${dir_timeout} s" ;;
        *) status=failed ;;
    esac
    line=$(printf 'gpu-tier %-24s %-18s passed=%-4s failed=%-3s skipped=%-3s errors=%-3s %5d s  gpu=%s' \
        "$name" "rc=$rc($status)" "$p" "$f" "$s" "$e" "$secs" "${gpu:-all}")
    echo "$rc $p $t0 $(date +%s) $line" >"$STATE/$name"
    echo "$line"
}

# Shared pieces first, at most $jobs at a time, then the all-GPU pieces one by one.
shared=() alone=()
for spec in "${selected[@]}"; do
    [[ "$spec" == *"|all-gpus" || "$spec" == *"|alone" ]] && alone+=("$spec") || shared+=("$spec")
done
[ -n "$jobs" ] || jobs=$(( ${#shared[@]} > 0 ? ${#shared[@]} : 1 ))
echo "=== GPU tier: ${#selected[@]} pieces, $jobs at a time over ${ngpu} GPU(s) ($(date -u +%H:%M:%S))"
k=0
for spec in "${shared[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    IFS='|' read -r name dir env _ <<<"$spec"
    gpu=""
    [ "$ngpu" -gt 0 ] && gpu=${gpus[$(( k % ngpu ))]}
    k=$(( k + 1 ))
    echo "--- start $name (tests/gpu/$dir${env:+, $env}${gpu:+, GPU $gpu})"
    run_piece "$name" "$dir" "$env" "$gpu" "$@" &
done
wait
for spec in "${alone[@]}"; do
    IFS='|' read -r name dir env mode <<<"$spec"
    if [ "$mode" = all-gpus ] && [ "$ngpu" -lt 2 ]; then  # tensor parallel: nothing to run it on, which is no failure
        line=$(printf 'gpu-tier %-24s not run: needs 2 GPUs, %d visible' "$name" "$ngpu")
        echo "0 0 0 0 $line" >"$STATE/$name"
        echo "$line"
        continue
    fi
    echo "--- start $name (tests/gpu/$dir${env:+, $env}, every GPU, alone)"
    run_piece "$name" "$dir" "$env" "" "$@"
done

overall=0 passed_total=0
for spec in "${selected[@]}"; do
    IFS='|' read -r name _ _ _ <<<"$spec"
    read -r rc p _ _ line <"$STATE/$name"
    [ "$rc" -ne 0 ] && overall=1
    passed_total=$(( passed_total + p ))
    echo "$line" >>"$summary"
done
echo "--- summary ($(( $(date +%s) - t_all )) s), logs in $OUTDIR"
cat "$summary"
for spec in "${selected[@]}"; do  # what failed, from each failing piece's short summary
    IFS='|' read -r name _ _ _ <<<"$spec"
    read -r rc _ <"$STATE/$name"
    if [ "$rc" -ne 0 ]; then
        echo "--- $name (rc=$rc): tail of $OUTDIR/$name-pytest.log"
        tail -25 "$OUTDIR/$name-pytest.log"
    fi
done
if [ "$overall" -eq 0 ] && [ "$passed_total" -eq 0 ]; then
    echo "run_gpu_tier.sh: no test passed (all skipped?): nothing was shown" | tee -a "$summary"
    exit 5
fi
exit "$overall"
