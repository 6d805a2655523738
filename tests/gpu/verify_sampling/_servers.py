# SPDX-License-Identifier: Apache-2.0
"""The verify-sampling suite's server matrix, shared by its conftest and tests.

``VERIFY_SAMPLING_TARGETS`` (default ``mla,qwen3``) picks the tiny test targets whose servers
start; the learned pair's start when ``DDTREE_LEARNED_PAIR`` names one.
"""

import os

#: target -> (test model, attention backend)
ALL_TARGETS = {"mla": ("tiny-mla", "triton"), "qwen3": ("tiny-qwen3", "flashinfer")}
TARGETS = {t: ALL_TARGETS[t] for t in os.environ.get("VERIFY_SAMPLING_TARGETS", "mla,qwen3").split(",") if t}
#: The speculative configurations checked against the server without speculation, per target:
#: CUDA graphs and the overlap scheduler (the defaults), and on the MLA target also DDTREE
#: eager and synchronous (the other code paths of the same step).
SPECULATIVE = {
    "mla": ("dflash", "ddtree16", "ddtree64", "ddtree16_eager"),
    "qwen3": ("dflash", "ddtree16", "ddtree64"),
    "pair": ("dflash", "ddtree16"),
}
