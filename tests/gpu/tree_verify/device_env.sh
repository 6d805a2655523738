# SPDX-License-Identifier: Apache-2.0
# Source on the GPU test host (no network, no full sglang install) to import
# the tree_verify overlay plus upstream's UNMODIFIED Triton extend kernel:
#   source tests/gpu/tree_verify/device_env.sh [DIR_WITH_UPSTREAM_KERNELS]
# DIR holds extend_attention.py, decode_attention.py, prefill_attention.py and
# score_mod.py from sglang-0.5.17's wheel (sglang/kernels/ops/attention/).
# Upstream's sglang/__init__.py and sglang.srt.utils pull in the whole server
# stack; these four kernel files need only is_cuda/is_hip/is_gfx95_supported,
# so a minimal sglang.srt.utils provides those next to our gpu_arch.py.
# On a host with the patched sglang installed none of this is needed.
_tv_up="${1:-.whl-tv/upstream}"
_tv_root=/tmp/tv-sglang
rm -rf "$_tv_root" && mkdir -p "$_tv_root/sglang"
: > "$_tv_root/sglang/__init__.py"
cp -r sglang/srt "$_tv_root/sglang/srt"
cat > "$_tv_root/sglang/srt/utils/__init__.py" <<'PY'
import torch


def is_cuda():
    return torch.version.cuda is not None and torch.cuda.is_available()


def is_hip():
    return torch.version.hip is not None


def is_gfx95_supported():
    return False
PY
if [ -d "$_tv_up" ]; then
  mkdir -p "$_tv_root/sglang/kernels/ops/attention"
  cp "$_tv_up"/*.py "$_tv_root/sglang/kernels/ops/attention/"
fi
export PYTHONPATH="$_tv_root${PYTHONPATH:+:$PYTHONPATH}"
unset _tv_up _tv_root
