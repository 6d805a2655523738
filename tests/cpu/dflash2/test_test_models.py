# SPDX-License-Identifier: Apache-2.0
"""The constructed DFlash 2 test drafters (``scripts/make_test_models.py``) load through the
server's model registry into this project's DFlash 2 drafter and draft what they were
built to draft; the unsupported one, and other unsupported DFlash 2 checkpoints, are
refused when the drafter is built (at server start-up), naming the feature.

The targets run through transformers' own DeepseekV2 / Qwen3 code for the drafter's
context features; the drafter through its own forward with the harness's attention
stand-in; the selector through its own lattice and walk with the target's LM head.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.cpu.dflash2 import harness
from tests.cpu.dflash2._drafter import build_drafter

REPO = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("make_test_models", REPO / "scripts" / "make_test_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _generator()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash2_models")
    manifest = gen.generate(out, seed=0, which=("mla", "qwen3"))
    return out, manifest


def test_manifest_and_files(models):
    out, manifest = models
    assert manifest["models"]["tiny-mla"]["dflash2_drafter"] == "tiny-mla-dflash2"
    assert manifest["models"]["tiny-qwen3"]["dflash2_drafter"] == "tiny-qwen3-dflash2"
    assert manifest["models"]["tiny-qwen3"]["unsupported_dflash2_drafter"] == gen.UNSUPPORTED_DFLASH2
    for name in ("tiny-mla-dflash2", "tiny-qwen3-dflash2"):
        cfg = json.loads((out / name / "config.json").read_text())
        assert cfg["architectures"] == ["DFlash2DraftModel"]
        assert {k: cfg["dflash_config"][k] for k in gen.DFLASH2_FIELDS} == gen.DFLASH2_FIELDS
        # The DFlash layers are the DFlash drafter's, tensor for tensor.
        from safetensors.torch import load_file

        d1 = load_file(str(out / name.replace("dflash2", "dflash") / "model.safetensors"))
        d2 = load_file(str(out / name / "model.safetensors"))
        assert all(torch.equal(d1[k], d2[k]) for k in d1)
        assert {k for k in d2 if k not in d1} and all("_conv." in k or "candidate_selector" in k
                                                      for k in d2 if k not in d1)  # fmt: skip


def _context_and_block(out: Path, name: str, prompt: torch.Tensor, bonus: int, target_layer_ids):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(out / name), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = target(prompt[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in target_layer_ids], -1)
    block = torch.full((gen.BLOCK_SIZE,), gen.MASK_ID)
    block[0] = bonus
    with torch.no_grad():
        embeds = target.get_input_embeddings()(block)
    return feats, embeds, target.lm_head.weight.detach().float()


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-qwen3"])
def test_drafter_loads_and_walks_the_constructed_chain(published, models, name):
    from sglang.srt.layers import radix_attention
    from sglang.srt.models.dflash2 import DFlash2DraftModel
    from sglang.srt.speculative.dflash2.selector import walk

    out, manifest = models
    drafter = build_drafter(out / f"{name}-dflash2")
    assert isinstance(drafter, DFlash2DraftModel)
    assert drafter.block_size == gen.BLOCK_SIZE
    assert drafter.candidate_selector.top_k == gen.DFLASH2_FIELDS["selector_top_k"]

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(gen.NUM_SPECIAL, gen.VOCAB, (41,), generator=g)
    prompt[0] = 1
    tau = manifest["tau"]
    bonus = tau[int(prompt[-2])]
    truth = gen.Codes.greedy_from(tau, prompt.tolist() + [bonus], gen.BLOCK_SIZE - 1)
    cfg = json.loads((out / f"{name}-dflash2" / "config.json").read_text())
    feats, embeds, head = _context_and_block(out, name, prompt, bonus, cfg["dflash_config"]["target_layer_ids"])
    inputs = {"prefix_lens": torch.tensor([prompt.numel()]), "target_hidden": feats, "block_embeds": embeds}
    hidden = harness.drafter_hidden(drafter, inputs, radix_attention)
    with torch.no_grad():
        ids, scores = drafter.selector_lattice(hidden.view(1, gen.BLOCK_SIZE, -1)[:, 1:], torch.tensor([bonus]),
                                               harness.LMHead(head))  # fmt: skip
    tokens, _, _ = walk(ids, scores, torch.zeros(1, gen.BLOCK_SIZE - 1), torch.ones(1), torch.ones(1, dtype=torch.bool))
    for k in range(1, gen.BLOCK_SIZE):
        if k == manifest["decoy_offset"]:
            # As DFlash's chain: the decoy first, the right token among the candidates.
            assert tokens[0, k - 1] != truth[k - 1] and truth[k - 1] in ids[0, k - 1].tolist()
        else:
            assert tokens[0, k - 1] == truth[k - 1], (k, ids[0, k - 1].tolist(), truth[k - 1])


def test_unsupported_test_drafter_is_refused(published, models):
    from sglang.srt.speculative.dflash2.config import UnsupportedDFlash2Checkpoint

    out, _ = models
    with pytest.raises(UnsupportedDFlash2Checkpoint, match="attention_sink_bias"):
        build_drafter(out / gen.UNSUPPORTED_DFLASH2)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c.update(use_gemma_norm=True), "use_gemma_norm"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda c: c["dflash_config"].update(projector_type="domino"), "projector_type='domino'"),
        (lambda c: c["dflash_config"].update(attention_value_scale=0.5), "attention_value_scale"),
        (lambda c: c["dflash_config"].update(selector_rank=0, selector_top_k=0), "no candidate selector"),
        (lambda c: c["dflash_config"].update(selector_top_k=0), "selector_rank and selector_top_k together"),
        (lambda c: c["dflash_config"].update(conv_group_size=7), "does not divide hidden_size"),
        (lambda c: c["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size and conv_group_size"),
        (lambda c: c["dflash_config"].update(selector_top_k=500), "exceeds vocab_size"),
        (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantized drafter"),
    ],
)
def test_unsupported_checkpoints_are_refused_at_build(published, tmp_path, edit, needle):
    from sglang.srt.speculative.dflash2.config import UnsupportedDFlash2Checkpoint

    cfg = json.loads(json.dumps(harness.CONFIG))
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(harness.FIXTURES / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedDFlash2Checkpoint) as err:
        build_drafter(tmp_path)
    message = str(err.value)
    assert needle in message
    if "cannot be served" in message:
        assert message.startswith("This DFlash 2 drafter (DFlash2DraftModel) cannot be served")


def test_a_checkpoint_missing_dflash2_tensors_is_refused(published):
    from safetensors.torch import load_file

    from sglang.srt.speculative.dflash2.config import UnsupportedDFlash2Checkpoint

    weights = load_file(str(harness.FIXTURES / "model.safetensors"))
    del weights["candidate_selector.successor_codebook"], weights["layers.1.mlp_conv.base_kernel"]
    with pytest.raises(UnsupportedDFlash2Checkpoint, match="candidate_selector.successor_codebook"):
        build_drafter(harness.FIXTURES, weights)
