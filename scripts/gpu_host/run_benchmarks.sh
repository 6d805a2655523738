#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The benchmarks behind docs/benchmarks.md's open rows, one after another within a time budget, on
# the GPU host (after scripts/gpu_host/install.sh; the learned pair, for `learned`,
# `learned_dflash2`, `sampling_check_dflash2`, `sampled_checks`, `learned_phases`, `learned_step_graphs`, `learned_verify_indices`, `learned_budgets`, `learned_graph_budgets`, `learned_large_batches`, `learned_sampled`, `learned_hostprof` and the
# sampling checks, in /tmp/learned-pair:
# docs/learned-pair.md).
#
#   scripts/gpu_host/run_benchmarks.sh [--only P,P] [--seconds S] [--out DIR] [--list] [--dry-run]
#
# Pieces run in the order listed (--list), or in the order --only gives. Each gets the time left
# (--seconds, default 1500, less a 20 s margin for the rest) but no more than its own limit,
# and is skipped when less than its estimate is left; a piece is stopped by `timeout` at its
# limit, and the benchmarks themselves stop earlier where they take a deadline. Results are
# named <what>_<gpu>_<date> (gpu: h100, h200, ... from nvidia-smi) and land in --out DIR (default
# /tmp/ddtree-out/bench) with one log per piece (<piece>.log) and benchmarks-summary.txt (one line
# per piece: ran or skipped, exit status, seconds). --dry-run prints the commands with the budget
# each would get, and runs nothing.
# Exits nonzero if a piece failed or was stopped.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"

# name|estimate s|limit s|command. {out} {gpu} {date} {deadline} are filled in per piece;
# {deadline} is the piece's limit less 15 s, for the benchmarks that fit themselves into one.
# The learned pair's DFlash 2 drafter, trained first where missing (~300 s on the GPU); the
# pieces after it take what is left of their deadline ($SECONDS: the piece's shell's age).
DFLASH2_DRAFTER='{ [ -d /tmp/learned-pair/drafter-dflash2 ] || python3 -m scripts.learned_pair add-drafter /tmp/learned-pair --kind dflash2 --deadline-s 300; }'
PIECES=(
    "floors|60|300|python3 -m benchmarks.sampling_floors --slices 8,16 --tag sampling_floors_{gpu}_{date} --out-dir {out}"
    "steps_qwen3|240|540|python3 -m benchmarks.e2e_step --target qwen3-8b --backend flashinfer --configs nospec,dflash,ddtree16 --ctx 1024,16384 --batch 1,8 --profile-host --deadline-s {deadline} --tag qwen3_8b_phases_{gpu}_{date} --out-dir {out}"
    "steps_v2lite|240|540|python3 -m benchmarks.e2e_step --target v2lite --configs nospec,dflash,ddtree16 --ctx 1024,16384 --batch 1,8 --profile-host --deadline-s {deadline} --tag v2lite_phases_{gpu}_{date} --out-dir {out}"
    "steps_v2lite_uniform|240|540|python3 -m benchmarks.e2e_step --target v2lite --configs nospec,dflash,ddtree16 --ctx 1024,16384 --batch 1,8 --expert-routing uniform --profile-host --deadline-s {deadline} --tag v2lite_uniform_routing_{gpu}_{date} --out-dir {out}"
    "steps_v2lite_tree|240|540|python3 -m benchmarks.e2e_step --target v2lite --configs nospec,dflash,ddtree16 --ctx 1024,16384 --batch 1,8 --expert-routing tree --profile-host --deadline-s {deadline} --tag v2lite_tree_routing_{gpu}_{date} --out-dir {out}"
    "steps_qwen36|300|560|python3 -m benchmarks.e2e_step --target qwen36-a3b --configs dflash,ddtree16,nospec --ctx 1024,16384 --batch 1 --profile-host --deadline-s {deadline} --tag qwen36_a3b_phases_{gpu}_{date} --out-dir {out}"
    "steps_gptoss|300|560|python3 -m benchmarks.e2e_step --target gptoss-20b --configs dflash,ddtree16,nospec --ctx 1024,16384 --batch 1,8 --profile-host --deadline-s {deadline} --tag gptoss_20b_phases_{gpu}_{date} --out-dir {out}"
    "steps_sampled|180|420|python3 -m benchmarks.e2e_step --target qwen3-8b --backend flashinfer --configs nospec,dflash,ddtree16 --ctx 1024 --batch 1,8 --sampling 0.7/20/0.8 --profile-host --deadline-s {deadline} --tag qwen3_8b_sampled_{gpu}_{date} --out-dir {out}"
    "learned|300|560|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/learned -- --configs nospec,dflash,ddtree16 --batch 1,8 --temperature 0,1 --repeats 3 --min-waves 8 --step-ctx 512 --sampling-max-s 0 --tag learned_{gpu}_{date}"
    "learned_phases|150|300|python3 -m benchmarks.e2e_step --target learned --models /tmp/learned-pair --configs nospec,dflash,ddtree16 --ctx 512 --batch 1,8 --profile-host --profile-at 512x1 --deadline-s {deadline} --tag learned_phases_{gpu}_{date} --out-dir {out}"
    "learned_step_graphs|360|560|python3 -m benchmarks.e2e_step --target learned --models /tmp/learned-pair --configs nospec,dflash,ddtree16,ddtree16-eager-segments --ctx 512 --batch 1,8 --start-estimate-s 90 --deadline-s {deadline} --tag learned_step_graphs_{gpu}_{date} --out-dir {out}"
    "learned_verify_indices|300|560|python3 -m benchmarks.e2e_step --target learned --models /tmp/learned-pair --configs dflash,dflash-torch-verify-indices,ddtree16,ddtree16-torch-verify-indices --ctx 512 --batch 1,8 --start-estimate-s 90 --deadline-s {deadline} --tag learned_verify_indices_{gpu}_{date} --out-dir {out}"
    "learned_budgets|420|560|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/learned_budgets -- --configs nospec,dflash,ddtree16,ddtree64 --batch 1,8 --temperature 0,1 --repeats 3 --min-waves 8 --sampling-max-s 0 --tag learned_budgets_{gpu}_{date}"
    "learned_graph_budgets|420|560|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/learned_graph_budgets -- --configs nospec,ddtree16,ddtree64,ddtree64-adaptive,ddtree64-adaptive-graphs16 --batch 1,8 --temperature 0,1 --repeats 3 --min-waves 8 --sampling-max-s 0 --tag learned_graph_budgets_{gpu}_{date}"
    "learned_large_batches|420|560|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/learned_large_batches -- --configs nospec,dflash,ddtree16,ddtree64-adaptive-graphs16 --batch 32,64 --temperature 0,1 --repeats 3 --min-waves 4 --sampling-max-s 0 --tag learned_large_batches_{gpu}_{date}"
    "learned_sampled|300|560|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/learned_sampled -- --configs nospec,dflash,ddtree64-adaptive-graphs16 --batch 1,8 --sampling 0.7/20/0.8,1 --repeats 3 --sampling-max-s 0 --tag learned_sampled_{gpu}_{date}"
    "learned_hostprof|150|300|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/learned_hostprof -- --configs nospec,dflash,ddtree16 --batch 1 --temperature 0,1 --repeats 1 --sampling-max-s 0 --py-spy dflash,ddtree16 --tag learned_hostprof_{gpu}_{date} && python3 -m benchmarks.host_profile {out}/learned_hostprof/hostprof_learned_hostprof_{gpu}_{date}_dflash.json {out}/learned_hostprof/hostprof_learned_hostprof_{gpu}_{date}_ddtree16.json --tag learned_{gpu}_{date} --out-dir {out}"
    "steps_v2lite_routes|420|600|python3 -m benchmarks.e2e_step --target v2lite --configs dflash@auto+sm120,ddtree16@auto+sm120,dflash@auto,ddtree16@auto --ctx 1024,16384 --batch 1 --deadline-s {deadline} --tag v2lite_routes_{gpu}_{date} --out-dir {out}"
    "learned_dflash2|600|900|$DFLASH2_DRAFTER && bash scripts/learned_pair/serve_sweep.sh --seconds \$(( {deadline} - SECONDS )) --out {out}/learned_dflash2 -- --draft-model-path /tmp/learned-pair/drafter-dflash2 --extra-drafter dflash1=/tmp/learned-pair/drafter --configs nospec,dflash-with-dflash1,dflash,ddtree16-with-dflash1,ddtree16,ddtree16-transitions --batch 1,8 --temperature 0,1 --repeats 3 --sampling-max-s 0 --tag learned_dflash2_{gpu}_{date}"
    "sampling_check|600|900|python3 -m benchmarks.sampling_boundaries /tmp/learned-pair/target --prompts /tmp/learned-pair/prompts.jsonl --settings temperature=0.7:top_k=20:top_p=0.8:min_p=0.05 --positions 4 --best 1 --write {out}/sampling_prompts_decided.json --tag learned_prompts_{gpu}_{date} --out-dir {out} && bash scripts/learned_pair/serve_sweep.sh --seconds \$(( {deadline} - 150 )) --out {out}/sampling_check -- --configs nospec,dflash,ddtree64-adaptive-graphs16 --sampling-ddtree ddtree64-adaptive-graphs16 --batch 1 --temperature 0 --num-prompts 4 --sampling-prompts {out}/sampling_prompts_decided.json --sampling-samples 27000 --sampling-max-s \$(( {deadline} - 300 )) --tag learned_sampling_check_{gpu}_{date}"
    "sampling_check_t1|420|540|bash scripts/learned_pair/serve_sweep.sh --seconds {deadline} --out {out}/sampling_check_t1 -- --configs nospec,dflash,ddtree64-adaptive-graphs16 --sampling-ddtree ddtree64-adaptive-graphs16 --batch 1 --temperature 0 --num-prompts 4 --sampling-samples 27000 --sampling-settings temperature=1:repetition_penalty=1.1 --sampling-boundary-delta 0 --sampling-max-s \$(( {deadline} - 120 )) --tag learned_sampling_check_t1_rep_{gpu}_{date}"
    "sampling_check_dflash2|600|900|$DFLASH2_DRAFTER && bash scripts/learned_pair/serve_sweep.sh --seconds \$(( {deadline} - SECONDS )) --out {out}/sampling_check_dflash2 -- --draft-model-path /tmp/learned-pair/drafter-dflash2 --configs nospec,dflash,ddtree16-transitions --sampling-ddtree ddtree16-transitions --batch 1 --temperature 0 --num-prompts 4 --sampling-samples 27000 --sampling-settings temperature=1:repetition_penalty=1.1 --sampling-boundary-delta 0 --sampling-max-s \$(( {deadline} - SECONDS - 120 )) --tag learned_sampling_check_dflash2_{gpu}_{date}"
    "sampled_checks|900|1500|$DFLASH2_DRAFTER && python3 -m benchmarks.sampling_boundaries /tmp/learned-pair/target --prompts /tmp/learned-pair/prompts.jsonl --settings temperature=0.7:top_k=20:top_p=0.8:min_p=0.05 --positions 4 --best 1 --write {out}/sampling_prompts_decided.json --tag learned_prompts_{gpu}_{date} --out-dir {out} && bash scripts/learned_pair/serve_sweep.sh --seconds \$(( {deadline} - SECONDS )) --out {out}/sampled_checks -- --extra-drafter dflash2=/tmp/learned-pair/drafter-dflash2 --configs nospec,dflash,ddtree64-adaptive-graphs16,dflash-with-dflash2,ddtree16-transitions-with-dflash2 --sampling-configs dflash,ddtree64-adaptive-graphs16,dflash-with-dflash2,ddtree16-transitions-with-dflash2 --batch 1 --sampling 0,0.7/20/0.8,1 --repeats 3 --sampling-prompts {out}/sampling_prompts_decided.json --sampling-samples 27000 --sampling-settings temperature=0.7:top_k=20:top_p=0.8:min_p=0.05,temperature=1:repetition_penalty=1.1 --sampling-max-s 1200 --tag learned_sampled_checks_{gpu}_{date}"
    "tables_mla_proxy|240|540|python3 benchmarks/verify_strategy_table.py --sm120-proxy --deadline-s {deadline} --tag {gpu}_sm120_proxy_{date} --out-dir {out} --table {out}/strategy_table.json"
    "tables_gqa_proxy|240|540|python3 benchmarks/verify_strategy_table.py --attn gqa --sm120-proxy --strategies fused,flashinfer_split,xqa --deadline-s {deadline} --tag {gpu}_sm120_proxy_gqa_{date} --out-dir {out} --table {out}/strategy_table.json"
    "tables_sm90|240|540|python3 benchmarks/verify_strategy_table.py --deadline-s {deadline} --tag {gpu}_{date} --out-dir {out} --table {out}/strategy_table.json"
    "sampling_cost|120|400|python3 -m benchmarks.verify_sampling_cost --tag verify_sampling_cost_{gpu}_{date} --out-dir {out}"
    "soak|480|600|bash scripts/gpu_host/run_gpu_tier.sh --only soak --out {out}/soak"
)
MARGIN_S=20

usage() { sed -n '3,18p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "run_benchmarks.sh: $*" >&2; exit 2; }
only="" seconds=1500 list=0 dry=0 OUTDIR=/tmp/ddtree-out/bench
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only=${2:?--only needs a comma list}; shift 2 ;;
        --only=*) only=${1#--only=}; shift ;;
        --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
        --seconds=*) seconds=${1#--seconds=}; shift ;;
        --out) OUTDIR=${2:?--out needs a directory}; shift 2 ;;
        --out=*) OUTDIR=${1#--out=}; shift ;;
        --list) list=1; shift ;;
        --dry-run) dry=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || die "--seconds takes a whole number of seconds, got '$seconds'"

declare -A EST LIMIT CMD
names=()
for p in "${PIECES[@]}"; do
    IFS='|' read -r name est limit cmd <<<"$p"
    names+=("$name"); EST[$name]=$est; LIMIT[$name]=$limit; CMD[$name]=$cmd
done
if [ "$list" = 1 ]; then
    for n in "${names[@]}"; do printf '%-18s ~%4s s (at most %s s)  %s\n' "$n" "${EST[$n]}" "${LIMIT[$n]}" "${CMD[$n]}"; done
    exit 0
fi
if [ -n "$only" ]; then
    IFS=, read -r -a chosen <<<"$only"
    for n in "${chosen[@]}"; do
        [ -n "${CMD[$n]+x}" ] || die "no piece '$n'; pieces: ${names[*]}"
    done
else
    chosen=("${names[@]}")
fi

gpu=cpu
if command -v nvidia-smi >/dev/null 2>&1; then
    model=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    gpu=$(grep -oiE '[A-Z]?[0-9]{2,4}' <<<"${model#NVIDIA }" | head -1 | tr 'A-Z' 'a-z')
    [ -n "$gpu" ] || gpu=gpu
fi
date_tag=$(date +%Y-%m-%d)
[ "$dry" = 1 ] || { mkdir -p "$OUTDIR" && source scripts/gpu_host/env.sh; } || die "cannot prepare $OUTDIR"
summary="$OUTDIR/benchmarks-summary.txt"
[ "$dry" = 1 ] || : >"$summary"

t0=$(date +%s) failed=0
for n in "${chosen[@]}"; do
    left=$(( seconds - ($(date +%s) - t0) - MARGIN_S ))
    budget=$(( left < LIMIT[$n] ? left : LIMIT[$n] ))
    if [ "$budget" -lt "${EST[$n]}" ]; then
        line="$n skipped: ${left} s left, ~${EST[$n]} s needed"
        echo "$line"; [ "$dry" = 1 ] || echo "$line" >>"$summary"
        continue
    fi
    cmd=${CMD[$n]//\{out\}/$OUTDIR}
    cmd=${cmd//\{gpu\}/$gpu}
    cmd=${cmd//\{date\}/$date_tag}
    cmd=${cmd//\{deadline\}/$(( budget - 15 ))}
    if [ "$dry" = 1 ]; then
        echo "$n (${budget} s): $cmd"
        # a dry run charges each piece its estimate, so the skips it shows are the real run's
        t0=$(( t0 - EST[$n] ))
        continue
    fi
    echo "[$n] ${budget} s: $cmd"
    start=$(date +%s)
    timeout --kill-after=10 "$budget" bash -c "$cmd" >"$OUTDIR/$n.log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    [ "$rc" = 0 ] || failed=1
    line="$n rc=$rc ${took} s$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ' (stopped at its limit)')"
    echo "$line"; echo "$line" >>"$summary"
done
exit "$failed"
