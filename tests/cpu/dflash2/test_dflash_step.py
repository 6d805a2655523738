# SPDX-License-Identifier: Apache-2.0
"""DFLASH with a DFlash 2 drafter: upstream's ``DFlashWorkerV2.forward_batch_generation``
(patched, patch 0056) on the CPU, with stand-in model forwards (``benchmarks.step_ops``)
and the fixture's real DFlash 2 drafter for the selector.

- Greedy: the verified chain is ``[bonus, the selector's argmax path]`` over the draft
  forward's hidden states, and the folded greedy head is not used.
- Sampling: the step hands upstream's rejection-sampling chain kernel the walk's q at
  the candidates (and zeros elsewhere), and the kept buffer is all zeros afterwards.
- Lossless at T > 0: drawing the path from q and accepting it against q reproduces
  the target's distribution at the first position (the kernel under the Triton
  interpreter, many requests in one launch).
- ``attach`` hands the drafter the worker's block; every hook is a no-op for a DFlash
  drafter.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from benchmarks import step_ops
from sglang.srt.speculative.ddtree.tree_build import triton_interpreted
from sglang.srt.speculative.dflash2 import dflash_step
from sglang.srt.speculative.dflash2.selector import walk
from tests.cpu.dflash2 import harness

pytestmark = pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")

VOCAB = harness.CONFIG["vocab_size"]


class _World(step_ops.StepWorld):
    HIDDEN = harness.CONFIG["hidden_size"]

    def __init__(self, drafter, bs, block, *, seed=0):
        super().__init__("DFLASH", bs, 0, block, VOCAB, seed=seed)
        self.worker.draft_model = drafter
        self.worker._draft_sampler = SimpleNamespace(out=torch.full((bs * (block - 1),), -7, dtype=torch.int64))
        drafter.lm_head = None
        self.draft_hidden = []
        self.verified = []

    def _draft_forward(self, forward_batch):
        out = super()._draft_forward(forward_batch)
        self.draft_hidden.append(out.logits_output.hidden_states)
        return out

    def _prepare_for_verify(self, verify_input, batch, target_worker):
        self.verified.append(verify_input.draft_token.view(self.bs, self.width).clone())
        return super()._prepare_for_verify(verify_input, batch, target_worker)


def test_greedy_step_verifies_the_selector_path(drafter):
    bs, block = 3, harness.block_size()
    world = _World(drafter, bs, block)
    dflash_step.attach(world.worker)
    with torch.no_grad():
        world.step()
    hidden = world.draft_hidden[0].view(bs, block, -1)[:, 1:]
    bonus = world.batch.spec_info.bonus_tokens
    head = world.worker.model_runner.model.lm_head
    ids, scores = drafter.selector_lattice(hidden, bonus, head)
    tokens, _, _ = walk(ids, scores, torch.zeros(bs, block - 1), torch.ones(bs), torch.ones(bs, dtype=torch.bool))
    chain = world.verified[0]
    assert torch.equal(chain[:, 0], bonus)
    assert torch.equal(chain[:, 1:], tokens)
    # Not each slot's argmax (the folded head's -7s or the plain DFlash chain).
    argmax = torch.matmul(hidden, head.weight.T).argmax(-1)
    assert not torch.equal(chain[:, 1:], argmax)
    assert world.worker._dflash2_sample is None


class _Sampling(step_ops._SamplingInfo):
    is_all_greedy = False
    need_top_k_sampling = True

    def __init__(self, bs, temperatures, top_ks):
        super().__init__(bs)
        self.temperatures = torch.tensor(temperatures, dtype=torch.float32).view(-1, 1)
        self.top_ks = torch.tensor(top_ks, dtype=torch.int32)
        self.top_ps = torch.ones(bs)
        self.min_ps = torch.zeros(bs)


def test_sampling_step_verifies_against_q(drafter):
    from sglang.kernels.ops.speculative.dspark import dspark_accept
    from sglang.srt.speculative import dflash_worker_v2

    bs, block = 3, harness.block_size()
    world = _World(drafter, bs, block, seed=1)
    world.batch.sampling_info = _Sampling(bs, [0.8, 1.0, 1.0], [VOCAB, VOCAB, 1])
    dflash_step.attach(world.worker)
    seen = {}
    real = dspark_accept.accept_sampling

    def spy(**kw):
        seen["probs"] = kw["draft_probs"].clone()
        seen["candidates"] = kw["candidates"].clone()
        return real(**kw)

    with mock.patch.object(dflash_worker_v2, "is_dflash_sampling_verify_available", lambda: True), \
         mock.patch.object(dspark_accept, "accept_sampling", spy), \
         mock.patch.object(dflash_worker_v2, "apply_dflash_verify_logits_adjustments", lambda **kw: None), \
         torch.no_grad():  # fmt: skip
        result = world.step()
    probs = seen["probs"]
    chain = seen["candidates"]
    assert probs.shape == (bs, block - 1, world.worker.model_runner.model.lm_head.weight.shape[0])
    # Each slot's row is a distribution over the slot's K candidates, holding the chain's token.
    assert torch.allclose(probs.sum(-1), torch.ones(bs, block - 1))
    assert ((probs > 0).sum(-1) <= drafter.candidate_selector.top_k).all()
    assert (probs.gather(2, chain[:, 1:, None]).squeeze(2) > 0).all()
    # Request 2 decodes greedily (top-k 1): its q is one-hot.
    assert torch.equal(probs[2].max(-1).values, torch.ones(block - 1))
    assert world.worker._dflash2_probs.abs().sum() == 0
    assert result.accept_lens.shape == (bs,)
    assert ((result.accept_lens >= 1) & (result.accept_lens <= block)).all()


def test_rejection_against_q_is_lossless():
    """The first committed token of a step follows the target's distribution when the
    path is walked from the selector's q and accepted against it."""
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    g = torch.Generator().manual_seed(5)
    n, vocab, k, slots = 3000, 8, 4, 2
    temperature = 1.0
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(slots)]).expand(n, slots, k).contiguous()
    scores = (torch.randn(1, slots, k, k, generator=g) * 1.5).expand(n, slots, k, k).contiguous()
    target_logits = torch.randn(vocab, generator=g) * 1.5
    tokens, q, _ = walk(ids, scores, torch.rand(n, slots, generator=g), torch.full((n,), temperature),
                        torch.zeros(n, dtype=torch.bool))  # fmt: skip
    candidates = torch.cat([torch.zeros(n, 1, dtype=torch.int64), tokens], dim=1)
    logits = target_logits.expand(n * (slots + 1), vocab).contiguous()
    info = _Sampling(n, [temperature] * n, [vocab] * n)
    info.need_top_k_sampling = False
    worker = SimpleNamespace(_dflash2_sample=(ids, q), _dflash2_probs=None)
    draft_input = DFlashDraftInputV2.create_idle_input(device="cpu")
    torch.manual_seed(6)
    accept_len, bonus = dflash_step.sampling_accept(
        worker, candidates=candidates, next_token_logits=logits, sampling_info=info, draft_input=draft_input
    )
    first = torch.where(accept_len > 0, candidates[:, 1], bonus)
    freq = np.bincount(first.numpy(), minlength=vocab) / n
    p = torch.softmax(target_logits / temperature, -1).numpy()
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n) + 1e-3
    # Acceptance against q beats the target-only rule's p(token) on average.
    assert (accept_len > 0).float().mean() > float(p[tokens[:, 0].numpy()].mean())


def test_hooks_are_no_ops_for_a_dflash_drafter():
    worker = SimpleNamespace(draft_model=SimpleNamespace(layers=[]), block_size=8, ps=SimpleNamespace(tp_rank=0))
    dflash_step.attach(worker)
    assert dflash_step.propose(worker, None, bs=1, anchor_ids=torch.zeros(1), lm_head=None, sampling_info=None,
                               sampling_verify=True) is None  # fmt: skip
    assert dflash_step.sampling_accept(worker, candidates=None, next_token_logits=None, sampling_info=None,
                                       draft_input=None) is None  # fmt: skip


def test_attach_hands_the_drafter_the_workers_block(published):
    from tests.cpu.dflash2._drafter import build_drafter

    model = build_drafter(harness.FIXTURES)
    worker = SimpleNamespace(draft_model=model, block_size=4, ps=SimpleNamespace(tp_rank=0))
    dflash_step.attach(worker)
    assert model.block_size == 4
    assert all(c.block_size == 4 for layer in model.layers for c in (layer.attention_conv, layer.mlp_conv))
