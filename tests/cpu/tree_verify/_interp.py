# SPDX-License-Identifier: Apache-2.0
"""Load private, interpreted copies of the tree-verify Triton kernels.

Triton decides between compiling and interpreting when ``@triton.jit`` runs,
so the kernels are re-executed from their source file with
``TRITON_INTERPRET=1`` set only for that moment. The package's own (compiled)
kernels stay untouched for the ahead-of-time compile tests in this process.
"""

import functools
import importlib.util
import os
import sys

import torch

import sglang.srt.layers.attention.tree_verify.flashmla_split as _flashmla_split
import sglang.srt.layers.attention.tree_verify.prefix_split as _prefix_split


def _interpreted(compiled, kernel: str):
    """A fresh copy of ``compiled`` whose ``@triton.jit`` kernels interpret."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(
            f"_{compiled.__name__.rsplit('.', 1)[-1]}_interpreted", compiled.__file__
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(getattr(module, kernel), InterpretedFunction)
    return module


@functools.lru_cache(maxsize=1)
def interpreted_prefix_split():
    return _interpreted(_prefix_split, "_tree_verify_split_kernel")


@functools.lru_cache(maxsize=1)
def interpreted_flashmla_split():
    return _interpreted(_flashmla_split, "_tree_verify_page_gather_kernel")


def random_parents(bs: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random trees in DDTree order (every parent index below its child's)."""
    parents = torch.full((bs, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=gen)
    return parents
