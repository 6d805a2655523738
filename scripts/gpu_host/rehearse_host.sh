#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Rehearse the GPU host's install on a machine without a GPU: a python 3.12 venv with the host
# image's versions (from its `pip list --format=freeze`) of every package the lock check looks
# at, then scripts/gpu_host/install.sh with the wheel set (the archive, or its parts one at a
# time) into a temporary site, then `lock_check.py installed` as the host runs it. Passes when
# the only drift left is the GPU wheels the venv goes without (torch, triton and their CUDA
# libraries, unless given with --wheels / --nvidia-from).
#
# Usage: scripts/gpu_host/rehearse_host.sh HOST_FREEZE [--python PY] [--venv DIR]
#            [--wheels DIR] [--nvidia-from SITE_PACKAGES] [--cuda-home DIR] [--wheel-set DIR]
#   --wheel-set DIR         the --out of build_wheelhouse.sh (default: .whl-e2e in the repository
#                           root): DIR holds the archive, or DIR-1, DIR-2, ... its parts
#   --wheels DIR            cp312 wheels installed into the venv as well (torch 2.11.0, triton 3.6.0)
#   --nvidia-from DIR       a site-packages whose nvidia/ CUDA 13 libraries the venv links (torch loads them)
#   --cuda-home DIR         a CUDA 13.0 toolkit with bin/nvcc, for the check's nvcc line
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() { echo "rehearse_host.sh: $*" >&2; exit 1; }
FREEZE=${1:?usage: rehearse_host.sh HOST_FREEZE [--python PY] [--venv DIR] [--wheels DIR] [--nvidia-from DIR] [--cuda-home DIR] [--wheel-set DIR]}
shift
PY=python3.12 VENV="$REPO/.cache/host-venv" EXTRA="" NVIDIA="" CUDA="" WHEEL_SET="$REPO/.whl-e2e"
while [ $# -gt 0 ]; do
    case $1 in
        --python) PY=$2; shift 2 ;;
        --venv) VENV=$2; shift 2 ;;
        --wheels) EXTRA=$2; shift 2 ;;
        --nvidia-from) NVIDIA=$2; shift 2 ;;
        --cuda-home) CUDA=$2; shift 2 ;;
        --wheel-set) WHEEL_SET=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
        --carry) WHEEL_SET=$(cd "$2" && pwd)/.whl-e2e; shift 2 ;;  # older spelling: the folder that holds .whl-e2e*
        *) die "unknown argument $1" ;;
    esac
done
[ -f "$FREEZE" ] || die "$FREEZE: no such file (the host's pip list --format=freeze)"
if [ -f "$WHEEL_SET/site.tar.xz" ]; then
    SOURCES=("$WHEEL_SET")
else
    mapfile -t SOURCES < <(ls -d "$WHEEL_SET"-[0-9]* 2>/dev/null | sort -V)
fi
[ ${#SOURCES[@]} -gt 0 ] || die "no wheel set at $WHEEL_SET (nor parts $WHEEL_SET-N): run scripts/gpu_host/build_wheelhouse.sh first"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || die "$PY is not python 3.12 (the host's)"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# The freeze's versions of what wheels.txt and host_provided.txt name, less the GPU wheels.
REQS="$VENV/host-reqs.txt"
"$VPY" - "$FREEZE" "$REPO/scripts/gpu_host" >"$REQS" <<'PY'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
listed = set()
for f in ("wheels.txt", "host_provided.txt"):
    for line in open(f"{sys.argv[2]}/{f}"):
        m = re.match(r"!?([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0].strip())
        if m:
            listed.add(norm(m[1]))
gpu = lambda n: n in {"torch", "triton", "torchvision", "torchaudio", "cuda-toolkit"} or (
    n.startswith("nvidia-") and n not in {"nvidia-ml-py", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvidia-cudnn-frontend"})
for line in open(sys.argv[1]):
    name = norm(line.split("==", 1)[0].strip())
    if "==" in line and name in listed and not gpu(name):
        print(line.strip())
PY
echo "== the host image's versions in $VENV ($(wc -l <"$REQS") packages)"
"$VPY" -m pip install -q --no-deps --only-binary=:all: -r "$REQS"
[ -z "$EXTRA" ] || "$VPY" -m pip install -q --no-deps "$EXTRA"/*.whl
if [ -n "$NVIDIA" ]; then
    SP=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$SP/nvidia"
    for d in "$NVIDIA"/nvidia/*/; do
        case $(basename "$d") in __pycache__|mathdx) ;; *) ln -sfn "${d%/}" "$SP/nvidia/$(basename "$d")" ;; esac
    done
fi

TMP=$(mktemp -d)
export DDTREE_SITE="$TMP/site" DDTREE_STAGE="$TMP/stage" PYTHON="$VPY" DDTREE_ALLOW_LOCK_DRIFT=1
export DDTREE_INSTALL_IMPORTS="sglang transformers flashinfer"
[ -z "$CUDA" ] || export CUDA_HOME="$CUDA"
for src in "${SOURCES[@]}"; do
    echo "== install.sh $(basename "$src")"
    (cd "$REPO" && bash scripts/gpu_host/install.sh "$src") | grep -v "^DRIFT  "
done
[ -f "$DDTREE_SITE/.ddtree-installed" ] || die "the series did not finish installing"

echo "== lock_check.py installed, as on the host"
set +e
PYTHONPATH="$DDTREE_SITE" "$VPY" "$REPO/scripts/gpu_host/lock_check.py" installed >"$TMP/check.txt"
set -e
cat "$TMP/check.txt"
# Drift is expected only for the GPU wheels this venv goes without.
"$VPY" - "$TMP/check.txt" "$REQS" <<'PY'
import importlib.metadata as md, re, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("DRIFT  ")]
absent = [l for l in lines if "not installed (host image)" in l]
nvcc = [l for l in lines if l.startswith(("DRIFT  nvcc ", "DRIFT  no nvcc found"))]
other = [l for l in lines if l not in absent and l not in nvcc]
if nvcc:
    print("rehearsal: the nvcc line is about this machine's toolkit; the host's is checked there:", nvcc[0].strip())
names = sorted(l.split()[1].rstrip(":") for l in absent)
print(f"rehearsal: {len(absent)} host-image packages absent from this venv (GPU wheels): {', '.join(names)}")
gpu = lambda n: n in {"torch", "triton", "torchvision", "torchaudio", "cuda-toolkit"} or n.startswith("nvidia-")
other += [l for l in absent if not gpu(l.split()[1].rstrip(":"))]
if other:
    print("rehearsal: FAILED, drift beyond the GPU wheels:", *other, sep="\n  ")
    sys.exit(1)
print("rehearsal: no drift besides those")
PY
echo "rehearsal: site in $DDTREE_SITE (PYTHONPATH=$DDTREE_SITE $VPY ...)"
