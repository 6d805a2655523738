# SPDX-License-Identifier: Apache-2.0
"""The target's token at every verified node, as the server's sampler would pick it.

Used by DFLASH (a chain) and DDTREE (a tree) after the verify forward, in the
sampler's own order: penalties along each node's root path and the logit bias
(``node_logits``), the grammar mask, custom logit processors, then the argmax of a
greedy batch or one draw per node by the sampling backend (``node_draws``). Acceptance
is then the greedy walk over these tokens, whatever the sampling parameters, and the
step advances the penalty table (``penalty_table``) by what it commits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch

from sglang.srt.ddtree_environ import ddtree_envs
from sglang.srt.distributed import get_tp_group
from sglang.srt.layers.sampler import apply_custom_logit_processor
from sglang.srt.runtime_context import get_exec, get_spec
from sglang.srt.speculative.verify_sampling.node_draws import (
    FusedDraw,
    NodeSamplingInfo,
    chunk_rows,
    draw_node_tokens,
)
from sglang.srt.speculative.verify_sampling.node_logits import (
    NodePaths,
    PenaltyRows,
    apply_node_logit_adjustments,
)
from sglang.srt.speculative.verify_sampling.penalty_table import PenaltyTable
from sglang.srt.speculative.verify_sampling.sampling_filters import Candidates, FilterRule
from sglang.srt.speculative.verify_sampling.workspace import workspace_bytes
from sglang.srt.utils.async_probe import sanitize_nan_logits

logger = logging.getLogger(__name__)

#: ``SGLANG_DDTREE_VERIFY_DRAW``: how unseeded nodes are drawn (``node_draws``).
DRAWS = ("fused", "sampler")


class VerifyTokens(NamedTuple):
    tokens: torch.Tensor  # [bs, N] int64: the target's token at every node
    penalties: Optional[PenaltyRows]  # the rows this step read, advanced by ``commit``


@dataclass(frozen=True)
class GraphDraw:
    """A sampled batch's per-node draw as a CUDA graph holds it: which filters the batch uses
    and the fused draw's cut (``None``: no filter, the plain Gumbel draw). Fixed while the
    batch's requests are; their parameters are tensors, read per step."""

    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    fused: Optional[FusedDraw]

    def tokens(self, logits, temperatures, top_ks, top_ps, min_ps, nodes: int, seed: torch.Tensor) -> torch.Tensor:
        """``[rows]`` draws, exactly ``target_tokens``'s for the batch (``temperatures``
        ``[requests, 1]``, the others ``[requests]`` or None; ``seed`` keys the uniforms)."""
        info = NodeSamplingInfo(
            temperatures, top_ks, top_ps, min_ps, None,
            self.need_top_k, self.need_top_p, self.need_min_p, nodes=nodes,
        )  # fmt: skip
        return draw_node_tokens(logits, info, None, None, 0, self.fused, seed=seed)


class VerifySampler:
    def __init__(self, *, vocab_size: int, device, sampler, sampling_backend: Optional[str]):
        if getattr(sampler, "rl_on_policy_target", None) is not None:
            raise ValueError(
                "DFLASH/DDTREE verify draws with the sampling backend's kernels; "
                "--rl-on-policy-target's log-softmax sampling is not reproduced. "
                "Serve RL rollouts without speculative decoding."
            )
        draw = ddtree_envs.SGLANG_DDTREE_VERIFY_DRAW.get()
        if draw not in DRAWS:
            raise ValueError(f"SGLANG_DDTREE_VERIFY_DRAW={draw!r}: expected one of {', '.join(DRAWS)}")
        self.table = PenaltyTable(vocab_size, device)
        self.vocab_size = vocab_size
        self.backend = sampling_backend
        self.fused = draw == "fused"
        self._sample_from_probs = sampler._sample_from_probs
        self.max_rows = chunk_rows(vocab_size, workspace_bytes(), sampling_backend)
        self.max_fused_rows = chunk_rows(vocab_size, workspace_bytes(), "fused")
        self.max_sorted_rows = chunk_rows(vocab_size, workspace_bytes(), "sort")
        self.split_rows = ddtree_envs.SGLANG_DDTREE_FLOORS_SPLIT_ROWS.get()

    @classmethod
    def for_target(cls, model_runner) -> "VerifySampler":
        """The verify sampler of a target model runner (its vocabulary and sampler)."""
        spec = get_spec()
        if spec.speculative_accept_threshold_single != 1.0 or spec.speculative_accept_threshold_acc != 1.0:
            raise ValueError(
                "DFLASH/DDTREE verify is lossless: every emitted token is the target's own "
                "draw, so --speculative-accept-threshold-single/-acc (which accept drafts "
                "the target would not have sampled) do not apply. Leave them at 1.0."
            )
        return cls(
            vocab_size=model_runner.model_config.vocab_size,
            device=model_runner.device,
            sampler=model_runner.sampler,
            sampling_backend=get_exec().kernel.sampling_backend,
        )

    def target_tokens(
        self,
        logits: torch.Tensor,
        sampling_info: Any,
        reqs: Sequence[Any],
        paths: NodePaths,
        positions: torch.Tensor,
        grammar_mask: Any = None,
    ) -> VerifyTokens:
        """``logits`` ``[bs * N, V]`` float32 (overwritten); ``positions`` ``[bs, N]`` the
        nodes' positions (the seeded draw's per-token key)."""
        bs, n = paths.tokens.shape
        penalties = None
        bias = None
        if sampling_info is not None:
            if _penalised(sampling_info):
                penalties = self.table.rows_for(reqs)
            bias = sampling_info.logit_bias
        apply_node_logit_adjustments(logits, paths, penalties, bias)
        if grammar_mask is not None:
            grammar_mask.apply(logits)
        if sampling_info is not None and sampling_info.has_custom_logit_processor:
            apply_custom_logit_processor(logits, sampling_info, num_tokens_in_batch=n)
        sanitize_nan_logits(logits, "verify: next_token_logits")
        if sampling_info is None or sampling_info.is_all_greedy:
            tokens = torch.argmax(logits, dim=-1)
        else:
            tokens = draw_node_tokens(
                logits,
                NodeSamplingInfo.for_nodes(sampling_info, n),
                self._sample_from_probs,
                positions.reshape(-1),
                self.max_rows,
                self._fused_draw(sampling_info, reqs) if self.fused else None,
            )
            tp_group = get_tp_group()
            if tp_group.world_size > 1:
                # Ranks draw from identical logits but their own generators: rank 0's
                # draws decide, so every rank commits the same tokens and KV.
                tp_group.broadcast(tokens, src=0)
        return VerifyTokens(tokens.view(bs, n), penalties)

    def graph_draw(self, sampling_info: Any, reqs: Sequence[Any]) -> Optional[GraphDraw]:
        """How a sampled batch's nodes are drawn inside a CUDA graph, or None where the step
        draws eagerly: a penalty, a logit bias or a custom logit processor (the logits are
        adjusted first), a seeded request (the sampler's seeded path), tensor parallelism
        (rank 0's draws are broadcast), or a filter drawn by the sampler's kernels
        (``SGLANG_DDTREE_VERIFY_DRAW=sampler``). A greedy batch is the argmax: None too."""
        if sampling_info is None or sampling_info.is_all_greedy:
            return None
        if (
            _adjusts_logits(sampling_info)
            or sampling_info.sampling_seed is not None
            or get_tp_group().world_size > 1
        ):
            return None
        info = NodeSamplingInfo.for_nodes(sampling_info, 1)
        if info.simple:
            return GraphDraw(False, False, False, None)
        if not self.fused:
            return None
        return GraphDraw(
            info.need_top_k_sampling,
            info.need_top_p_sampling,
            info.need_min_p_sampling,
            self._fused_draw(sampling_info, reqs),
        )

    def _fused_draw(self, sampling_info: Any, reqs: Sequence[Any]) -> FusedDraw:
        params = [r.sampling_params for r in reqs]
        return FusedDraw(
            rule=FilterRule.for_backend(self.backend, bool(sampling_info.need_min_p_sampling)),
            candidates=Candidates.for_requests(
                [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params], self.vocab_size
            ),
            max_rows=self.max_fused_rows,
            max_sorted_rows=self.max_sorted_rows,
            split_rows=self.split_rows,
        )

    def commit(
        self,
        step: VerifyTokens,
        root: torch.Tensor,
        emitted: torch.Tensor,
        num_emitted: torch.Tensor,
    ) -> None:
        """After acceptance: ``root`` ``[bs]`` the step's root token, ``emitted`` ``[bs, W]``
        the tokens the step emits (accepted drafts, then the next root) and
        ``num_emitted`` ``[bs]`` how many."""
        if step.penalties is not None:
            self.table.commit(step.penalties, root, emitted, num_emitted)


def plain_argmax(sampling_info: Any) -> bool:
    """Whether every node's target token is the bare argmax of its verify logits: all requests
    greedy, with no penalty, logit bias or custom logit processor (a grammar is the batch's)."""
    return sampling_info is None or (bool(sampling_info.is_all_greedy) and not _adjusts_logits(sampling_info))


def _adjusts_logits(sampling_info: Any) -> bool:
    """Whether the batch's logits are adjusted before its tokens are picked: a penalty, a
    logit bias or a custom logit processor."""
    return (
        _penalised(sampling_info)
        or sampling_info.logit_bias is not None
        or bool(sampling_info.has_custom_logit_processor)
    )


def _penalised(sampling_info: Any) -> bool:
    """Whether any request of the batch has a penalty (upstream accumulates its penalizers'
    state into these tensors for the forward exactly when one is required)."""
    orchestrator = getattr(sampling_info, "penalizer_orchestrator", None)
    return (
        getattr(sampling_info, "acc_additive_penalties", None) is not None
        or getattr(sampling_info, "acc_scaling_penalties", None) is not None
        or (orchestrator is not None and orchestrator.is_required)
    )
