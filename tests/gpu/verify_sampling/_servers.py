# SPDX-License-Identifier: Apache-2.0
"""The verify-sampling suite's server matrix, shared by its conftest and tests."""

#: target -> (test model, attention backend)
TARGETS = {"mla": ("tiny-mla", "triton"), "qwen3": ("tiny-qwen3", "flashinfer")}
#: The speculative configurations checked against the server without speculation, per target:
#: CUDA graphs and the overlap scheduler (the defaults), and on the MLA target also DDTREE
#: eager and synchronous (the other code paths of the same step).
SPECULATIVE = {
    "mla": ("dflash", "ddtree16", "ddtree64", "ddtree16_eager"),
    "qwen3": ("dflash", "ddtree16", "ddtree64"),
}
