#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Rehearse the GPU host's install on a machine without a GPU: a python 3.12 venv with the host
# image's versions (from its `pip list --format=freeze`) of every package the lock check looks
# at, then scripts/gpu_host/install.sh once per carry folder (.whl-e2e-1, -2, ...) into a
# temporary site, then `lock_check.py installed` as the host runs it. Passes when the only
# drift left is the GPU wheels the venv goes without (torch, triton and their CUDA libraries,
# unless given with --wheels / --nvidia-from).
#
# Usage: scripts/gpu_host/rehearse_host.sh HOST_FREEZE [--python PY] [--venv DIR]
#            [--wheels DIR] [--nvidia-from SITE_PACKAGES] [--cuda-home DIR] [--carry DIR]
#   --carry DIR             where the .whl-e2e-N folders are (default: the repo root)
#   --wheels DIR            cp312 wheels installed into the venv as well (torch 2.11.0, triton 3.6.0)
#   --nvidia-from DIR       a site-packages whose nvidia/ CUDA 13 libraries the venv links (torch loads them)
#   --cuda-home DIR         a CUDA 13.0 toolkit with bin/nvcc, for the check's nvcc line
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() { echo "rehearse_host.sh: $*" >&2; exit 1; }
FREEZE=${1:?usage: rehearse_host.sh HOST_FREEZE [--python PY] [--venv DIR] [--wheels DIR] [--nvidia-from DIR] [--cuda-home DIR]}
shift
PY=python3.12 VENV="$REPO/.cache/host-venv" EXTRA="" NVIDIA="" CUDA="" CARRY="$REPO"
while [ $# -gt 0 ]; do
    case $1 in
        --python) PY=$2; shift 2 ;;
        --venv) VENV=$2; shift 2 ;;
        --wheels) EXTRA=$2; shift 2 ;;
        --nvidia-from) NVIDIA=$2; shift 2 ;;
        --cuda-home) CUDA=$2; shift 2 ;;
        --carry) CARRY=$(cd "$2" && pwd); shift 2 ;;
        *) die "unknown argument $1" ;;
    esac
done
[ -f "$FREEZE" ] || die "$FREEZE: no such file (the host's pip list --format=freeze)"
ls -d "$CARRY"/.whl-e2e-1 >/dev/null 2>&1 || die "no $CARRY/.whl-e2e-1: run scripts/gpu_host/build_wheelhouse.sh first"

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
for carry in $(ls -d "$CARRY"/.whl-e2e-* | sort -V); do
    echo "== install.sh $(basename "$carry")"
    (cd "$REPO" && bash scripts/gpu_host/install.sh "$carry") | grep -v "^DRIFT  "
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
