# SPDX-License-Identifier: Apache-2.0
"""The verify-sampling suite's server matrix, shared by its conftest and tests."""

#: target -> (test model, attention backend)
TARGETS = {"mla": ("tiny-mla", "triton"), "qwen3": ("tiny-qwen3", "flashinfer")}
#: The speculative configurations checked against the server without speculation.
SPECULATIVE = ("dflash", "ddtree16", "ddtree64")
