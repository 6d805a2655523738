# SPDX-License-Identifier: Apache-2.0
"""DDTREE speculative decoding worker (spec-v2, overlap and non-overlap).

Rides on ``DFlashWorkerV2``: same drafter, draft KV pool, prefill path, idle
path and context-KV materialisation. Only the decode step differs:

1. draft: one DFlash forward over ``[bonus, MASK x L]``;
2. per-depth top-K log-probs of the drafter's L distributions;
3. tree build + compile (``tree_build`` / ``tree_compile``) on the GPU;
4. target verify over the N = B + 1 tree tokens with the tree mask;
5. the target's token at every node as the server's sampler picks it
   (``speculative/verify_sampling``), then the greedy walk over them (``accept``);
6. commit: permute the tree's KV window so the kept path comes first
   (``kv_slot_plan``), feed the kept nodes' verify hidden states to the drafter;
   on hybrid linear-attention targets, keep the accepted node's recurrent
   state (``linear_state``).

No step syncs the host, so the overlap scheduler keeps the GPU busy; a verify
planned from the prefix lengths on the host (FlashInfer's prefix pass) waits
for them, copied before the draft, that is for the previous step's work only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional, Tuple

import torch

from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.distributed import get_tp_group
from sglang.srt.environ import envs
from sglang.srt.layers.attention.tree_verify.hook import stage_verify_prefix_lens
from sglang.srt.layers.moe import tree_routing
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative.ddtree import linear_state, step_io
from sglang.srt.speculative.ddtree.accept import greedy_accept
from sglang.srt.speculative.ddtree.budget import TreeBudget
from sglang.srt.speculative.ddtree.budget_policy import AdaptiveBudget
from sglang.srt.speculative.ddtree.dflash_internals import DFlashInternals
from sglang.srt.speculative.ddtree.draft_topk import DraftTopKHead, leading_candidates, lm_head_topk
from sglang.srt.speculative.ddtree.info import (
    DDTreeVerifyInput,
    backend_reads_tree_mask_bits,
    dense_mask_numel_bound,
    dense_verify_mask,
)
from sglang.srt.speculative.ddtree.metrics import DDTreeStepStats, budget_tiers
from sglang.srt.speculative.ddtree.selector_tree import build_selector_tree
from sglang.srt.speculative.ddtree import step_graphs
from sglang.srt.speculative.ddtree.step_graphs import SegmentGraphs
from sglang.srt.speculative.ddtree.step_phases import phase
from sglang.srt.speculative.ddtree.tree_build import build_tree
from sglang.srt.speculative.ddtree.tree_compile import CompiledTree, compile_tree
from sglang.srt.speculative.ddtree.verify_graphs import VerifyGraphs
from sglang.srt.speculative.dflash2.dflash_step import is_selector_drafter
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    prepare_mamba_track_for_verify,
)
from sglang.srt.speculative.verify_sampling.node_logits import NodePaths
from sglang.srt.speculative.verify_sampling.verify_sampler import GraphDraw, plain_argmax
from sglang.srt.utils.async_probe import sanitize_nan_logits

logger = logging.getLogger(__name__)

#: The tensors of a ``CompiledTree``, in the order the step tail takes them.
_TREE_TENSORS = tuple(f.name for f in dataclasses.fields(CompiledTree) if f.name != "max_depth")


class DDTreeWorker(DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
        self._dflash = DFlashInternals(self)
        self._linear_state = False  # set by init_attention_backends
        self.tree = TreeBudget.of(server_args)
        self._algo = SpeculativeAlgorithm.from_string("DDTREE")
        self._context_len = int(self.model_runner.model_config.context_len)
        self._tree_routing = tree_routing.enabled()  # benchmark-only (layers/moe/tree_routing.py)
        # Each step's budget: the configured one, or chosen per step among 1, 2, 4, ... up to
        # it, or among the graph budgets and it (their verifies replay graphs of their own
        # width, captured in ``init_cuda_graphs``).
        self.budget_policy = None
        step_budgets = None
        self._verify_graphs = VerifyGraphs(target_worker.model_runner)
        if server_args.speculative_ddtree_budget_policy == "adaptive":
            step_budgets = (sorted({*self.tree.graph_budgets, self.tree.budget}) if self.tree.graph_budgets
                            else budget_tiers(self.tree.budget))  # fmt: skip
        self.stats = DDTreeStepStats.for_worker(server_args, self.ps, self.tree.budget, step_budgets)
        if step_budgets is not None:
            if not self.stats.enabled:
                raise ValueError(
                    "--speculative-ddtree-budget-policy adaptive ranks the budgets by the step "
                    "statistics, which SGLANG_DDTREE_STATS_INTERVAL=0 turns off. Unset it, or use "
                    "the fixed policy."
                )
            self.budget_policy = AdaptiveBudget(self.tree.budget, step_budgets, self.stats.accept_lengths)
        # The tree's build and compile, and the tail of a step (greedy or sampled, apart so
        # that a sampled batch's capture failing leaves the greedy graphs be), each one CUDA
        # graph per batch size (step_graphs).
        self._tree_graphs = self._selector_tree_graphs = self._tail_graphs = self._sampled_tail_graphs = None
        if step_graphs.enabled(server_args):
            limits = step_graphs.SERVER_LIMITS
            self._tree_graphs = SegmentGraphs("DDTREE tree build", self._build_and_compile, **limits)
            self._tail_graphs = SegmentGraphs("DDTREE greedy step tail", self._step_tail, **limits)
            self._sampled_tail_graphs = SegmentGraphs("DDTREE sampled step tail", self._step_tail, **limits)
        self.tree_from_transitions = server_args.speculative_ddtree_tree == "transitions"
        if self.tree_from_transitions and not is_selector_drafter(getattr(self, "draft_model", None)):
            raise ValueError(
                "--speculative-ddtree-tree transitions grows the tree from a DFlash 2 drafter's "
                f"candidate selector, and {server_args.speculative_draft_model_path} has none. "
                "Use --speculative-ddtree-tree marginals (the default) with this drafter."
            )
        if self.tree_from_transitions and self._tree_graphs is not None and get_tp_group().world_size == 1:
            # Not under tensor parallelism: the selector all-gathers its candidates.
            self._selector_tree_graphs = SegmentGraphs(
                "DDTREE tree build from the selector",
                self._build_selector_and_compile,
                **step_graphs.SERVER_LIMITS,
            )
        if self.ps.tp_rank == 0:
            logger.info(
                "DDTREE worker: budget=%d (verify width %d), topk=%d, draft block=%d, max depth=%d, tree from %s, "
                "budget policy %s%s.",
                self.tree.budget,
                self.tree.verify_width,
                self.tree.topk,
                self.tree.draft_block,
                self.tree.max_depth,
                server_args.speculative_ddtree_tree,
                server_args.speculative_ddtree_budget_policy,
                f" (step budgets {', '.join(map(str, step_budgets))})" if step_budgets else "",
            )

    def init_attention_backends(self):
        super().init_attention_backends()
        runner = self.target_worker.model_runner
        # Hybrid linear-attention targets: the tree verify leaves one recurrent
        # state per node; the accepted one is committed after each step.
        self._linear_state = mambaish_config(runner.model_config) is not None
        if self._linear_state:
            linear_state.check_tree_verify_support(runner, self.tree.verify_width)
            linear_state.check_radix_strategy(self.server_args)
            if self.budget_policy is not None:
                raise ValueError(
                    "--speculative-ddtree-budget-policy adaptive is not supported on hybrid "
                    "linear-attention targets yet (their per-node recurrent states are laid out "
                    "for the full verify width). Use the fixed policy."
                )

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        runner = self.target_worker.model_runner
        if not self.tree.graph_budgets:
            return
        if getattr(runner, "decode_cuda_graph_runner", None) is None:
            if self.ps.tp_rank == 0:
                logger.warning("DDTREE graph budgets %s run eagerly: the target has no CUDA graphs.",
                               list(self.tree.graph_budgets))  # fmt: skip
            return
        self._verify_graphs = VerifyGraphs.capture(
            runner, [b + 1 for b in self.tree.graph_budgets], self.tree.verify_width
        )

    def _maybe_build_draft_sampler(self):
        """The head upstream folds into the draft CUDA graph (called before capture): for
        DDTREE each depth's top-K log-probs instead of DFLASH's argmax. ``None`` keeps the
        top-K eager: a tree from a DFlash 2 selector's transitions (which reads the hidden
        states), tensor parallelism (the ranks' top-Ks are gathered and merged eagerly), a
        quantized LM head, or ``SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1``."""
        reason = None
        lm_head = self.target_worker.model_runner.model.lm_head
        if envs.SGLANG_DFLASH_EAGER_DRAFT_SAMPLER.get():
            reason = "SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1"
        elif self.tree_from_transitions:
            reason = "tree from the selector's transitions"
        elif get_tp_group().world_size > 1:
            reason = "tensor parallel"
        elif not torch.is_floating_point(lm_head.weight):
            reason = "quantized lm_head"
        if reason is not None:
            if self.ps.tp_rank == 0:
                logger.info("DDTREE draft top-K kept eager (%s).", reason)
            return None
        start, valid, k = self._lm_head_vocab(self.tree.topk)
        return DraftTopKHead(
            weight=lm_head.weight,
            block_size=int(self.block_size),
            topk=k,
            id_offset=start,
            num_valid=valid,
            max_bs=max(get_exec().graph.cuda_graph_config.decode.bs),
        )

    @property
    def war_fastpath_runner(self):
        return self.target_worker.model_runner

    # ------------------------------------------------------------------ step

    def forward_batch_generation(
        self,
        batch: ScheduleBatch,
        on_publish=None,
        grammar_barrier=None,
    ) -> GenerationBatchResult:
        if (
            batch.forward_mode.is_extend()
            or batch.is_extend_in_batch
            or batch.forward_mode.is_idle()
        ):
            # Prefill (context KV for the drafter) and idle are DFlash's.
            if self.budget_policy is not None:
                self.budget_policy.interrupted()
            return super().forward_batch_generation(
                batch, on_publish=on_publish, grammar_barrier=grammar_barrier
            )
        if getattr(batch, "return_logprob", False):
            raise ValueError("DDTREE speculative decoding does not support return_logprob yet.")
        with phase("step"):
            return self._decode_step(batch, on_publish, grammar_barrier)

    def _decode_step(self, batch: ScheduleBatch, on_publish, grammar_barrier) -> GenerationBatchResult:
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch.")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())

        bs = len(batch.seq_lens)
        # This step's tree: the configured budget, or the policy's for this batch size (a
        # smaller tree replays its width's graphs if it is a graph budget, else runs eagerly).
        tree_budget = self.tree if self.budget_policy is None else self.tree.at(self.budget_policy.choose(bs))
        n = tree_budget.verify_width
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        # The target graphs of this width (None: the model runner's own, at the full width).
        verify_graph = self._verify_graphs.lookup(n, bs)
        # Before the draft is queued, so the verify's plan need not wait for it.
        with self._verify_graphs.active(verify_graph) as target_backend:
            stage_verify_prefix_lens(target_backend, prefix_lens)

        # 1-3) draft, then the tree: from each depth's top-K, or from a DFlash 2
        # drafter's selector lattice (candidates per slot and their transitions), which the
        # tree's segment computes from the drafter's hidden states.
        head_read = False
        with phase("draft"):
            draft_hidden, draft_replayed = self._draft_block_hidden(batch, draft_input, bs)
            if self.tree_from_transitions:
                logprobs = token_ids = None
            elif draft_replayed and self._dflash.draft_graph_head is not None:
                # The draft graph's replay scored each depth (``DraftTopKHead``): its buffers at
                # their full width, of which a smaller tree takes the leading columns.
                head = self._dflash.draft_graph_head
                logprobs, token_ids = head.read(bs, head.topk)
                head_read = True
            else:
                logprobs, token_ids = self._draft_topk(draft_hidden[:, 1:, :], tree_budget.topk)
        tree_replayed = False
        # The prefix lengths and pool rows the step tail reads.
        step_rows = (prefix_lens, batch.req_pool_indices)
        with phase("tree"):
            tree_args = (draft_input.bonus_tokens.view(bs), prefix_lens.view(bs), batch.req_pool_indices)
            if self.tree_from_transitions:
                # The block's mask slots, where the draft graph's replay left them.
                slots = draft_hidden[:, 1:, :]
                graphs = self._selector_tree_graphs
                if draft_replayed and graphs is not None:
                    compiled = graphs.run((tree_budget.budget, tree_budget.max_depth), (slots, req_to_token), tree_args)
                    if graphs.last_replayed:
                        tree_replayed = True
                        step_rows = graphs.last_fed[1:]
                else:  # eagerly (a drafter that ran eagerly, no step graphs, or tensor parallel)
                    compiled = self._build_selector_and_compile(
                        tree_budget.budget, tree_budget.max_depth, slots, req_to_token, *tree_args
                    )  # fmt: skip
            elif head_read and self._tree_graphs is not None:
                # The head's buffers hold the top-K at the same addresses every replay.
                compiled = self._tree_graphs.run(
                    (tree_budget.budget, tree_budget.max_depth, tree_budget.topk),
                    fixed=(logprobs, token_ids, req_to_token),
                    fed=tree_args,
                )
                if self._tree_graphs.last_replayed:
                    tree_replayed = True
                    # The graph's copies, which the tail graph reads in place.
                    step_rows = self._tree_graphs.last_fed[1:]
            else:
                compiled = self._build_and_compile(
                    tree_budget.budget, tree_budget.max_depth, tree_budget.topk, logprobs, token_ids, req_to_token,
                    *tree_args,
                )  # fmt: skip
            grammar_tree = (
                GrammarTree.from_device(
                    compiled.retrive_next_token, compiled.retrive_next_sibling, compiled.tokens
                )
                if batch.has_grammar
                else None
            )

        # 4) verify.
        # The tree window's KV slots (``step_io.tree_cache_locs``), read by the compile launch;
        # the batch keeps its own copy of a graph's (the next replay overwrites it).
        cache_loc_2d = compiled.cache_loc
        batch.out_cache_loc = cache_loc_2d.reshape(-1).clone() if tree_replayed else cache_loc_2d.reshape(-1)
        if self._linear_state:
            # The radix cache's state snapshots go to the requests' current
            # track slots (rebuilt from the requests, as EAGLE's verify does).
            prepare_mamba_track_for_verify(batch)
        with phase("verify"):
            logits_output, can_run_cuda_graph = self._verify(batch, draft_input, compiled, bs, verify_graph)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, but got None.")

        replayable, draw = self._tail_draw(batch, can_run_cuda_graph)
        if replayable:
            # 5-6) the target's tokens (argmax or draws), the walk, the commit and the
            # drafter's context as one graph.
            with phase("commit"):
                commit, next_bonus = self._run_step_tail(
                    logits_output.next_token_logits, hidden, compiled, tree_replayed, tree_budget, step_rows,
                    draw, batch.sampling_info,
                )
                new_seq_lens = commit.new_seq_lens
                self._step_committed(new_seq_lens, on_publish)
            return self._step_result(logits_output, commit, next_bonus, new_seq_lens, n, can_run_cuda_graph)

        # 5) accept: the target's token at every node as the sampler would pick it
        # (argmax, or one draw per node), then the greedy walk over those tokens.
        with phase("sample"):
            sampling_info = batch.sampling_info
            if batch.has_grammar:
                grammar_mask = build_grammar_vocab_mask(
                    reqs=batch.reqs,
                    tree=grammar_tree,
                    sampling_info=sampling_info,
                    device=logits_output.next_token_logits.device,
                    barrier=grammar_barrier,
                )
            else:
                grammar_mask = None
            verify = self.verify_sampler.target_tokens(
                logits_output.next_token_logits,
                sampling_info,
                batch.reqs,
                NodePaths(compiled.tokens, compiled.parent, compiled.depth, tree_budget.max_depth),
                compiled.positions,
                grammar_mask,
            )
        with phase("commit"):
            res, commit, new_seq_lens = self._accept_and_commit(
                batch, compiled, verify, tree_budget, cache_loc_2d, prefix_lens, req_to_token, on_publish
            )

        with phase("draft_context"):
            self._append_committed_context(hidden, commit)
        return self._step_result(logits_output, commit, res.next_bonus, new_seq_lens, n, can_run_cuda_graph)

    def _step_result(self, logits_output, commit, next_bonus, new_seq_lens, n, can_run_cuda_graph):
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=commit.output_tokens.reshape(-1),
            accept_lens=commit.commit_lens,
            can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=make_draft_input_v2(bonus_tokens=next_bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=n,
            new_seq_lens=new_seq_lens,
        )

    # ------------------------------------------------------------- step tail

    def _tail_draw(self, batch: ScheduleBatch, verify_replayed: bool) -> Tuple[bool, Optional[GraphDraw]]:
        """Whether the step's tail replays as a graph, and how it picks the target's tokens
        there (None: the argmax). It does when the verify replayed its graph (its logits and
        hidden states sit in that graph's buffers) and every node's token is a bare argmax or
        a draw the verify sampler can make in a graph (``VerifySampler.graph_draw``); grammars,
        penalties, logit biases, seeds and hybrid targets' recurrent states stay eager."""
        if self._tail_graphs is None or not verify_replayed or batch.has_grammar or self._linear_state:
            return False, None
        info = batch.sampling_info
        if plain_argmax(info):
            return True, None
        draw = self.verify_sampler.graph_draw(info, batch.reqs)
        return draw is not None, draw

    def _run_step_tail(self, logits, hidden, compiled, tree_replayed, tree_budget, step_rows, draw, sampling_info):
        """``_step_tail`` through the tail graphs: the step's commit and next bonus,
        copied out of the graph's memory (they outlive the step). ``step_rows``: the prefix
        lengths and the requests' pool rows. A tree from the tree graph, and that graph's
        copies of the rows, are read where that graph left them; anything else is copied in,
        as are a sampled batch's parameters."""
        sanitize_nan_logits(logits, "verify: next_token_logits")
        tree_tensors = tuple(getattr(compiled, name) for name in _TREE_TENSORS)
        fixed = (
            logits,
            hidden,
            self.stats.counters(hidden.device, tree_budget.budget),
            self.model_runner.req_to_token_pool.req_to_token,
        )
        params = ()
        if draw is not None:
            params = (sampling_info.temperatures.view(-1, 1), sampling_info.top_ks, sampling_info.top_ps,
                      sampling_info.min_ps)  # fmt: skip
        graphs = self._tail_graphs if draw is None else self._sampled_tail_graphs
        commit = graphs.run(
            (compiled.max_depth, tree_replayed, draw),
            fixed=fixed + tree_tensors + step_rows if tree_replayed else fixed,
            fed=(() if tree_replayed else tree_tensors + step_rows) + params,
            guard=self._dflash.draft_context_buffers(),
        )
        commit = dataclasses.replace(
            commit,
            output_tokens=commit.output_tokens.clone(),
            commit_lens=commit.commit_lens.clone(),
            new_seq_lens=commit.new_seq_lens.clone(),
        )
        return commit, commit.accept.next_bonus.clone()

    def _build_and_compile(
        self, budget, max_depth, topk, logprobs, token_ids, req_to_token, bonus, prefix_lens, req_pool_indices
    ) -> CompiledTree:
        """The tree from each depth's top-``topk``, compiled with its KV window: no host sync
        (``SegmentGraphs``). Wider top-K buffers (the draft head's, for a smaller step budget)
        give their leading, most likely, ``topk`` columns, as ``DraftTopKHead.read`` does."""
        logprobs, token_ids = leading_candidates(logprobs, token_ids, topk)
        return self._compile(
            build_tree(logprobs, token_ids, budget), max_depth, req_to_token, bonus, prefix_lens, req_pool_indices
        )

    def _build_selector_and_compile(
        self, budget, max_depth, slot_hidden, req_to_token, bonus, prefix_lens, req_pool_indices
    ) -> CompiledTree:
        """The tree from a DFlash 2 drafter's selector (each slot's top-K through the target's
        LM head, their transition scores, the ``budget`` best paths), compiled with its KV
        window: no host sync, so it replays as one graph (``SegmentGraphs``) where the draft
        graph left the hidden states at the same address."""
        candidate_ids, scores = self.draft_model.selector_lattice(
            slot_hidden, bonus, self.target_worker.model_runner.model.lm_head
        )
        return self._compile(
            build_selector_tree(candidate_ids, scores, budget), max_depth, req_to_token, bonus, prefix_lens,
            req_pool_indices,
        )  # fmt: skip

    @staticmethod
    def _compile(tree, max_depth, req_to_token, bonus, prefix_lens, req_pool_indices) -> CompiledTree:
        """A drafted tree (from marginals or a selector) compiled with its KV window."""
        return compile_tree(
            tree,
            bonus=bonus.to(torch.int64),
            committed_len=prefix_lens,
            max_depth=max_depth,
            req_to_token=req_to_token,
            req_pool_indices=req_pool_indices,
        )

    def _step_tail(self, max_depth, _tree_in_place, draw, logits, hidden, stats_counts, req_to_token, *rest):
        """The target's token at every node (the argmax, or ``draw``'s draw keyed by a seed
        drawn on the device, fresh on every replay), the greedy walk, the commit (``step_io``)
        and the drafter's context KV: no host sync, no host-side effect (``SegmentGraphs``).
        ``rest``: the compiled tree's tensors (``_TREE_TENSORS``), the prefix lengths, the
        requests' rows, then with ``draw`` the temperatures ``[bs, 1]``, top-ks, top-ps and
        min-ps."""
        params = ()
        if draw is not None:
            *rest, temperatures, top_ks, top_ps, min_ps = rest
            params = (temperatures, top_ks, top_ps, min_ps)
        *tree_tensors, prefix_lens, req_pool_indices = rest
        tree = CompiledTree(max_depth=max_depth, **dict(zip(_TREE_TENSORS, tree_tensors)))
        bs, n = tree.tokens.shape
        if draw is None:
            tokens = torch.argmax(logits, dim=-1)
        else:
            seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=logits.device)
            tokens = draw.tokens(logits, *params, nodes=n, seed=seed)
        accepted = greedy_accept(tree, tokens.view(bs, n), read_back=False)
        commit = step_io.commit_accepted(
            accepted,
            tree.cache_loc,
            prefix_lens,
            req_to_token,
            req_pool_indices,
            stats_counts=stats_counts,
            tree_depth=tree.depth,
        )
        self._append_committed_context(hidden, commit)
        return commit

    def _append_committed_context(self, hidden: torch.Tensor, commit) -> None:
        """The kept nodes' verify hidden states into the drafter's context KV at their slots."""
        self._dflash.append_draft_context(
            target_hidden=hidden.index_select(0, commit.ctx_rows),
            cache_loc=commit.ctx_cache_loc.reshape(-1),
            cache_loc_2d=commit.ctx_cache_loc,
            positions=commit.ctx_positions,
            commit_lens=commit.commit_lens,
        )

    def _accept_and_commit(
        self, batch, compiled, verify, tree_budget, cache_loc_2d, prefix_lens, req_to_token, on_publish
    ):
        """The greedy walk over the target's tokens, then the step's commit; returns the
        acceptance, the commit's outputs and the new committed lengths."""
        # On the kernel path the commit launch reads the outputs back.
        accepted = greedy_accept(compiled, verify.tokens, read_back=False)

        # 6) commit: the kept path's KV first in the window, the emitted tokens,
        # the committed lengths, the drafter's context rows and the step
        # statistics, in one launch (which also reads back a greedy kernel
        # acceptance: ``commit.accept``).
        commit = step_io.commit_accepted(
            accepted,
            cache_loc_2d,
            prefix_lens,
            req_to_token,
            batch.req_pool_indices,
            stats_counts=self.stats.counters(cache_loc_2d.device, tree_budget.budget),
            tree_depth=compiled.depth,
        )
        self.verify_sampler.commit(verify, compiled.tokens[:, 0], commit.output_tokens, commit.commit_lens)
        res = commit.accept
        if self._linear_state:
            self._commit_linear_state(batch, res, prefix_lens)
        new_seq_lens = commit.new_seq_lens
        self._step_committed(new_seq_lens, on_publish)
        return res, commit, new_seq_lens

    def _step_committed(self, new_seq_lens: torch.Tensor, on_publish) -> None:
        """After the commit is queued: the statistics, the new lengths to the scheduler and
        the WAR barrier's event."""
        self.stats.step_counted()
        if self.budget_policy is not None and self.ps.tp_rank == 0:
            if self.stats.steps % (self.stats.interval * self.stats.log_every) == 0:
                logger.info("DDTREE budget policy: %s", "; ".join(self.budget_policy.summary()))
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._publish_req_to_token_done()

    # ----------------------------------------------------------------- draft

    def _draft_block_hidden(
        self, batch: ScheduleBatch, draft_input: DFlashDraftInputV2, bs: int
    ) -> Tuple[torch.Tensor, bool]:
        """One DFlash forward over ``[bonus, MASK x L]``: ``[bs, block, H]``, and whether
        it replayed a CUDA graph."""
        block = int(self.block_size)
        buffers = self._dflash.draft_block_buffers(bs)
        block_ids, positions_2d, cache_loc_2d = buffers.block_ids, buffers.positions, buffers.cache_loc
        prefix_lens = batch.seq_lens
        self._dflash.prepare_draft_block(
            buffers,
            draft_input.bonus_tokens,
            prefix_lens,
            batch.req_pool_indices,
            self.model_runner.req_to_token_pool.req_to_token,
        )

        embed = self.target_worker.model_runner.model.get_input_embeddings()
        input_embeds = embed(block_ids).view(bs * block, -1)

        # Host upper bound of the prefix lengths for backend planning: the host
        # copy may lag the device by one step (at most one block of tokens).
        seq_lens_cpu = buffers.seq_lens_cpu
        if batch.seq_lens_cpu is not None:
            seq_lens_cpu.copy_(batch.seq_lens_cpu)
            seq_lens_cpu.add_(block)
            seq_lens_sum = int(seq_lens_cpu.sum())
        elif draft_input.reserved_seq_lens_cpu is not None:
            seq_lens_cpu.copy_(draft_input.reserved_seq_lens_cpu)
            seq_lens_sum = int(draft_input.reserved_seq_lens_sum)
        else:
            seq_lens_cpu.copy_(prefix_lens.to("cpu", dtype=torch.int32))
            seq_lens_sum = int(seq_lens_cpu.sum())

        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=seq_lens_sum,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions_2d.reshape(-1),
            input_embeds=input_embeds,
            spec_algorithm=self._algo,
            spec_info=self._dflash.draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        with torch.inference_mode():
            out = self.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE draft model returned no hidden states.")
        return hidden.view(bs, block, -1), bool(out.can_run_graph)

    def _draft_topk(self, hidden: torch.Tensor, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-depth top-``topk`` of the drafter's full-vocab log-softmax.

        The DFlash drafter has no head; like DFlash we use the target's LM
        head, vocabulary-sharded under TP (``draft_topk.lm_head_topk``).
        Returns ``[bs, L, K]`` log-probs (float32, descending) and token ids
        (int64).
        """
        bs, depths, width = hidden.shape
        lm_head = self.target_worker.model_runner.model.lm_head
        start, valid, k = self._lm_head_vocab(topk)
        tp_group = get_tp_group()
        gather = None
        if tp_group.world_size > 1:
            gather = lambda t: tp_group.all_gather(t.unsqueeze(0).contiguous(), dim=0)  # noqa: E731
        logprobs, ids = lm_head_topk(hidden.reshape(bs * depths, width), lm_head.weight, k, start, valid, gather)
        return logprobs.view(bs, depths, k), ids.view(bs, depths, k)

    def _lm_head_vocab(self, topk: int) -> Tuple[int, int, int]:
        """This rank's LM-head slice as ``lm_head_topk`` takes it: the first token id, the
        real tokens it holds (padding past the model's vocabulary excluded), and ``topk``
        capped at the vocabulary."""
        lm_head = self.target_worker.model_runner.model.lm_head
        shard = getattr(lm_head, "shard_indices", None)
        model_vocab = int(self.model_runner.model_config.vocab_size)
        if shard is None:
            start, held = 0, int(lm_head.weight.shape[0])
        else:
            start, held = int(shard.org_vocab_start_index), int(shard.num_org_elements)
        return start, max(0, min(held, model_vocab - start)), min(topk, model_vocab)

    # ---------------------------------------------------------------- verify

    def _verify(self, batch, draft_input, compiled, bs, verify_graph=None):
        """The target's forward over the tree; ``verify_graph``: the graphs of a graph budget's
        width, which plan and replay it (``verify_graphs``)."""
        n = compiled.num_tokens
        seq_lens_cpu_backup = batch.seq_lens_cpu
        seq_lens_sum_backup = batch.seq_lens_sum
        # Host upper bound of the device prefix lengths' sum (the host copy may
        # lag by one step): sizes the backend's KV index buffer and the mask.
        prefix_sum_bound = bs * self._context_len
        if seq_lens_cpu_backup is not None:
            # Committed prefix + the most one step can commit.
            verify_host_seq_lens = seq_lens_cpu_backup + n
            batch.seq_lens_cpu = verify_host_seq_lens
            batch.seq_lens_sum = prefix_sum_bound = int(verify_host_seq_lens.sum())
        elif draft_input.reserved_seq_lens_cpu is not None:
            batch.seq_lens_cpu = draft_input.reserved_seq_lens_cpu
            batch.seq_lens_sum = prefix_sum_bound = int(draft_input.reserved_seq_lens_sum)
        custom_mask = None
        if not backend_reads_tree_mask_bits(self.model_runner.attn_backend):
            numel = min(
                dense_mask_numel_bound(prefix_sum_bound, bs, n),
                bs * n * (self._context_len + n),
            )
            custom_mask = dense_verify_mask(compiled.tree_mask, batch.seq_lens, numel)
        verify_input = DDTreeVerifyInput.from_compiled(
            compiled, custom_mask=custom_mask, tree_links=self._linear_state
        )
        # The forward replays on the graph runner that planned it.
        with self._verify_graphs.active(verify_graph):
            try:
                verify_forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
            finally:
                batch.seq_lens_cpu = seq_lens_cpu_backup
                batch.seq_lens_sum = seq_lens_sum_backup
            # A benchmark's MoE routing may send each node's siblings to its experts.
            routing = tree_routing.siblings_share(compiled.parent) if self._tree_routing else contextlib.nullcontext()
            with routing:
                out = self.target_worker.forward_batch_generation(
                    batch=None,
                    forward_batch=verify_forward_batch,
                    is_verify=True,
                    skip_attn_backend_init=True,
                )
        return out.logits_output, out.can_run_cuda_graph

    def _commit_linear_state(self, batch: ScheduleBatch, res, prefix_lens: torch.Tensor) -> None:
        """The accepted node's conv and gated-delta state becomes the request's
        (and a track-boundary node's its radix snapshot's)."""
        track = batch.mamba_track_indices
        runner = self.target_worker.model_runner
        linear_state.commit_linear_state(
            runner.attn_backend,
            runner.model,
            batch.req_pool_indices,
            track,
            res.accept_index,
            res.num_accepted,
            prefix_lens,
            get_exec().mamba.mamba_track_interval if track is not None else None,
        )

    def _publish_req_to_token_done(self) -> None:
        """The scheduler's WAR barrier may let result processing (which frees
        finished requests' slots through ``req_to_token``) run once this event
        fires: record it after the step's last ``req_to_token`` write."""
        if not torch.cuda.is_available():
            return
        event = torch.cuda.Event()
        event.record()
        self.target_worker.model_runner.war_fastpath_read_done_event = event
