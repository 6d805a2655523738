# SPDX-License-Identifier: Apache-2.0
"""What a missing piece means here: on the GPU host (``DDTREE_GPU_HOST=1``, set by
scripts/gpu_host/run_gpu_tier.sh) a GPU, FlashInfer or FlashMLA that does not load
is a broken install, so the test fails; elsewhere it is skipped."""

import os

import pytest

from tests.gpu.conftest import NOT_APPLICABLE

ON_GPU_HOST = os.environ.get("DDTREE_GPU_HOST") == "1"


def unavailable(reason: str):
    if ON_GPU_HOST:
        pytest.fail(f"DDTREE_GPU_HOST=1 and this cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        unavailable("needs a CUDA GPU")


def require_flashinfer() -> None:
    from sglang.srt.layers.attention.tree_verify.flashinfer_split import flashinfer_reason

    reason = flashinfer_reason()
    if reason:
        unavailable(reason)


def require_flashmla() -> None:
    """FlashMLA on an sm_90/sm_100 GPU; on other GPUs it does not exist (a skip)."""
    import torch

    from sglang.srt.layers.attention.tree_verify.flashmla_split import FLASHMLA_MAJORS
    from sglang.srt.layers.attention.tree_verify.strategies import get_strategy

    cap = torch.cuda.get_device_capability()
    if cap[0] not in FLASHMLA_MAJORS:
        pytest.skip(NOT_APPLICABLE + "FlashMLA runs on sm_90/sm_100 only")
    reason = get_strategy("flashmla_split").unavailable(None, cap)
    if reason:
        unavailable(reason)
