# SPDX-License-Identifier: Apache-2.0
"""The learned pair's two networks in plain torch, with the parameter names of the
checkpoints they become.

``Target`` is a Qwen3 dense decoder (GQA, per-head q/k RMSNorm, neox RoPE, SwiGLU MLP,
tied embeddings): its ``state_dict`` is what transformers' ``Qwen3ForCausalLM`` and
SGLang's ``qwen3.py`` load. ``Drafter`` is a DFlash draft model as SGLang's
``models/dflash.py`` defines it: no embedding or head of its own (it borrows the target's),
``fc`` + ``hidden_norm`` project the concatenated hidden states of the target layers in
``target_layer_ids`` into context features, and every draft layer attends, without a causal
mask, to the context features (keys/values straight from its ``k_proj``/``v_proj``, no
layernorm) and to the block ``[anchor token, MASK x (block_size - 1)]``.

The hidden state "after target layer i" is the residual stream leaving layer i, which is
what SGLang captures before layer i + 1 and what HF's ``hidden_states[i + 1]`` holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int = 8192
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def n_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * hd
        mlp = 3 * h * self.intermediate_size
        return self.vocab_size * h + self.num_hidden_layers * (attn + mlp + 2 * h) + h


@dataclass(frozen=True)
class DrafterShape:
    num_hidden_layers: int = 2
    intermediate_size: int = 768
    target_layer_ids: tuple = (1, 3)
    block_size: int = 16
    # DFlash's position weight exp(-(k - 1) / gamma) for block offset k >= 1 (block 16: 7).
    loss_decay_gamma: float = 7.0
    # DFlash 2 (all zero: a DFlash drafter): the grouped convolution's taps and channels
    # per group, the selector's codebook rank and candidates per slot.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def dflash2(self) -> bool:
        return self.selector_rank > 0


def dflash2_shape(shape: DrafterShape, hidden_size: int, *, taps: int = 4, rank: int = 32,
                  top_k: int = 8) -> DrafterShape:
    """``shape`` as a DFlash 2 drafter: channel groups of the largest divisor of the hidden
    size up to 64."""
    group = max(g for g in range(1, 65) if hidden_size % g == 0)
    return replace(shape, conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top_k)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer choice upstream makes when a checkpoint names none (dflash_utils.py's rule)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"a {num_draft_layers}-layer drafter needs a target of at least 4 layers")
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    """HF Qwen3RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


class Rope(nn.Module):
    """Neox-style rotary embedding (rotate_half), cos/sin tables in fp32."""

    def __init__(self, head_dim: int, max_pos: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, T, heads, hd]; pos: [B, T] or [T]."""
        cos = self.cos[pos].unsqueeze(-2)
        sin = self.sin[pos].unsqueeze(-2)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, shape: TargetShape):
        super().__init__()
        h, hd = shape.hidden_size, shape.head_dim
        self.nh, self.nkv, self.hd = shape.num_attention_heads, shape.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, shape.rms_norm_eps)
        self.k_norm = RMSNorm(hd, shape.rms_norm_eps)

    def q(self, x, pos, rope):
        b, t, _ = x.shape
        return rope(self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)), pos)

    def kv(self, x, pos, rope):
        b, t, _ = x.shape
        k = rope(self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)), pos)
        return k, self.v_proj(x).view(b, t, self.nkv, self.hd)

    def attend(self, q, k, v, mask=None, causal=False):
        """q: [B, Tq, nh, hd], k/v: [B, Tk, nkv, hd] -> [B, Tq, nh * hd]."""
        if self.nkv != self.nh:
            # Query head h reads KV head h // (nh / nkv), as HF's repeat_kv. Expanded by hand:
            # SDPA's enable_gqa has no memory-efficient kernel, which a masked call needs.
            k = k.repeat_interleave(self.nh // self.nkv, dim=2)
            v = v.repeat_interleave(self.nh // self.nkv, dim=2)
        # Under autocast the projections are bf16 but the norms' outputs fp32: one dtype for SDPA.
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=causal, scale=self.hd ** -0.5,
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DecoderLayer(nn.Module):
    def __init__(self, shape: TargetShape, intermediate_size: Optional[int] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape.hidden_size, intermediate_size or shape.intermediate_size)

    def mlp_block(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


class _Qwen3Model(nn.Module):
    """The ``model.`` part of Qwen3ForCausalLM (names as HF saves them)."""

    def __init__(self, shape: TargetShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class KVCache:
    """Preallocated per-layer K/V of a batch of equally long sequences (no padding needed)."""

    def __init__(self, shape: TargetShape, batch: int, max_len: int, device, dtype):
        kv = (batch, max_len, shape.num_key_value_heads, shape.head_dim)
        self.k = [torch.empty(kv, device=device, dtype=dtype) for _ in range(shape.num_hidden_layers)]
        self.v = [torch.empty(kv, device=device, dtype=dtype) for _ in range(shape.num_hidden_layers)]
        self.length = 0


class Target(nn.Module):
    def __init__(self, shape: TargetShape):
        super().__init__()
        self.shape = shape
        self.model = _Qwen3Model(shape)
        self.rope = Rope(shape.head_dim, shape.max_position_embeddings, shape.rope_theta)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight  # tie_word_embeddings

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """GPT-2 style: N(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
        out_std = std / math.sqrt(2 * self.shape.num_hidden_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=generator) * s)

    def forward(self, ids: torch.Tensor, capture: Sequence[int] = (), cache: Optional[KVCache] = None,
                logits: bool = True, pos: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None):
        """ids [B, T] -> (logits [B, T, V] or final hidden, {layer: hidden after it}).

        With ``cache``, the new tokens attend to the cached ones and append their K/V.
        ``pos`` [T] and ``mask`` [T, cached + T] (True = visible) replace the positions after the
        cache and the causal mask: the cache then holds the nodes of a token tree, each new
        token seeing only its context and ancestors (the oracle tree in ``evaluate.py``).
        """
        b, t = ids.shape
        start = cache.length if cache is not None else 0
        if pos is None:
            pos = torch.arange(start, start + t, device=ids.device)
        h = self.model.embed_tokens(ids)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q(x, pos, self.rope)
            k, v = attn.kv(x, pos, self.rope)
            if cache is not None:
                cache.k[i][:, start : start + t] = k
                cache.v[i][:, start : start + t] = v
                k, v = cache.k[i][:, : start + t], cache.v[i][:, : start + t]
            # A query sees every cached key and the new keys up to itself.
            causal = t > 1
            if mask is not None:
                h = h + attn.attend(q, k, v, mask=mask)
            elif causal and start > 0:
                mask = torch.ones(t, start + t, dtype=torch.bool, device=ids.device).tril(start)
                h = h + attn.attend(q, k, v, mask=mask)
            else:
                h = h + attn.attend(q, k, v, causal=causal)
            h = layer.mlp_block(h)
            if i in capture:
                captured[i] = h
        if cache is not None:
            cache.length = start + t
        h = self.model.norm(h)
        return (F.linear(h, self.lm_head_weight) if logits else h), captured

    def hf_config(self, eos_token_id: int, pad_token_id: int) -> dict:
        s = self.shape
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": s.vocab_size,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_hidden_layers,
            "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": s.max_position_embeddings,
            "rope_theta": s.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": s.rms_norm_eps,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "torch_dtype": "bfloat16",
        }


class GroupedBlockConv(nn.Module):
    """DFlash 2's grouped dynamic convolution around one sublayer, over rows laid out block
    by block (``[B, N * block, C]``): per row, per (side, tap, group) a coefficient from a
    projection of the sublayer's input, added to a learned per-(side, tap, channel) base
    kernel; tap t reads the row t earlier in the same block. Side 0 convolves the
    sublayer's input, side 1 its output. Names as the checkpoint saves them."""

    def __init__(self, hidden: int, taps: int, group: int, block_size: int):
        super().__init__()
        self.taps, self.group, self.groups, self.block = taps, group, hidden // group, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def reset(self, generator: torch.Generator, std: float) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0  # the identity, until trained
            self.kernel_projection.weight.copy_(torch.randn(self.kernel_projection.weight.shape, generator=generator) * std)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        return self.kernel_projection(x).view(b, q, 2, self.taps, self.groups)

    def convolve(self, x: torch.Tensor, coeff: torch.Tensor, side: int) -> torch.Tensor:
        """``coeff [B, Q, 2, taps, groups]`` from the sublayer's input."""
        b, q, c = x.shape
        xg = x.view(b, q, self.groups, self.group)
        kernel = self.base_kernel[side].view(1, 1, self.taps, self.groups, self.group) + coeff[:, :, side].unsqueeze(-1)
        out = kernel[:, :, 0] * xg
        offset = torch.arange(q, device=x.device) % self.block
        for t in range(1, min(self.taps, q)):
            earlier = F.pad(xg[:, :-t], (0, 0, 0, 0, t, 0))
            earlier = torch.where((offset >= t).view(1, q, 1, 1), earlier, torch.zeros_like(earlier))
            out = out + kernel[:, :, t] * earlier
        return out.reshape(b, q, c)


class CandidateSelector(nn.Module):
    """DFlash 2's transition scorer: candidate c after token p at a slot with hidden h
    scores ``<P[p] * W h, Q[c]>`` on top of c's logit. Names as the checkpoint saves them."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def pair(self, previous: torch.Tensor, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``previous [...]`` token ids, ``hidden [..., H]``, ``candidates [..., K]`` -> ``[..., K]``."""
        left = self.predecessor_codebook[previous] * self.hidden_projection(hidden)
        return torch.einsum("...r,...kr->...k", left, self.successor_codebook[candidates])


class Drafter(nn.Module):
    """DFlash draft layers; the embedding and LM head are the target's (frozen, not saved).
    With a DFlash 2 ``shape`` the layers also carry the grouped convolution
    (``attention_conv``, ``mlp_conv``) and the drafter the candidate selector."""

    def __init__(self, target_shape: TargetShape, shape: DrafterShape):
        super().__init__()
        if max(shape.target_layer_ids) >= target_shape.num_hidden_layers - 1:
            # SGLang captures "before layer i + 1": the last layer's output is never captured.
            raise ValueError(f"target_layer_ids {shape.target_layer_ids} must be below the last target layer")
        self.tshape, self.shape = target_shape, shape
        h = target_shape.hidden_size
        self.layers = nn.ModuleList(
            DecoderLayer(target_shape, shape.intermediate_size) for _ in range(shape.num_hidden_layers)
        )
        self.norm = RMSNorm(h, target_shape.rms_norm_eps)
        self.fc = nn.Linear(len(shape.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, target_shape.rms_norm_eps)
        self.rope = Rope(target_shape.head_dim, target_shape.max_position_embeddings, target_shape.rope_theta)
        if shape.conv_kernel_size:
            for layer in self.layers:
                layer.attention_conv = GroupedBlockConv(h, shape.conv_kernel_size, shape.conv_group_size,
                                                        shape.block_size)  # fmt: skip
                layer.mlp_conv = GroupedBlockConv(h, shape.conv_kernel_size, shape.conv_group_size, shape.block_size)
        if shape.dflash2:
            self.candidate_selector = CandidateSelector(h, target_shape.vocab_size, shape.selector_rank,
                                                        shape.selector_top_k)  # fmt: skip

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        Target.init_weights(self, generator, std)  # same rule; num_hidden_layers from tshape is fine
        for layer in self.layers:
            for conv in (getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)):
                if conv is not None:
                    conv.reset(generator, std * 0.1)

    @property
    def num_hidden_layers(self):
        return self.shape.num_hidden_layers

    def context(self, captured: dict) -> torch.Tensor:
        """Concatenated target hidden states (layer order of target_layer_ids) -> context features."""
        feats = torch.cat([captured[i] for i in self.shape.target_layer_ids], dim=-1)
        return self.hidden_norm(self.fc(feats))

    def forward(self, block_embeds: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                ctx_pos: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """block_embeds [B, Q, h] at positions block_pos [B, Q]; ctx [B, S, h] at ctx_pos [B, S] or [S];
        mask [B, 1, Q, S + Q] (True = visible) or None (all visible). Returns normed hidden [B, Q, h]."""
        h = block_embeds
        for layer in self.layers:
            attn = layer.self_attn
            conv = getattr(layer, "attention_conv", None)
            x = layer.input_layernorm(h)
            if conv is not None:
                coeff = conv.coefficients(x)
                x = conv.convolve(x, coeff, 0)
            q = attn.q(x, block_pos, self.rope)
            k_blk, v_blk = attn.kv(x, block_pos, self.rope)
            k_ctx, v_ctx = attn.kv(ctx, ctx_pos, self.rope)
            k = torch.cat([k_ctx, k_blk], dim=1)
            v = torch.cat([v_ctx, v_blk], dim=1)
            out = attn.attend(q, k, v, mask=mask)
            h = h + (out if conv is None else conv.convolve(out, coeff, 1))
            conv = getattr(layer, "mlp_conv", None)
            if conv is None:
                h = layer.mlp_block(h)
            else:
                x = layer.post_attention_layernorm(h)
                coeff = conv.coefficients(x)
                h = h + conv.convolve(layer.mlp(conv.convolve(x, coeff, 0)), coeff, 1)
        return self.norm(h)

    def hf_config(self, target_config: dict, mask_token: str, mask_token_id: int) -> dict:
        t = target_config
        config = {
            "architectures": ["DFlash2DraftModel" if self.shape.dflash2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "vocab_size": t["vocab_size"],
            "hidden_size": t["hidden_size"],
            "intermediate_size": self.shape.intermediate_size,
            "num_hidden_layers": self.shape.num_hidden_layers,
            "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"],
            "head_dim": t["head_dim"],
            "hidden_act": "silu",
            "max_position_embeddings": t["max_position_embeddings"],
            "rope_theta": t["rope_theta"],
            "rope_scaling": None,
            "rms_norm_eps": t["rms_norm_eps"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "block_size": self.shape.block_size,
            "num_target_layers": t["num_hidden_layers"],
            "dflash_config": {
                "block_size": self.shape.block_size,
                "target_layer_ids": list(self.shape.target_layer_ids),
                "mask_token": mask_token,
                "mask_token_id": mask_token_id,
                "num_target_layers": t["num_hidden_layers"],
            },
        }
        if self.shape.dflash2:
            config["dflash_config"].update(
                conv_kernel_size=self.shape.conv_kernel_size, conv_group_size=self.shape.conv_group_size,
                selector_rank=self.shape.selector_rank, selector_top_k=self.shape.selector_top_k,
            )  # fmt: skip
        return config


def shapes_dict(target: TargetShape, drafter: DrafterShape) -> dict:
    d = asdict(drafter)
    d["target_layer_ids"] = list(drafter.target_layer_ids)
    return {"target": asdict(target), "drafter": d}
