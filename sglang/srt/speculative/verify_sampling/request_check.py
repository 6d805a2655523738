# SPDX-License-Identifier: Apache-2.0
"""Sampling requests the speculative verify cannot serve as the plain server would.

Checked when a request arrives (upstream's ``validate_dflash_request``, patch 0083), so
the client gets the reason instead of a changed output or a crashed scheduler.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.runtime_context import get_exec


def refusal(req: Any) -> Optional[str]:
    """Why ``req`` is refused, or None.

    Upstream aborts a refused request after a one-token prefill that samples with the
    request's own parameters, so a refused request is also made safe for that prefill.
    """
    params = req.sampling_params
    if getattr(req, "return_sampling_mask", False):
        return (
            "return_sampling_mask is not supported with DFLASH/DDTREE speculative decoding: "
            "the verify does not report the sampler's support per token."
        )
    if params.min_p > 0 and get_exec().deterministic.enable_deterministic_inference:
        # The seeded sampler asserts on min-p (in the scheduler, for the whole server).
        params.min_p = 0.0
        return (
            "min_p is not supported with --enable-deterministic-inference: SGLang's seeded "
            "sampler has no min-p path. Drop min_p or serve without deterministic inference."
        )
    return None
