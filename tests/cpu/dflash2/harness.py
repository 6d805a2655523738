# SPDX-License-Identifier: Apache-2.0
"""The DFlash 2 reference case, shared by the script that records it
(``scripts/dflash2_reference.py``, run against upstream SGLang 0.5.23) and the tests
that replay it on this project's drafter (SGLang 0.5.17 + the overlay).

Torch only: it imports neither SGLang release. What both sides share:

- the drafter's ``config.json`` (``CONFIG``), its random weights and the inputs
  (``make_weights``, ``make_inputs``: seeded, written into the fixture once, read
  back from it by the tests);
- the stand-in for the attention backend (``BlockAttention``): plain softmax
  attention of each request's block rows over that request's context K/V and its
  block's K/V, non-causal, which is what the server's DFlash draft forward
  computes;
- the context K/V materialisation and the drafter forward (``drafter_hidden``),
  through the model's own methods, which have the same names in both releases.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Sequence

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"

SEED = 20261203
#: Two requests with different committed prefixes.
PREFIX_LENS = (5, 9)
#: Walk temperatures of the sampled case, per request.
TEMPERATURES = (0.7, 1.3)

CONFIG = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "dflash_config": {
        "block_size": 6,
        "mask_token_id": 95,
        "target_layer_ids": [0, 2],
        "conv_kernel_size": 3,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 4,
        "output_multiplier": 1.25,
        "final_logit_softcapping": 30.0,
    },
}


def block_size(config: dict = CONFIG) -> int:
    return int(config["dflash_config"]["block_size"])


def make_weights(config: dict = CONFIG, seed: int = SEED) -> Dict[str, torch.Tensor]:
    """Random fp32 weights under the checkpoint's own tensor names."""
    g = torch.Generator().manual_seed(seed)
    d = config["dflash_config"]
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    taps, groups, rank = d["conv_kernel_size"], h // d["conv_group_size"], d["selector_rank"]
    feats = len(d["target_layer_ids"])

    def rn(*shape, scale=1.0, offset=0.0):
        return torch.randn(*shape, generator=g) * scale + offset

    w = {
        "fc.weight": rn(h, feats * h, scale=(feats * h) ** -0.5),
        "hidden_norm.weight": rn(h, scale=0.1, offset=1.0),
        "norm.weight": rn(h, scale=0.1, offset=1.0),
        "candidate_selector.predecessor_codebook": rn(v, rank, scale=0.6),
        "candidate_selector.successor_codebook": rn(v, rank, scale=0.6),
        "candidate_selector.hidden_projection.weight": rn(rank, h, scale=h ** -0.5),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": rn(h, scale=0.1, offset=1.0),
            p + "post_attention_layernorm.weight": rn(h, scale=0.1, offset=1.0),
            p + "self_attn.q_proj.weight": rn(nh * hd, h, scale=h ** -0.5),
            p + "self_attn.k_proj.weight": rn(nkv * hd, h, scale=h ** -0.5),
            p + "self_attn.v_proj.weight": rn(nkv * hd, h, scale=h ** -0.5),
            p + "self_attn.o_proj.weight": rn(h, nh * hd, scale=(nh * hd) ** -0.5),
            p + "self_attn.q_norm.weight": rn(hd, scale=0.1, offset=1.0),
            p + "self_attn.k_norm.weight": rn(hd, scale=0.1, offset=1.0),
            p + "mlp.gate_proj.weight": rn(inter, h, scale=h ** -0.5),
            p + "mlp.up_proj.weight": rn(inter, h, scale=h ** -0.5),
            p + "mlp.down_proj.weight": rn(h, inter, scale=inter ** -0.5),
        })
        for conv in ("attention_conv", "mlp_conv"):
            base = rn(2, taps, h, scale=0.3)
            base[:, 0] += 1.0
            w[f"{p}{conv}.base_kernel"] = base
            w[f"{p}{conv}.kernel_projection.weight"] = rn(2 * taps * groups, h, scale=0.3 * h ** -0.5)
    return w


def make_inputs(config: dict = CONFIG, seed: int = SEED + 1) -> Dict[str, torch.Tensor]:
    """The target's context features per request, the block's input embeddings, the
    anchors, the target's LM head and the walk's uniforms."""
    g = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    feats = len(config["dflash_config"]["target_layer_ids"])
    bs, block = len(PREFIX_LENS), block_size(config)
    return {
        "prefix_lens": torch.tensor(PREFIX_LENS, dtype=torch.int64),
        "target_hidden": torch.randn(sum(PREFIX_LENS), feats * h, generator=g),
        "block_embeds": torch.randn(bs * block, h, generator=g),
        "anchor_ids": torch.randint(0, v - 1, (bs,), generator=g),
        "lm_head": torch.randn(v, h, generator=g) * 0.5,
        "uniforms": torch.rand(bs, block - 1, generator=g),
        "temperatures": torch.tensor(TEMPERATURES, dtype=torch.float32),
    }


def positions(inputs: Dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """Block rows sit at committed length + block offset."""
    return (inputs["prefix_lens"].view(-1, 1) + torch.arange(block).view(1, -1)).reshape(-1)


class BlockAttention:
    """Each request's block rows attend to its context K/V and its block's K/V.

    ``ctx[layer_id]`` is a list over requests of ``(k [P, kv_heads, hd], v [...])``.
    """

    def __init__(self, ctx: Dict[int, List], block: int):
        self.ctx, self.block = ctx, block

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        nh, nkv, hd = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q = q.reshape(-1, nh, hd)
        k = k.reshape(-1, nkv, hd)
        v = v.reshape(-1, nkv, layer.v_head_dim)
        out = []
        for b, (ck, cv) in enumerate(self.ctx[layer.layer_id]):
            rows = slice(b * self.block, (b + 1) * self.block)
            kk = torch.cat([ck, k[rows]]).repeat_interleave(nh // nkv, 1)
            vv = torch.cat([cv, v[rows]]).repeat_interleave(nh // nkv, 1)
            s = torch.einsum("qhd,khd->hqk", q[rows].float(), kk.float()) * layer.scaling
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv.float()))
        return torch.cat(out).reshape(q.shape[0], -1).to(q.dtype)


def context_kv(model, target_hidden: torch.Tensor, prefix_lens: Sequence[int]) -> Dict[int, List]:
    """The drafter's context K/V per layer and request, as the DFlash worker's
    sequential path materialises it (projection, K/V, k-norm, RoPE at 0..P-1)."""
    ctx: Dict[int, List] = {}
    start = 0
    for p in [int(x) for x in prefix_lens]:
        hidden = model.project_target_hidden(target_hidden[start : start + p])
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, hidden))
            k = attn.apply_k_rope(torch.arange(p), attn.apply_k_norm(k))
            ctx.setdefault(attn.attn.layer_id, []).append(
                (k.view(p, attn.num_kv_heads, attn.head_dim), v.view(p, attn.num_kv_heads, attn.head_dim))
            )
        start += p
    return ctx


def verify_mode_batch():
    """The draft forward's ForwardBatch as far as the drafter reads it (TARGET_VERIFY)."""
    mode = SimpleNamespace(
        is_extend=lambda *a, **k: False,
        is_target_verify=lambda *a, **k: True,
        is_decode=lambda *a, **k: False,
        is_idle=lambda *a, **k: False,
    )
    return SimpleNamespace(forward_mode=mode, global_num_token_non_padded_cpu=None)


def drafter_hidden(model, inputs: Dict[str, torch.Tensor], radix_attention_module) -> torch.Tensor:
    """The drafter's block forward: ``[bs * block, hidden]``."""
    from unittest import mock

    block = int(model.block_size)
    backend = BlockAttention(context_kv(model, inputs["target_hidden"], inputs["prefix_lens"].tolist()), block)
    with mock.patch.object(radix_attention_module, "get_attn_backend", lambda: backend), torch.no_grad():
        out = model(None, positions(inputs, block), verify_mode_batch(), input_embeds=inputs["block_embeds"])
    return out.hidden_states


class LMHead(torch.nn.Module):
    """The target's LM head as the selector reads it (one rank, no padding)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.org_vocab_size = weight.shape[0]
