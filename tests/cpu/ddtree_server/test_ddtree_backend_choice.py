# SPDX-License-Identifier: Apache-2.0
"""DDTREE with no attention-backend flag verifies on a backend that can apply the tree
mask, on every GPU: where upstream's default cannot (FA3 on sm_90), the tree-capable
default is chosen and logged; a backend the user asked for is still refused.

The real patched ``ServerArgs`` runs on this CPU machine; only the GPU that torch
reports is faked (its capability, name and memory), and sglang's cached arch
predicates are cleared around each case so they read it.
"""

from __future__ import annotations

import contextlib
import logging

import pytest

from sglang.srt.server_args import ServerArgs

H200 = ((9, 0), "NVIDIA H200", 143771)
B200 = ((10, 0), "NVIDIA B200", 183359)
RTX_PRO_6000 = ((12, 0), "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887)
A100 = ((8, 0), "NVIDIA A100-SXM4-80GB", 81920)


def _clear_arch_caches():
    from sglang.srt.utils import common

    for name in dir(common):
        fn = getattr(common, name)
        if callable(fn) and hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def _gpu(gpu):
    import torch

    from sglang.srt import server_args as server_args_module

    cap, name, mib = gpu
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        mp.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        mp.setattr(server_args_module, "get_device_memory_capacity", lambda device=None: mib)
        _clear_arch_caches()
        try:
            yield
        finally:
            _clear_arch_caches()
    _clear_arch_caches()


def _server_args(model_dirs, target, algorithm, **kw):
    return ServerArgs(
        model_path=model_dirs[target],
        speculative_algorithm=algorithm,
        speculative_draft_model_path=model_dirs["draft"],
        device="cuda",
        skip_tokenizer_init=True,
        **kw,
    )


@pytest.fixture(scope="module", autouse=True)
def imported(model_dirs):
    """Everything ServerArgs imports lazily is imported before a GPU is faked: some
    modules probe CUDA at import time, which must see this machine's (none)."""
    for target in ("mla", "mha"):
        _server_args(model_dirs, target, "DDTREE")


def serve(model_dirs, gpu, target="mla", algorithm="DDTREE", **kw):
    with _gpu(gpu):
        return _server_args(model_dirs, target, algorithm, **kw)


def backends(sa):
    prefill, decode = sa.get_attention_backends()
    return prefill, decode, sa.speculative_draft_attention_backend


@pytest.mark.parametrize(
    "gpu,target,expected",
    [
        (H200, "mla", "triton"),  # upstream's default: fa3, which has no tree mask
        (H200, "mha", "flashinfer"),  # likewise fa3
        (B200, "mla", "flashinfer"),  # upstream's default already verifies trees
        (B200, "mha", "flashinfer"),
        (RTX_PRO_6000, "mla", "triton"),
        (RTX_PRO_6000, "mha", "flashinfer"),
        (A100, "mla", "triton"),
        (A100, "mha", "flashinfer"),
    ],
    ids=["sm90-mla", "sm90-mha", "sm100-mla", "sm100-mha", "sm120-mla", "sm120-mha", "sm80-mla", "sm80-mha"],
)  # fmt: skip
def test_unset_backend_verifies_trees(model_dirs, gpu, target, expected):
    """Prefill (the verify role), decode and the drafter all run the chosen backend."""
    sa = serve(model_dirs, gpu, target)
    assert backends(sa) == (expected, expected, expected)


def test_the_choice_is_logged(model_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="sglang.srt.speculative.ddtree.flags"):
        serve(model_dirs, H200, "mla")
    (line,) = [r.getMessage() for r in caplog.records if "cannot verify a token tree" in r.getMessage()]
    assert "'fa3'" in line and "compute capability 9.0" in line and "'triton'" in line
    assert "--attention-backend" in line


def test_upstream_default_is_kept_for_dflash(model_dirs):
    """DFLASH verifies a chain: upstream's FA3 default on sm_90 is left alone."""
    sa = serve(model_dirs, H200, "mla", algorithm="DFLASH")
    assert sa.get_attention_backends() == ("fa3", "fa3")


@pytest.mark.parametrize(
    "kw,where",
    [
        (dict(attention_backend="fa3"), "'fa3'"),
        (dict(prefill_attention_backend="fa3", decode_attention_backend="triton"), "'fa3'"),
    ],
)
def test_an_explicit_backend_without_tree_mask_is_refused(model_dirs, kw, where):
    with pytest.raises(ValueError, match=f"verify backend {where} has none for MLA models on compute capability 9.0"):
        serve(model_dirs, H200, "mla", **kw)


def test_a_defaulted_verify_role_is_chosen_beside_an_explicit_decode_backend(model_dirs):
    """Only the decode backend was asked for; the verify (prefill) role was defaulted."""
    sa = serve(model_dirs, H200, "mla", decode_attention_backend="flashinfer")
    assert sa.get_attention_backends() == ("triton", "flashinfer")
