#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The learned pair through the real server on the GPU host, in one run: the budget sweep
# (no speculation, DFLASH, DDTREE at each budget; batch 1 and 8; T=0 and T=1), the decode
# step times the cost model needs, and the two-sample sampling check, all on one set of
# servers started together (benchmarks/budget_sweep.py --launch).
#
# Usage, on the host, in the repo root, after scripts/gpu_host/install.sh:
#   bash scripts/learned_pair/serve_sweep.sh [--pair DIR] [--parts DIR,DIR] [--seconds S] [--out DIR] [-- sweep args]
# The pair is --pair (default /tmp/learned-pair, where `python3 -m scripts.learned_pair build`
# left it on this machine); if it is missing there it is reassembled from --parts (folders
# holding its pair.tar.NN parts). Everything lands in --out DIR (default: the OUT environment
# variable if set, else /tmp/learned-out): the sweep JSON and PNG, sweep.log, the server logs as
# sweep-logs.tgz. --seconds is the time this script may use (default 520); the sweep's deadline
# is what is left after setup, less the packing, and a timeout stops it 10 s after that.
# Arguments after -- override the sweep's, so the work can be split over two runs of about ten
# minutes each: batch 1 (`-- --batch 1 --sampling-max-s 0 --tag learned_h200_b1`) and batch 8
# with the sampling check (`-- --batch 8 --tag learned_h200_b8`); budget_sweep.py --report
# merges the two (docs/learned-pair.md).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
t0=$(date +%s)
PAIR=/tmp/learned-pair PARTS="" SECONDS_TOTAL=520 OUTDIR=${OUT:-/tmp/learned-out}
while [ $# -gt 0 ]; do
    case "$1" in
        --pair) PAIR=$2; shift 2 ;;
        --parts) PARTS=$2; shift 2 ;;
        --seconds) SECONDS_TOTAL=$2; shift 2 ;;
        --out) OUTDIR=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "serve_sweep.sh: unknown argument $1 (sweep arguments go after --)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUTDIR"
source scripts/gpu_host/env.sh
PY=${PYTHON:-python3}

if [ ! -f "$PAIR/manifest.json" ]; then
    [ -n "$PARTS" ] || { echo "serve_sweep.sh: no pair in $PAIR and no --parts to rebuild it from" >&2; exit 1; }
    IFS=, read -r -a part_dirs <<<"$PARTS"
    "$PY" -m scripts.learned_pair unpack "${part_dirs[@]}" --to "$PAIR" || exit 1
fi
# The server's transformers must read the tokenizer the build wrote: fail here, not in 8 servers.
"$PY" - "$PAIR/target" <<'PY' || { echo "serve_sweep.sh: the pair's tokenizer does not load" >&2; exit 1; }
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
assert tok.convert_tokens_to_ids("<|MASK|>") == 2, "mask token id"
print("tokenizer ok:", type(tok).__name__, len(tok))
PY

left=$(( SECONDS_TOTAL - ($(date +%s) - t0) - 20 ))
LOGS=/tmp/learned-sweep-logs
rm -rf "$LOGS"
# The deadline is the sweep's plan; the timeout holds the script to --seconds if a server or
# the sampling check overruns it (SIGINT: the sweep stops its servers, its JSON holds every
# point measured so far).
timeout -s INT -k 15 "$(( left + 10 ))" "$PY" benchmarks/budget_sweep.py --launch \
    --model-path "$PAIR/target" --draft-model-path "$PAIR/drafter" \
    --configs nospec,dflash,ddtree4,ddtree8,ddtree16,ddtree32,ddtree64,ddtree128 \
    --prompts "$PAIR/prompts.jsonl" --num-prompts 16 --max-new-tokens 256 \
    --batch 1,8 --temperature 0,1 --step-ctx 512 \
    --sampling-check --sampling-prompts "$PAIR/sampling_prompts.json" --sampling-samples 3000 \
    --deadline-s "$left" --log-dir "$LOGS" --tag learned_h200 --out-dir "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/sweep.log"
rc=${PIPESTATUS[0]}
tar czf "$OUTDIR/sweep-logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
echo "serve_sweep.sh: rc=$rc after $(( $(date +%s) - t0 )) s"
exit "$rc"
