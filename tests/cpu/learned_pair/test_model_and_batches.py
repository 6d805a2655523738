# SPDX-License-Identifier: Apache-2.0
"""The torch target against transformers' Qwen3, its cached generation against the full
forward, the DFlash training batch against a plain loop reference, and the multi-anchor
drafter forward against one forward per block."""

from __future__ import annotations

import math

import pytest
import torch

from scripts.learned_pair import dflash_batch, train
from scripts.learned_pair.model import Drafter, DrafterShape, Target, TargetShape, default_target_layer_ids

SHAPE = TargetShape(vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=8, intermediate_size=80, max_position_embeddings=256)
DSHAPE = DrafterShape(num_hidden_layers=2, intermediate_size=64, target_layer_ids=(0, 2), block_size=16)
MASK = 2


def _target(seed=0):
    m = Target(SHAPE)
    m.init_weights(torch.Generator().manual_seed(seed), std=0.2)  # large weights: sharp, varied logits
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:  # norm weights away from 1 so a missed norm shows
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(hash(name) % 1000))
    return m.eval()


def _drafter(seed=1):
    d = Drafter(SHAPE, DSHAPE)
    d.init_weights(torch.Generator().manual_seed(seed), std=0.2)
    return d.eval()


def test_target_matches_transformers_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = _target()
    cfg = m.hf_config(eos_token_id=0, pad_token_id=1)
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    missing, unexpected = hf.load_state_dict(m.state_dict(), strict=False)
    assert missing == ["lm_head.weight"] or not missing  # tied to embed_tokens
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert not [k for k in unexpected if not k.startswith("rope.")]
    x = torch.randint(0, SHAPE.vocab_size, (2, 37))
    with torch.no_grad():
        mine, cap = m(x, capture=(0, 2))
        ref = hf(x, output_hidden_states=True)
    assert ref.logits.std() > 1.0
    torch.testing.assert_close(mine, ref.logits, atol=2e-5, rtol=2e-5)
    # "after target layer i" = HF hidden_states[i + 1] (what SGLang captures before layer i + 1)
    torch.testing.assert_close(cap[0], ref.hidden_states[1], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cap[2], ref.hidden_states[3], atol=2e-5, rtol=2e-5)


def test_cached_generation_equals_full_forward():
    m = _target()
    prompts = torch.randint(3, SHAPE.vocab_size, (3, 9))
    gen = torch.Generator().manual_seed(0)
    out = train.generate(m, prompts, 12, torch.zeros(3), gen)
    seq = prompts.clone()
    with torch.no_grad():
        for _ in range(12):
            logits, _ = m(seq)
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    # sampled rows differ from greedy ones; greedy rows are the same whatever the generator
    mixed = train.generate(m, prompts, 12, torch.tensor([0.0, 1.0, 0.0]), torch.Generator().manual_seed(5))
    assert torch.equal(mixed[[0, 2]], seq[[0, 2]]) and not torch.equal(mixed[1], seq[1])


def test_default_layer_ids_follow_upstream_rule():
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids

    for layers in (4, 6, 12, 28, 36):
        for draft in (1, 2, 3, 5):
            assert default_target_layer_ids(layers, draft) == build_target_layer_ids(layers, draft)
    with pytest.raises(ValueError, match="below the last target layer"):
        Drafter(SHAPE, DrafterShape(target_layer_ids=(0, SHAPE.num_hidden_layers - 1)))


# ---------------------------------------------------------------------------------------------
# DFlash training batch against loops


def test_anchors_distinct_sorted_in_range_and_seeded():
    a = dflash_batch.sample_anchors(5, 7, 40, 10, torch.Generator().manual_seed(3))
    b = dflash_batch.sample_anchors(5, 7, 40, 10, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (5, 10)
    for row in a.tolist():
        assert row == sorted(set(row)) and all(7 <= x <= 40 for x in row)
    counts = torch.bincount(dflash_batch.sample_anchors(2000, 1, 10, 3, torch.Generator().manual_seed(0)).flatten())
    assert counts[0] == 0 and counts[1:].min() > 0.8 * counts[1:].float().mean()  # uniform over the range
    with pytest.raises(ValueError, match="cannot place"):
        dflash_batch.sample_anchors(1, 5, 8, 5, torch.Generator())
    with pytest.raises(ValueError, match="context before it"):
        dflash_batch.sample_anchors(1, 0, 8, 2, torch.Generator())


def test_blocks_match_a_plain_reference():
    bs, gamma, s = 16, 7.0, 50
    seqs = torch.randint(3, 90, (3, s))
    anchors = torch.tensor([[1, 20, 34], [5, 6, 40], [10, 30, 45]])  # 40 and 45: blocks run past the end
    blk = dflash_batch.make_blocks(seqs, anchors, bs, MASK, gamma)
    n = anchors.shape[1]
    assert blk.ids.shape == (3, n * bs) and blk.mask.shape == (3, 1, n * bs, s + n * bs)
    for b in range(3):
        for i, a in enumerate(anchors[b].tolist()):
            for k in range(bs):
                q = i * bs + k
                assert blk.ids[b, q] == (seqs[b, a] if k == 0 else MASK)
                assert blk.pos[b, q] == a + k
                inside = a + k < s
                if inside:
                    assert blk.labels[b, i, k] == seqs[b, a + k]
                want_w = 0.0 if k == 0 or not inside else math.exp(-(k - 1) / gamma)
                assert blk.weights[b, i, k].item() == pytest.approx(want_w)
                for j in range(s):
                    assert blk.mask[b, 0, q, j] == (j < a)
                for i2 in range(n):
                    for k2 in range(bs):
                        assert blk.mask[b, 0, q, s + i2 * bs + k2] == (i2 == i)


def test_weighted_loss_matches_manual():
    blk = dflash_batch.make_blocks(torch.randint(3, 20, (2, 40)), torch.tensor([[3, 17], [9, 30]]), 16, MASK, 7.0)
    logits = torch.randn(2, 32, 20)
    loss, acc = dflash_batch.weighted_loss(logits, blk)
    num = den = 0.0
    for b in range(2):
        for i in range(2):
            for k in range(16):
                w = blk.weights[b, i, k].item()
                lp = torch.log_softmax(logits[b, i * 16 + k], -1)[blk.labels[b, i, k]].item()
                num, den = num - w * lp, den + w
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    assert acc.shape == (16,) and acc[0] == 0


def test_soft_labels_are_the_targets_distribution_before_each_slot():
    """Slot ``a + k`` of a block is labelled with the target's softmax at ``a + k - 1`` (what the
    target would sample that token from); a one-hot ``soft`` gives the hard loss back, and a
    share mixes the two."""
    seqs = torch.randint(3, 20, (2, 40))
    anchors = torch.tensor([[3, 30], [9, 26]])
    blk = dflash_batch.make_blocks(seqs, anchors, 16, MASK, 7.0)
    target_logits = torch.randn(2, 40, 20)
    soft = dflash_batch.soft_labels(target_logits, blk)
    for b in range(2):
        for i in range(2):
            for k in range(1, 16):
                pos = anchors[b, i].item() + k
                if pos < 40:
                    want = torch.softmax(target_logits[b, pos - 1], -1)
                    torch.testing.assert_close(soft[b, i * 16 + k], want)
    logits = torch.randn(2, 32, 20)
    hard, _ = dflash_batch.weighted_loss(logits, blk)
    one_hot = torch.nn.functional.one_hot(blk.labels.view(2, 32), 20).float()
    same, _ = dflash_batch.weighted_loss(logits, blk, one_hot, 1.0)
    assert same.item() == pytest.approx(hard.item(), rel=1e-6)
    full, _ = dflash_batch.weighted_loss(logits, blk, soft, 1.0)
    num = den = 0.0
    for b in range(2):
        for i in range(2):
            for k in range(16):
                w = blk.weights[b, i, k].item()
                lp = torch.log_softmax(logits[b, i * 16 + k], -1)
                num, den = num - w * float((soft[b, i * 16 + k] * lp).sum()), den + w
    assert full.item() == pytest.approx(num / den, rel=1e-5)
    assert full.item() != pytest.approx(hard.item(), rel=1e-3)
    mixed, _ = dflash_batch.weighted_loss(logits, blk, soft, 0.25)
    assert mixed.item() == pytest.approx(0.75 * hard.item() + 0.25 * full.item(), rel=1e-5)


def test_a_soft_label_step_trains_toward_the_targets_distribution():
    """``drafter_step_loss(soft_labels=1)`` is the cross-entropy against the target's own logits:
    with the target's soft labels the loss is the distillation loss, above the target's entropy."""
    m, d = _target(), _drafter()
    # Seeded: on random tokens and an untrained drafter the two losses lie close together, and
    # the global generator's state (whatever ran before) once put them within the tolerance.
    seqs = torch.randint(3, SHAPE.vocab_size, (2, 48), generator=torch.Generator().manual_seed(7))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with torch.no_grad():
        hard, _ = train.drafter_step_loss(d, m, seqs, 8, 3, MASK, g1)
        soft, _ = train.drafter_step_loss(d, m, seqs, 8, 3, MASK, g2, soft_labels=1.0)
    assert torch.isfinite(soft) and soft.item() != pytest.approx(hard.item(), rel=1e-2)


def test_multi_anchor_forward_equals_one_forward_per_block():
    """Blocks in one forward must not see each other or context at or after their anchor."""
    m, d = _target(), _drafter()
    s = 40
    seq = torch.randint(3, SHAPE.vocab_size, (1, s))
    anchors = torch.tensor([[4, 11, 23]])
    with torch.no_grad():
        _, cap = m(seq, capture=DSHAPE.target_layer_ids, logits=False)
        ctx = d.context(cap)
        blk = dflash_batch.make_blocks(seq, anchors, 16, MASK, 7.0)
        emb = m.model.embed_tokens(blk.ids)
        together = d(emb, blk.pos, ctx, torch.arange(s), blk.mask)
        for i, a in enumerate(anchors[0].tolist()):
            sl = slice(i * 16, (i + 1) * 16)
            alone = d(emb[:, sl], blk.pos[:, sl], ctx[:, :a], torch.arange(a), None)
            torch.testing.assert_close(together[:, sl], alone, atol=1e-5, rtol=1e-5)
        # and the output does depend on the context before the anchor
        other = d(emb[:, :16], blk.pos[:, :16], ctx[:, :4].flip(1), torch.arange(4), None)
        assert (other - together[:, :16]).abs().max() > 1e-3


def test_drafter_state_dict_has_upstream_names():
    names = set(_drafter().state_dict())
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(DSHAPE.num_hidden_layers):
        for w in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            want.add(f"layers.{i}.self_attn.{w}.weight")
        for w in ("gate_proj", "up_proj", "down_proj"):
            want.add(f"layers.{i}.mlp.{w}.weight")
        want |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert want == names  # no embedding, no head: DFLASH borrows the target's
