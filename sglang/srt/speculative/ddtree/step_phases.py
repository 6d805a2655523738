# SPDX-License-Identifier: Apache-2.0
"""Named ranges around the phases of a DDTREE decode step, for the server's torch profiler.

``benchmarks/e2e_profile.phase_breakdown`` charges each GPU kernel of a traced step to the
innermost range its launch ran in, so one trace says what the drafter, the tree, the verify,
the draw and the commit cost, on the host and on the GPU. The ranges open only while a
profiler records: an untraced step pays one flag read per phase.
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "ddtree."
#: ``step`` holds the others: the decode step from the worker's entry to its result.
PHASES = ("step", "draft", "tree", "verify", "sample", "commit", "draft_context")


def phase(name: str):
    """A profiler range ``ddtree.<name>`` while a profiler records, else nothing."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    if name not in PHASES:
        raise ValueError(f"unknown DDTREE step phase {name!r}; known: {', '.join(PHASES)}")
    return torch.profiler.record_function(PREFIX + name)
