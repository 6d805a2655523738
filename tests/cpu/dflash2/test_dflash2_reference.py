# SPDX-License-Identifier: Apache-2.0
"""This project's DFlash 2 drafter against upstream SGLang 0.5.23's on the recorded case.

``fixtures/`` holds a DFlash 2 checkpoint directory with random weights and what upstream's
``DFlash2DraftModel`` computed from it (``scripts/dflash2_reference.py``; the command and
versions are in ``fixtures/provenance.json``). Here the same directory is loaded the way
the server loads a drafter (architecture -> class through the model registry, then the
class's ``load_weights``) on SGLang 0.5.17 with the overlay, and every recorded stage is
compared in fp32: the block forward's hidden states, the candidates and their unary
scores, the transition lattice and the walked paths with their q.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.cpu.dflash2 import harness

from tests.cpu.dflash2._drafter import build_drafter, model_class

ATOL = 2e-5
RTOL = 1e-5


def test_fixture_provenance():
    prov = json.loads((harness.FIXTURES / "provenance.json").read_text())
    assert prov["sglang"] == "0.5.23"
    assert prov["torch_compile_disabled"] is True
    assert "scripts/dflash2_reference.py" in prov["command"]
    total = sum(p.stat().st_size for p in harness.FIXTURES.iterdir())
    assert total < 1 << 20


def test_registry_resolves_dflash2_architectures(published):
    from sglang.srt.models.dflash2 import DFlash2DraftModel

    for arch in ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel"):
        assert issubclass(model_class(arch), DFlash2DraftModel)


def test_server_args_take_the_drafters_block(published):
    assert published.speculative_num_draft_tokens == harness.block_size()


def test_block_forward_matches(drafter, reference, reference_inputs):
    from sglang.srt.layers import radix_attention

    hidden = harness.drafter_hidden(drafter, reference_inputs, radix_attention)
    torch.testing.assert_close(hidden, reference["output.hidden"], atol=ATOL, rtol=RTOL)


def _lattice(drafter, hidden, inputs):
    bs = len(harness.PREFIX_LENS)
    slots = hidden.view(bs, harness.block_size(), -1)[:, 1:]
    head = harness.LMHead(inputs["lm_head"])
    with torch.no_grad():
        return drafter.selector_lattice(slots, inputs["anchor_ids"], head)


def test_candidates_and_lattice_match(drafter, reference, reference_inputs):
    # From upstream's hidden states, so only the selector is compared here.
    ids, scores = _lattice(drafter, reference["output.hidden"], reference_inputs)
    assert torch.equal(ids, reference["output.candidate_ids"])
    torch.testing.assert_close(scores, reference["output.scores"], atol=ATOL, rtol=RTOL)
    bs, slots, k = ids.shape
    head = harness.LMHead(reference_inputs["lm_head"])
    flat = reference["output.hidden"].view(bs, slots + 1, -1)[:, 1:].reshape(bs * slots, -1)
    with torch.no_grad():
        _, unary = drafter.compute_candidates(flat, head)
    torch.testing.assert_close(unary.view(bs, slots, k), reference["output.unary"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["greedy", "sampled", "mixed"])
def test_walk_matches(drafter, reference, reference_inputs, case):
    from sglang.srt.speculative.dflash2.selector import walk

    tokens, q, path = walk(
        reference["output.candidate_ids"],
        reference["output.scores"],
        reference_inputs["uniforms"],
        reference[f"output.walk.{case}_temperatures"],
        reference[f"output.walk.{case}_greedy_mask"],
    )
    assert torch.equal(tokens, reference[f"output.walk.{case}_tokens"])
    torch.testing.assert_close(q, reference[f"output.walk.{case}_q"], atol=1e-6, rtol=1e-6)
    picked = reference["output.candidate_ids"].gather(2, path.unsqueeze(2)).squeeze(2)
    assert torch.equal(picked, tokens)


def test_end_to_end_from_own_forward(drafter, reference, reference_inputs):
    from sglang.srt.layers import radix_attention
    from sglang.srt.speculative.dflash2.selector import walk

    hidden = harness.drafter_hidden(drafter, reference_inputs, radix_attention)
    ids, scores = _lattice(drafter, hidden, reference_inputs)
    assert torch.equal(ids, reference["output.candidate_ids"])
    bs = ids.shape[0]
    tokens, _, _ = walk(ids, scores, reference_inputs["uniforms"], torch.ones(bs), torch.ones(bs, dtype=torch.bool))
    assert torch.equal(tokens, reference["output.walk.greedy_tokens"])


def test_the_convolution_matters(published, reference, reference_inputs):
    """With identity convolution kernels the same weights give other hidden states: the
    comparison above would catch a convolution that is not applied."""
    from safetensors.torch import load_file

    from sglang.srt.layers import radix_attention

    weights = load_file(str(harness.FIXTURES / "model.safetensors"))
    for name in list(weights):
        if name.endswith("_conv.base_kernel"):
            base = torch.zeros_like(weights[name])
            base[:, 0] = 1.0
            weights[name] = base
        elif name.endswith("_conv.kernel_projection.weight"):
            weights[name] = torch.zeros_like(weights[name])
    plain = build_drafter(harness.FIXTURES, weights)
    hidden = harness.drafter_hidden(plain, reference_inputs, radix_attention)
    assert (hidden - reference["output.hidden"]).abs().max() > 1e-2
