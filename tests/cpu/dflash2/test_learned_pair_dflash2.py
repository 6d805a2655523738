# SPDX-License-Identifier: Apache-2.0
"""The learned pair's DFlash 2 drafter (``python3 -m scripts.learned_pair build --drafter
dflash2``) at the toy profile's shapes: one training step trains the convolution and the
selector, and the checkpoint it writes loads through the server's registry into this
project's DFlash 2 drafter, which computes what the training model computes (block forward
and transition scores)."""

from __future__ import annotations

import json

import pytest
import torch

from scripts.learned_pair import checkpoint, evaluate, train
from scripts.learned_pair.build import PROFILES, BuildArgs
from scripts.learned_pair.model import Drafter, DrafterShape, Target, TargetShape, dflash2_shape
from scripts.learned_pair.tokenizer import MASK_ID
from tests.cpu.dflash2 import harness
from tests.cpu.dflash2._drafter import build_drafter


@pytest.fixture(scope="module")
def toy():
    prof = PROFILES["toy"]
    tshape = TargetShape(**prof.target)
    dshape = dflash2_shape(DrafterShape(**prof.drafter), tshape.hidden_size)
    g = torch.Generator().manual_seed(0)
    target = Target(tshape)
    target.init_weights(g)
    drafter = Drafter(tshape, dshape)
    drafter.init_weights(g)
    with torch.no_grad():  # trained-looking convolution and selector, so the comparison sees them
        for name, p in drafter.named_parameters():
            if "_conv." in name or "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())  # what the checkpoint stores
    return target.eval(), drafter


def test_shape_and_cli_default():
    shape = dflash2_shape(DrafterShape(), 64)
    assert shape.dflash2 and shape.conv_group_size == 64 and shape.selector_top_k == 8
    assert dflash2_shape(DrafterShape(), 96).conv_group_size == 48
    assert BuildArgs(out=None).drafter == "dflash"
    assert not DrafterShape().dflash2


def test_a_training_step_reaches_the_dflash2_weights(toy):
    target, drafter = toy
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, target.shape.vocab_size, (2, 48), generator=g)
    drafter.train()
    try:
        loss, acc = train.drafter_step_loss(drafter, target, seqs, 8, 3, MASK_ID, g)
        loss.backward()
    finally:
        drafter.eval()
    assert torch.isfinite(loss) and acc.shape == (drafter.shape.block_size,)
    for name, p in drafter.named_parameters():
        if "_conv." in name or "candidate_selector" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    drafter.zero_grad(set_to_none=True)


def test_checkpoint_loads_and_matches_the_training_model(published, toy, tmp_path):
    from sglang.srt.layers import radix_attention
    from sglang.srt.models.dflash2 import DFlash2DraftModel

    target, drafter = toy
    tcfg = target.hf_config(eos_token_id=0, pad_token_id=0)
    checkpoint.save_drafter(drafter, tcfg, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    served = build_drafter(tmp_path)
    assert isinstance(served, DFlash2DraftModel)

    g = torch.Generator().manual_seed(2)
    p, bs = 20, drafter.shape.block_size
    prompt = torch.randint(0, target.shape.vocab_size, (1, p), generator=g)
    anchor = int(prompt[0, -1])
    with torch.no_grad():
        _, captured = target(prompt, capture=drafter.shape.target_layer_ids, logits=False)
        block = torch.full((1, bs), MASK_ID)
        block[0, 0] = anchor
        embeds = target.model.embed_tokens(block)
        ctx = drafter.context(captured)
        pos = torch.arange(p, p + bs).view(1, -1)
        want = drafter(embeds, pos, ctx, torch.arange(p), None)[0]
    feats = torch.cat([captured[i][0] for i in drafter.shape.target_layer_ids], dim=-1)
    inputs = {"prefix_lens": torch.tensor([p]), "target_hidden": feats, "block_embeds": embeds[0]}
    got = harness.drafter_hidden(served, inputs, radix_attention)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    head = harness.LMHead(target.lm_head_weight.detach())
    slots = want[1:].unsqueeze(0)
    with torch.no_grad():
        ids, scores = served.selector_lattice(slots, torch.tensor([anchor]), head)
        unary = torch.matmul(slots[0], head.weight.T).gather(-1, ids[0])
        for s in range(bs - 1):
            previous = torch.full((ids.shape[-1],), anchor) if s == 0 else ids[0, s - 1]
            pair = drafter.candidate_selector.pair(previous, slots[0, s].expand(len(previous), -1),
                                                   ids[0, s].expand(len(previous), -1))  # fmt: skip
            torch.testing.assert_close(scores[0, s], unary[s] + pair, atol=1e-4, rtol=1e-4)
        # the offline replay's lattice (all anchors at once) is the server's
        replay_ids, replay_scores = evaluate.selector_lattice(drafter, torch.matmul(slots, head.weight.T), slots,
                                                              torch.tensor([anchor]))  # fmt: skip
    assert torch.equal(replay_ids, ids.to(replay_ids.dtype))
    torch.testing.assert_close(replay_scores, scores, atol=1e-4, rtol=1e-4)


def test_toy_build_trains_both_drafters_on_one_target(published, tmp_path):
    """``build --drafter both``: a DFlash drafter in drafter/ and a DFlash 2 drafter of the
    same target in drafter-dflash2/, which the server's registry loads."""
    import sysconfig
    from pathlib import Path

    from scripts.learned_pair.build import build
    from sglang.srt.models.dflash2 import DFlash2DraftModel

    lib = Path(sysconfig.get_paths()["stdlib"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        manifest = build(BuildArgs(out=tmp_path, profile="toy", roots={"email": lib / "email", "json": lib / "json"},
                                   deadline_s=600, drafter="both"), log=lambda m: None)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert manifest["drafter_dflash2"]["dir"] == "drafter-dflash2"
    assert manifest["drafter_dflash2"]["train"]["steps"] == manifest["drafter_train"]["steps"]
    assert manifest["drafter_dflash2"]["shape"]["selector_top_k"] == 8
    assert isinstance(build_drafter(tmp_path / "drafter-dflash2"), DFlash2DraftModel)


def test_add_drafter_trains_a_dflash2_drafter_beside_a_built_pair(published, tmp_path):
    """``add-drafter --kind dflash2`` on a pair built with a DFlash drafter: drafter-dflash2/
    appears (loading into the server's DFlash 2 drafter), the manifest records it, and the
    pair's target, tokenizer, drafter and prompts stay byte for byte; a second run refuses."""
    import hashlib
    import sysconfig
    from pathlib import Path

    from scripts.learned_pair.__main__ import main as cli
    from scripts.learned_pair.build import build
    from sglang.srt.models.dflash2 import DFlash2DraftModel

    lib = Path(sysconfig.get_paths()["stdlib"])
    roots = {"email": lib / "email", "json": lib / "json"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build(BuildArgs(out=tmp_path, profile="toy", roots=roots, deadline_s=600), log=lambda m: None)

        def digests():
            return {str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in sorted(tmp_path.rglob("*")) if p.is_file() and p.name != "manifest.json"}

        before = digests()
        argv = ["add-drafter", str(tmp_path), "--kind", "dflash2", "--deadline-s", "600",
                "--root", f"email={roots['email']}", "--root", f"json={roots['json']}"]
        assert cli(argv) == 0
    finally:
        torch.set_num_threads(threads)
    after = digests()
    assert {k: v for k, v in after.items() if not k.startswith("drafter-dflash2/")} == before
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    added = manifest["drafter_dflash2"]
    assert added["dir"] == "drafter-dflash2" and added["shape"]["selector_top_k"] == 8
    assert added["train"]["steps"] == manifest["drafter_train"]["steps"]
    assert added["offline_accept_t0"]["ddtree16"] >= 1.0 and added["added"]["corpus"]["train_files"] > 0
    assert isinstance(build_drafter(tmp_path / "drafter-dflash2"), DFlash2DraftModel)
    with pytest.raises(SystemExit, match="drafter-dflash2 exists: remove it"):
        cli(argv)
