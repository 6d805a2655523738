# SPDX-License-Identifier: Apache-2.0
"""DFLASH with a DFlash 2 drafter: upstream's ``DFlashWorkerV2.forward_batch_generation``
(patched, patch 0056) on the CPU, with stand-in model forwards (``benchmarks.step_ops``)
and the fixture's real DFlash 2 drafter for the selector.

- Greedy: the verified chain is ``[bonus, the selector's argmax path]`` over the draft
  forward's hidden states, and the folded greedy head is not used.
- Sampling (T > 0): the chain is still the selector's greedy path; the verify sampler
  hands the sampler's draw (a stand-in recording what it gets) one row per chain
  position, softmax(logits / T) at that position, and the step commits what the greedy
  rule over the draws accepts, with or without upstream's sampling kernels.
- ``attach`` hands the drafter the worker's block; every hook is a no-op for a DFlash
  drafter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import step_ops
from sglang.srt.speculative.ddtree.tree_build import triton_interpreted
from sglang.srt.speculative.dflash2 import dflash_step
from sglang.srt.speculative.dflash2.selector import greedy_walk, walk
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
    assert torch.equal(greedy_walk(ids, scores), tokens)
    chain = world.verified[0]
    assert torch.equal(chain[:, 0], bonus)
    assert torch.equal(chain[:, 1:], tokens)
    # Not each slot's argmax (the folded head's -7s or the plain DFlash chain).
    argmax = torch.matmul(hidden, head.weight.T).argmax(-1)
    assert not torch.equal(chain[:, 1:], argmax)


class _Sampling(step_ops._SamplingInfo):
    """A sampling batch's state as upstream's ``SamplingBatchInfo`` carries it (no penalties,
    bias or seeds)."""

    is_all_greedy = False
    need_top_k_sampling = True
    need_top_p_sampling = False
    need_min_p_sampling = False
    sampling_seed = None

    def __init__(self, bs, temperatures, top_ks):
        super().__init__(bs)
        self.temperatures = torch.tensor(temperatures, dtype=torch.float32).view(-1, 1)
        self.top_ks = torch.tensor(top_ks, dtype=torch.int32)
        self.top_ps = torch.ones(bs)
        self.min_ps = torch.zeros(bs)


class _SamplerDraw:
    """Stands in for ``Sampler._sample_from_probs`` (the sampling backend's kernels, which
    need a GPU): records what the verify sampler hands it and returns chosen draws, the
    chain's own next token at the first ``accept[b]`` positions of request ``b``, then a
    token off the chain."""

    def __init__(self, world, accept):
        self.world, self.accept, self.calls, self.draws = world, accept, [], None

    def __call__(self, probs, info, positions, simple):
        self.calls.append((probs.clone(), info, positions.clone(), simple))
        chain = self.world.verified[-1]
        width = chain.shape[1]
        draws = torch.empty_like(chain)
        draws[:, :-1] = chain[:, 1:]
        draws[:, -1] = (chain[:, -1] + 3) % VOCAB  # the last position's draw: any token
        for b, a in enumerate(self.accept):
            if a + 1 < width:
                draws[b, a] = (chain[b, a + 1] + 1) % VOCAB
        self.draws = draws
        return draws.view(-1)


@pytest.mark.parametrize("sampling_kernels", [True, False], ids=["sampling-kernels", "no-sampling-kernels"])
def test_sampling_step_verifies_the_greedy_path_through_the_verify_sampler(drafter, monkeypatch, sampling_kernels):
    """At T > 0 the chain is still the selector's greedy path, every chain position gets one
    draw by the server's sampler (at its temperature and position), and the step commits
    what the greedy rule over those draws accepts. The draws come from a stand-in for the
    sampler's kernels (``SGLANG_DDTREE_VERIFY_DRAW=sampler``), so the test chooses them."""
    from sglang.srt.speculative import dflash_worker_v2
    from sglang.srt.speculative.verify_sampling import verify_sampler
    from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler

    bs, block = 3, harness.block_size()
    temperatures = [0.8, 1.0, 1.0]
    world = _World(drafter, bs, block, seed=1)
    world.batch.sampling_info = _Sampling(bs, temperatures, [VOCAB, VOCAB, 1])
    accept = [0, 2, block - 1]  # drafts each request's draws accept
    draw = _SamplerDraw(world, accept)
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", "sampler")
    world.worker.verify_sampler = VerifySampler(vocab_size=VOCAB, device="cpu",
                                                sampler=SimpleNamespace(_sample_from_probs=draw),
                                                sampling_backend=None)  # fmt: skip
    logits = []
    target_forward = world._target_forward

    def recorded_target_forward(**kw):
        out = target_forward(**kw)
        logits.append(out.logits_output.next_token_logits.clone())
        return out

    world.worker._target_worker.forward_batch_generation = recorded_target_forward
    monkeypatch.setattr(dflash_worker_v2, "is_dflash_sampling_verify_available", lambda: sampling_kernels)
    monkeypatch.setattr(verify_sampler, "get_tp_group", lambda: SimpleNamespace(world_size=1))
    dflash_step.attach(world.worker)
    with torch.no_grad():
        result = world.step()

    # The chain: [bonus, the selector's greedy path] for every request, sampled or not.
    hidden = world.draft_hidden[0].view(bs, block, -1)[:, 1:]
    bonus = world.batch.spec_info.bonus_tokens
    ids, scores = drafter.selector_lattice(hidden, bonus, world.worker.model_runner.model.lm_head)
    chain = world.verified[0]
    assert torch.equal(chain[:, 0], bonus)
    assert torch.equal(chain[:, 1:], greedy_walk(ids, scores))
    # A sampled walk at these temperatures would have left the greedy path somewhere.
    sampled, _, _ = walk(ids, scores, torch.rand(bs, block - 1, generator=torch.Generator().manual_seed(3)),
                         torch.tensor(temperatures), torch.zeros(bs, dtype=torch.bool))  # fmt: skip
    assert not torch.equal(sampled, chain[:, 1:])

    # One draw per chain position, from softmax(logits / T) of the request, at its position.
    assert len(draw.calls) == 1
    probs, info, positions, simple = draw.calls[0]
    assert probs.shape == (bs * block, VOCAB) and not simple
    temps = torch.tensor(temperatures).repeat_interleave(block).view(-1, 1)
    torch.testing.assert_close(probs, torch.softmax(logits[0] / temps, dim=-1))
    assert torch.equal(info.temperatures, temps)
    assert torch.equal(info.top_ks, torch.tensor([VOCAB, VOCAB, 1], dtype=torch.int32).repeat_interleave(block))
    seq_lens = world.seq_lens.view(bs, 1)
    assert torch.equal(positions.view(bs, block), seq_lens + torch.arange(block))

    # The greedy rule over the draws: accept[b] drafts, then the draw after them.
    draws = draw.draws
    assert result.accept_lens.tolist() == [a + 1 for a in accept]
    out = result.next_token_ids.view(bs, block)
    for b, a in enumerate(accept):
        assert torch.equal(out[b, :a], chain[b, 1 : a + 1])
        assert int(out[b, a]) == int(draws[b, a])
    assert torch.equal(result.next_draft_input.bonus_tokens, draws[torch.arange(bs), torch.tensor(accept)])


def test_hooks_are_no_ops_for_a_dflash_drafter():
    worker = SimpleNamespace(draft_model=SimpleNamespace(layers=[]), block_size=8, ps=SimpleNamespace(tp_rank=0))
    dflash_step.attach(worker)
    assert dflash_step.propose(worker, None, bs=1, anchor_ids=torch.zeros(1), lm_head=None) is None


def test_attach_hands_the_drafter_the_workers_block(published):
    from tests.cpu.dflash2._drafter import build_drafter

    model = build_drafter(harness.FIXTURES)
    worker = SimpleNamespace(draft_model=model, block_size=4, ps=SimpleNamespace(tp_rank=0))
    dflash_step.attach(worker)
    assert model.block_size == 4
    assert all(c.block_size == 4 for layer in model.layers for c in (layer.attention_conv, layer.mlp_conv))
