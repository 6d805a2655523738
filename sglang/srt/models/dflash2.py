# SPDX-License-Identifier: Apache-2.0
"""DFlash 2 drafter (``architectures: ["DFlash2DraftModel"]``) for SGLang 0.5.17.

A DFlash 2 drafter is the DFlash drafter of ``models/dflash.py`` (same attention,
MLP, norms, context projection ``fc`` + ``hidden_norm``, same checkpoint names)
with two additions, both read from the checkpoint's ``dflash_config``
(``speculative/dflash2/config.py``):

**Grouped dynamic convolution** (``conv_kernel_size`` taps, ``conv_group_size``
channels per group). Around each layer's attention and around its MLP, one
linear map of the sublayer's (normed) input gives, per row n, a coefficient per
(side, tap, group) that is added to a learned per-(side, tap, channel) base
kernel. The input side convolves the sublayer's input, the output side its
output::

    y[n, c] = sum_t (base[side, t, c] + delta[n, side, t, group(c)]) * x[n - t, c]

where a tap t reaches back only within the row's own draft block (rows at block
offset < t get nothing from it). Weights: ``layers.{i}.attention_conv`` and
``layers.{i}.mlp_conv``, each ``base_kernel [2, taps, hidden]`` and
``kernel_projection.weight [2 * taps * groups, hidden]``. The block-offset
layout follows the block the worker drafts with (``set_block_size``).

**Candidate selector** (``speculative/dflash2/selector.py``): the top-K tokens of
each block slot through the target's LM head, and K x K transition scores
between adjacent slots; the worker walks one path through them. Weights:
``candidate_selector.{predecessor_codebook, successor_codebook}`` ``[vocab,
rank]`` and ``candidate_selector.hidden_projection.weight [rank, hidden]``.

Features of other DFlash checkpoint families that this drafter does not
implement are refused when it is built (``config.check_supported``).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.dflash import (
    DFlashAttention,
    DFlashDecoderLayer,
    DFlashDraftModel,
)
from sglang.srt.speculative.dflash2.config import (
    DFlash2Config,
    UnsupportedDFlash2Checkpoint,
    check_supported,
    parse_dflash2_config,
)
from sglang.srt.speculative.dflash2.selector import (
    CandidateSelector,
    candidate_topk,
    transform_unary_logits,
)
from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
from sglang.srt.utils.hf_transformers_utils import get_rope_config

logger = logging.getLogger(__name__)

# rope_scaling keys an explicit rope_dim makes meaningless for a drafter.
_ROPE_DIM_DROPS = frozenset({"rope_dim", "partial_rotary_factor", "mrope_section", "mrope_interleaved"})


def grouped_block_conv(
    x: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block_size: int,
    group_size: int,
) -> torch.Tensor:
    """One side of the grouped dynamic convolution over rows laid out block by block.

    ``x [N, C]`` rows (N a multiple of the block, or any N for a single partial
    block), ``delta [N, taps, groups]`` per-row coefficients, ``base [taps, C]``.
    Row n's output mixes rows n, n-1, ..., n-taps+1 of its own block.
    """
    n, channels = x.shape
    taps = base.shape[0]
    groups = channels // group_size
    xg = x.view(n, groups, group_size)
    kernel = base.view(1, taps, groups, group_size) + delta.unsqueeze(-1)
    out = kernel[:, 0] * xg
    offset = torch.arange(n, device=x.device) % block_size
    for t in range(1, min(taps, n)):
        earlier = torch.cat([xg.new_zeros((t, groups, group_size)), xg[:-t]])
        earlier = torch.where((offset >= t).view(n, 1, 1), earlier, torch.zeros_like(earlier))
        out = out + kernel[:, t] * earlier
    return out.reshape(n, channels)


class DFlash2GroupedConv(nn.Module):
    """The convolution pair wrapped around one sublayer (attention or MLP)."""

    def __init__(self, hidden_size: int, block_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise UnsupportedDFlash2Checkpoint(
                f"DFlash 2 conv_group_size={group_size} does not divide hidden_size={hidden_size}."
            )
        self.block_size = int(block_size)
        self.taps = int(taps)
        self.group_size = int(group_size)
        self.num_groups = int(hidden_size) // self.group_size
        # [input side / output side, tap, channel]; identity until loaded.
        base = torch.zeros(2, self.taps, int(hidden_size))
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base, requires_grad=False)
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.taps * self.num_groups, bias=False)

    def prepare(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Convolve the sublayer's input; return it and the output side's coefficients."""
        coeff = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)
        y = grouped_block_conv(x, coeff[:, 0], self.base_kernel[0], self.block_size, self.group_size)
        return y, coeff[:, 1]

    def finish(self, x: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
        """Convolve the sublayer's output with the coefficients ``prepare`` returned."""
        return grouped_block_conv(x, coeff, self.base_kernel[1], self.block_size, self.group_size)


def _rotary_for(config, head_dim: int):
    """The RoPE a DFlash 2 layer uses when the checkpoint asks for a partial rotary
    width (``partial_rotary_factor`` or ``rope_scaling.rope_dim``); None when it
    is the full head, which DFlashAttention already builds."""
    rope_theta, rope_scaling = get_rope_config(config)
    rotary_dim = head_dim
    partial = float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    if rope_scaling is not None and "rope_dim" in rope_scaling:
        rotary_dim = int(rope_scaling["rope_dim"])
        partial = 1.0
        rope_scaling = {k: v for k, v in rope_scaling.items() if k not in _ROPE_DIM_DROPS}
    if rotary_dim == head_dim and partial >= 1.0:
        return None
    return get_rope(
        head_dim,
        rotary_dim=rotary_dim,
        max_position=int(getattr(config, "max_position_embeddings", 32768)),
        base=rope_theta,
        rope_scaling=rope_scaling,
        is_neox_style=bool(getattr(config, "rope_is_neox_style", getattr(config, "is_neox_style", True))),
        partial_rotary_factor=partial,
    )


class DFlash2Attention(DFlashAttention):
    def __init__(self, config, layer_id: int, quant_config=None) -> None:
        super().__init__(config=config, layer_id=layer_id, quant_config=quant_config)
        rotary = _rotary_for(config, self.head_dim)
        self.partial_rotary = rotary is not None
        if rotary is not None:
            self.rotary_emb = rotary


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash decoder layer with the grouped convolution around both sublayers."""

    attention_cls = DFlash2Attention

    def __init__(self, config, layer_id: int, quant_config=None) -> None:
        super().__init__(config=config, layer_id=layer_id, quant_config=quant_config)
        fields = parse_dflash2_config(config)
        block = parse_dflash_draft_config(draft_hf_config=config).resolve_block_size(default=16)
        hidden = int(config.hidden_size)

        def conv() -> Optional[DFlash2GroupedConv]:
            if not fields.has_conv:
                return None
            return DFlash2GroupedConv(hidden, block, fields.conv_kernel_size, fields.conv_group_size)

        self.attention_conv = conv()
        self.mlp_conv = conv()

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if hidden_states.numel() == 0:
            return hidden_states, hidden_states if residual is None else residual
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)

        coeff = None
        if self.attention_conv is not None:
            hidden_states, coeff = self.attention_conv.prepare(hidden_states)
        attn_out = self.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        if coeff is not None:
            attn_out = self.attention_conv.finish(attn_out, coeff)

        hidden_states, residual = self.post_attention_layernorm(attn_out, residual)
        coeff = None
        if self.mlp_conv is not None:
            hidden_states, coeff = self.mlp_conv.prepare(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if coeff is not None:
            hidden_states = self.mlp_conv.finish(hidden_states, coeff)
        return hidden_states, residual


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2 drafter: DFlash layers with the grouped convolution, plus the
    candidate selector. Like DFlash it has no embedding and no LM head of its
    own; the worker lends it the target's (``lm_head`` is set before use)."""

    decoder_layer_cls = DFlash2DecoderLayer

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        # Not DFlashDraftModel.__init__: its count of target layers assumes
        # num_target_layers is present, which DFlash 2 checkpoints may omit.
        nn.Module.__init__(self)
        self.config = config
        self.dflash2: DFlash2Config = check_supported(config)
        hidden_size = int(config.hidden_size)
        num_layers = int(config.num_hidden_layers)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        draft = parse_dflash_draft_config(draft_hf_config=config)
        self.block_size = draft.resolve_block_size(default=16)

        self.layers = nn.ModuleList(
            [self.decoder_layer_cls(config=config, layer_id=i, quant_config=quant_config) for i in range(num_layers)]
        )
        self.norm = RMSNorm(hidden_size, eps=eps)

        # Context features: concat over the tapped target layers -> hidden. The
        # target's layer count is not known here; bound it by the taps.
        if draft.num_target_layers is not None:
            target_layers = int(draft.num_target_layers)
        elif draft.target_layer_ids is not None:
            target_layers = max(draft.target_layer_ids) + 1
        else:
            target_layers = num_layers
        taps = draft.resolve_target_layer_ids(target_num_layers=target_layers, draft_num_layers=num_layers)
        self.num_context_features = len(taps)
        self.fc = nn.Linear(self.num_context_features * hidden_size, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, eps=eps)

        # The fused context-KV kernel rotates the whole head.
        self.supports_fused_context_kv = not any(layer.self_attn.partial_rotary for layer in self.layers)

        self.candidate_selector = CandidateSelector(
            hidden_size=hidden_size,
            vocab_size=int(config.vocab_size),
            rank=self.dflash2.selector_rank,
            top_k=self.dflash2.selector_top_k,
        )
        self.lm_head: Optional[nn.Module] = None

    # ------------------------------------------------------------ block size

    def set_block_size(self, block_size: int) -> None:
        """The block the worker drafts with (it may differ from the
        checkpoint's): the convolution's taps stop at its boundaries."""
        self.block_size = int(block_size)
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.block_size = self.block_size

    # ------------------------------------------------------------- selector

    def compute_candidates(self, hidden: torch.Tensor, lm_head: Optional[nn.Module] = None):
        """Top-K candidates of each row through the target's LM head:
        ``hidden [N, H]`` -> ``(ids [N, K] int64, unary logits [N, K] float32)``."""
        head = lm_head if lm_head is not None else self.lm_head
        if head is None:
            raise RuntimeError("DFlash 2 drafter: the target's lm_head was not attached.")
        ids, values = candidate_topk(hidden, head, self.candidate_selector.top_k)
        return ids, transform_unary_logits(
            values, self.dflash2.output_multiplier, self.dflash2.final_logit_softcapping
        )

    def selector_lattice(
        self,
        slot_hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        lm_head: Optional[nn.Module] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Candidates and transition scores of a drafted block.

        ``slot_hidden [bs, S, H]`` are the drafter's outputs at the block's
        mask slots (block offsets 1..S), ``anchor_ids [bs]`` the block's first
        token (the verified bonus). Returns ``candidate_ids [bs, S, K]`` and
        ``scores [bs, S, K, K]`` float32, where ``scores[b, s, p, c]`` scores
        candidate c at slot s after candidate p at slot s - 1 (after the anchor
        for s = 0: every row p of slot 0 is the same).
        """
        bs, slots, width = slot_hidden.shape
        ids, unary = self.compute_candidates(slot_hidden.reshape(bs * slots, width), lm_head)
        ids = ids.view(bs, slots, -1)
        scores = self.candidate_selector.lattice(ids, unary.view(bs, slots, -1), slot_hidden, anchor_ids)
        return ids, scores

    # -------------------------------------------------------------- weights

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        """DFlash's loader, plus a check that every DFlash 2 tensor was in the
        checkpoint (a missing one would leave an identity or zero kernel)."""
        required = {
            name
            for name, _ in self.named_parameters()
            if name.startswith("candidate_selector.") or "_conv." in name
        }
        seen = set()

        def tracked():
            for name, tensor in weights:
                plain = name[len("model."):] if name.startswith("model.") else name
                seen.add(plain)
                yield name, tensor

        super().load_weights(tracked())
        missing = sorted(required - seen)
        if missing:
            raise UnsupportedDFlash2Checkpoint(
                "DFlash 2 checkpoint is missing tensors the drafter needs: "
                + ", ".join(missing[:8])
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                + "."
            )


class DFlash2BeamDraftModel(DFlash2DraftModel):
    """The same drafter under the architecture name some checkpoints declare."""


class MiniMaxDFlash2DraftModel(DFlash2DraftModel):
    """The same drafter under the architecture name some checkpoints declare."""


EntryClass = [DFlash2DraftModel, DFlash2BeamDraftModel, MiniMaxDFlash2DraftModel]
