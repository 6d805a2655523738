# SPDX-License-Identifier: Apache-2.0
"""The ``scores_via_scratch`` prefix loop (absorbed MLA: K.Q^T scores, P handed
to the PV product through a per-program global scratch) under
TRITON_INTERPRET=1 against the fp32 reference, at the real 576/512 dims with V
a view of K (fp16: triton 3.6's interpreter mis-computes bf16 tl.dot)."""

import dataclasses

import pytest
import torch

from sglang.srt.layers.attention.tree_verify.configs import (
    TreeVerifyConfig,
    configs_for_arch,
)

from _interp import interpreted_prefix_split
from test_fused_interpreter import check, fp8_kv, make_case

SCRATCH = TreeVerifyConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, scores_via_scratch=True)
# q_as_b applies to the tree tail only.
SCRATCH_QB = dataclasses.replace(SCRATCH, q_as_b=True)


@pytest.mark.parametrize(
    "prefix_lens,n,h,splits",
    [
        ([70], 5, 3, None),  # not a multiple of 64
        ([70], 5, 3, 2),  # second slice a 6-key remainder
        ([128], 4, 16, 2),  # whole tiles, all 64 rows of the tile used
        ([100, 37], 9, 4, 3),  # ragged batch of 2
        ([0], 7, 5, None),  # empty prefix: the tail only
        ([0, 65], 3, 2, 2),  # an empty and a non-empty prefix in one batch
        ([200], 17, 8, 1),  # 2 row tiles, 4 tiles in one slice
        ([10, 3], 2, 1, 4),  # more splits than tiles (empty slices)
    ],
)
def test_mla_scores_via_scratch(prefix_lens, n, h, splits):
    case = make_case(sum(prefix_lens) + 7 * n + h, prefix_lens, n, h, 1, 576, 512, True)
    check(case, 576**-0.5, SCRATCH, splits)


def test_mla_in_miniature():
    # The same layout at 64 latent + 16 rope dims (the other tests' miniature).
    case = make_case(36, [75, 130], 5, 3, 1, 80, 64, True)
    check(case, 0.125, SCRATCH, 2)


def test_tail_with_q_as_b():
    case = make_case(31, [90, 5], 6, 3, 1, 576, 512, True)
    check(case, 576**-0.5, SCRATCH_QB, 2)


def test_logit_cap():
    case = make_case(32, [77], 5, 4, 1, 576, 512, True)
    check(case, 0.5 * 576**-0.5, SCRATCH, 2, cap=2.0)


def test_fp8_kv_cache():
    case = fp8_kv(make_case(33, [80, 0], 3, 2, 1, 576, 512, True), 1.5, 1.5, True)
    check(case, 576**-0.5, SCRATCH, None, kv_scales=(1.5, 1.5))


def test_same_result_as_default_loop():
    # Same inputs, same splits: the two prefix loops agree closely.
    ps = interpreted_prefix_split()
    case = make_case(34, [150], 5, 4, 1, 576, 512, True)
    base = TreeVerifyConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    a = ps.tree_verify_fused(*case, 576**-0.5, None, 0.0, base, num_splits=2)
    b = ps.tree_verify_fused(*case, 576**-0.5, None, 0.0, SCRATCH, num_splits=2)
    assert (a.float() - b.float()).abs().max().item() < 2e-3


def test_config_requires_64_key_tiles_and_no_other_prefix_loop():
    with pytest.raises(ValueError, match="block_n=64"):
        TreeVerifyConfig(64, 32, 8, 3, scores_via_scratch=True)
    with pytest.raises(ValueError, match="qk_ahead"):
        TreeVerifyConfig(64, 64, 8, 2, qk_ahead=True, scores_via_scratch=True)
    with pytest.raises(ValueError, match="dv_split"):
        TreeVerifyConfig(64, 64, 8, 2, dv_split=2, scores_via_scratch=True)
    with pytest.raises(ValueError, match="reuse_k_tile"):
        TreeVerifyConfig(64, 64, 8, 2, reuse_k_tile=False, scores_via_scratch=True)


@pytest.mark.parametrize(
    "dqk,dv,shared",
    [(576, 512, False), (128, 128, False), (64, 64, True)],
    ids=["mla-separate-v", "gqa", "no-rope"],
)
def test_refuses_other_than_mla_shared_kv(dqk, dv, shared):
    ps = interpreted_prefix_split()
    case = make_case(35, [20], 2, 2, 1, dqk, dv, shared)
    with pytest.raises(ValueError, match="scores_via_scratch"):
        ps.tree_verify_fused(*case, dqk**-0.5, None, 0.0, SCRATCH, num_splits=1)


def test_only_the_227_kib_archs_absorbed_mla_tile_uses_it():
    """Measured on the H200 (2026-11-30); the tile needs 229,376 B of shared memory."""
    assert not TreeVerifyConfig(64, 64, 8, 2).scores_via_scratch
    for arch in ((9, 0), (10, 0)):
        users = {k for k, c in configs_for_arch(arch).items() if c.scores_via_scratch}
        assert users == {"mla"}
    for arch in ((8, 0), (8, 6), (12, 0), (12, 1)):  # 163 / 99 KiB
        assert not any(c.scores_via_scratch for c in configs_for_arch(arch).values())
    assert configs_for_arch((8, 0))["mla"] == TreeVerifyConfig(64, 32, 8, 3)
