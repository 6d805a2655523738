# SPDX-License-Identifier: Apache-2.0
"""The top-level ``meta_info`` of a non-streaming chat completion.

With ``"return_meta_info": true`` upstream 0.5.17 puts each choice's ``meta_info``
inside that choice. The DFlash ecosystem's client (``dflash benchmark openai``, pip
package ``dflash``) reads speculative acceptance from the response's *top level*:
``meta_info.spec_accept_length`` (averaged over requests) and ``spec_verify_ct``
(summed), next to ``usage.completion_tokens``. This module gives the response that
top-level ``meta_info``; the per-choice field stays as upstream has it.

One choice: the choice's own ``meta_info``. Several (``n > 1``): the request as a
whole, with the counters summed over the choices and the ratios recomputed from the
sums, as upstream computes them per choice: ``spec_accept_length`` is completion
tokens over verify steps, ``spec_accept_rate`` accepted over proposed draft tokens.
So ``usage.completion_tokens`` (also a sum over choices) and ``spec_accept_length``
describe the same tokens.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

#: Per-choice counters that add up over the choices of one request.
SUMMED = (
    "completion_tokens",
    "reasoning_tokens",
    "spec_verify_ct",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
)


def response_meta_info(ret: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Top-level ``meta_info`` for the generation results ``ret`` of one chat
    request (one item per choice); None when there is nothing to report."""
    metas = [item.get("meta_info") for item in ret]
    metas = [m for m in metas if m]
    if not metas:
        return None
    if len(metas) == 1:
        return dict(metas[0])
    first = metas[0]
    out: Dict[str, Any] = {
        "id": first.get("id"),
        "n": len(metas),
        "prompt_tokens": first.get("prompt_tokens", 0),  # one prompt for every choice
    }
    for key in SUMMED:
        if any(key in m for m in metas):
            out[key] = sum(int(m.get(key, 0) or 0) for m in metas)
    latencies = [m["e2e_latency"] for m in metas if m.get("e2e_latency") is not None]
    if latencies:
        out["e2e_latency"] = max(latencies)
    verify = out.get("spec_verify_ct", 0)
    if verify > 0:
        out["spec_accept_length"] = out.get("completion_tokens", 0) / verify
        proposed = out.get("spec_num_proposed_drafts", 0)
        if proposed > 0:
            out["spec_accept_rate"] = out.get("spec_num_correct_drafts", 0) / proposed
    return out
