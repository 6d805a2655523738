#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Eager work of one DDTREE and one DFLASH decode step, counted on the CPU (op counts, not timings).

Each step runs the real ``forward_batch_generation`` of ``DDTreeWorker`` and of upstream's
``DFlashWorkerV2`` (decode, greedy, batch ``bs``) on CPU tensors, with the model forwards
replaced by stand-ins that return tensors of the right shapes. What is counted is every
operation the step issues *outside* those forwards, the per-step work that is not in a
CUDA graph on a GPU and costs one Python/torch dispatch (and a launch) each:

- ``device_ops``: aten ops on device tensors that launch a kernel on a GPU (views, strides
  and allocations excluded: they are listed apart as ``view_ops`` and ``alloc_ops``);
- ``triton``: Triton kernel launches (run by the interpreter, ``TRITON_INTERPRET=1``);
- ``extension``: sglang-kernel launches (``verify_tree_greedy``), which have no CPU build:
  a plain-Python stand-in with the op's contract runs in their place and counts as one
  launch, so the step takes the path a GPU takes;
- ``host_ops``: aten ops on host tensors only (the host copies of the sequence lengths).

``launches`` = device_ops + triton + extension is the number to set against a GPU
profile's kernel launches outside the graphs. The counts depend only on shapes and code
paths (the step has no data-dependent control flow: it never syncs the host), so they are
deterministic.

Not run here (both algorithms call them alike, or they are model work): the draft and
target forwards (CUDA-graph replays on a GPU), ``prepare_for_verify``'s
``ForwardBatch.init_new`` and graph ``load_batch`` (upstream, the same for both; DDTREE's
tree-verify hook additionally copies the tree mask into the captured buffer: one copy),
and the drafter's context-KV writer (``_append_target_hidden_to_draft_kv_by_loc``: same
call, ``D + 1`` rows per request for DDTREE, ``block`` rows for DFLASH). Each appears under
``stand_ins`` with its number of calls.

  python3 -m benchmarks.step_ops --out-dir benchmarks/results --tag cpu_2026-12-02
  python3 -m benchmarks.step_ops --baseline benchmarks/results/step_ops_before.json ...
"""

from __future__ import annotations

import os

# The Triton kernels run on CPU tensors only under the interpreter; set it before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import contextlib
import datetime
import json
import platform
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, List, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.sampling.sampling_params import TOP_K_ALL

REPO = Path(__file__).resolve().parents[1]

#: Metadata-only aten ops: no kernel on a GPU.
VIEW_OPS = frozenset(
    {
        "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "slice", "select",
        "t", "transpose", "permute", "alias", "as_strided", "detach", "flatten", "unflatten",
        "view_as", "split", "split_with_sizes", "unbind", "chunk", "narrow", "diagonal",
        "_reshape_alias", "lift_fresh",
    }
)  # fmt: skip
#: Allocations without a fill: no kernel on a GPU.
ALLOC_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
#: No kernel either: a Python scalar wrapped as a 0-dim host tensor, a same-dtype ``to``.
NO_KERNEL_OPS = frozenset({"scalar_tensor", "to", "_local_scalar_dense"})
#: Where the step's code lives: an op is attributed to the innermost function in these files.
_STEP_SOURCES = ("/speculative/ddtree/", "/speculative/dflash_worker_v2.py", "/speculative/draft_worker_common.py",
                 "/speculative/dflash_info", "/speculative/dflash_utils.py", "/kernels/ops/speculative/",
                 "/speculative/verify_sampling/")  # fmt: skip


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(src in name for src in _STEP_SOURCES):
            return f"{Path(name).stem}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


class StepOpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by op and by kind."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.kinds: Counter = Counter()
        self.triton: Counter = Counter()
        self.extension: Counter = Counter()
        self.stand_ins: Counter = Counter()
        self.sites: Counter = Counter()  # device ops by the step function that issued them
        self._paused = 0
        self._host: List[torch.Tensor] = []  # kept alive so their storages stay distinct

    def mark_host(self, *tensors: Optional[torch.Tensor]) -> None:
        for t in tensors:
            if t is not None:
                self._host.append(t)

    def _is_host(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(h.untyped_storage().data_ptr() == ptr for h in self._host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        name = func.overloadpacket.__name__
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and all(self._is_host(t) for t in tensors):
            kind = "host_ops"
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self._host.append(o)
        elif name in VIEW_OPS:
            kind = "view_ops"
        elif name in ALLOC_OPS or name in NO_KERNEL_OPS:
            kind = "alloc_ops"
        else:
            kind = "device_ops"
        self.ops[f"{kind}:{name}"] += 1
        self.kinds[kind] += 1
        if kind == "device_ops":
            self.sites[_call_site()] += 1
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def stand_in(self, name: str):
        """Wrap ``fn``: its calls are counted under ``stand_ins`` and its ops are not."""

        def wrap(fn):
            def run(*args, **kwargs):
                self.stand_ins[name] += 1
                with self.paused():
                    return fn(*args, **kwargs)

            return run

        return wrap

    def summary(self) -> dict:
        kinds = {k: self.kinds.get(k, 0) for k in ("device_ops", "view_ops", "alloc_ops", "host_ops")}
        triton = sum(self.triton.values())
        extension = sum(self.extension.values())
        return {
            "launches": kinds["device_ops"] + triton + extension,
            **kinds,
            "dispatched": sum(self.kinds.values()),
            "triton": triton,
            "extension": extension,
            "triton_kernels": dict(sorted(self.triton.items())),
            "extension_kernels": dict(sorted(self.extension.items())),
            "stand_ins": dict(sorted(self.stand_ins.items())),
            "launches_by_site": dict(self.sites.most_common()),
            "ops": dict(sorted(self.ops.items())),
        }


@contextlib.contextmanager
def counting_triton(counter: StepOpCounter) -> Iterator[None]:
    """Count interpreted Triton launches (and keep the interpreter's own tensor copies out)."""
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def __call__(self, *args, **kwargs):
        counter.triton[getattr(self.fn, "__name__", str(self.fn))] += 1
        counter.sites[_call_site()] += 1
        with counter.paused():
            return launch(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = __call__
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = launch


# --------------------------------------------------------------------------- stand-ins


def verify_tree_greedy_cpu(
    *, predicts, accept_index, accept_token_num, candidates, retrive_index,
    retrive_next_token, retrive_next_sibling, target_predict,
):  # fmt: skip
    """sglang-kernel's ``verify_tree_greedy`` contract in plain Python (for CPU runs).

    Walks from the root while the target's argmax at the last accepted node is a child's
    token; writes flat row indices into ``accept_index``, the count into
    ``accept_token_num`` and the emitted token at each accepted row into ``predicts``.
    """
    bs, n = candidates.shape
    width = accept_index.shape[1]
    cand = candidates.tolist()
    rindex = retrive_index.tolist()
    nxt = retrive_next_token.tolist()
    sib = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        last = 0
        accept_index[b, 0] = rindex[b][0]
        num = 0
        for _ in range(1, width):
            want = target[rindex[b][last]]
            child = nxt[b][last]
            while child != -1 and cand[b][child] != want:
                child = sib[b][child]
            if child == -1:
                break
            predicts[rindex[b][last]] = want
            num += 1
            accept_index[b, num] = rindex[b][child]
            last = child
        accept_token_num[b] = num
        predicts[rindex[b][last]] = target[rindex[b][last]]


@contextlib.contextmanager
def gpu_accept_path(counter: StepOpCounter) -> Iterator[None]:
    """Make ``accept.greedy_accept`` take its sglang-kernel path, as on a GPU."""
    from sglang.srt.speculative.ddtree import accept

    saved = accept._want_kernel, accept._kernel_ops

    def greedy(**kwargs):
        counter.extension["verify_tree_greedy"] += 1
        counter.sites[_call_site()] += 1
        with counter.paused():
            verify_tree_greedy_cpu(**kwargs)

    accept._want_kernel = lambda use_kernel, ref: True
    accept._kernel_ops = lambda: greedy
    try:
        yield
    finally:
        accept._want_kernel, accept._kernel_ops = saved


class _Embedding:
    def __init__(self, weight):
        self.weight = weight

    def __call__(self, ids):
        return torch.nn.functional.embedding(ids, self.weight)


class _TargetModel:
    def __init__(self, vocab: int, hidden: int, gen: torch.Generator):
        self._embed = _Embedding(torch.randn(vocab, hidden, generator=gen))
        self.lm_head = SimpleNamespace(weight=torch.randn(vocab, hidden, generator=gen))

    def get_input_embeddings(self):
        return self._embed


class _SamplingInfo:
    """The greedy, penalty-free sampling state of a batch (what a T=0 run carries)."""

    is_all_greedy = True
    has_custom_logit_processor = False
    acc_additive_penalties = None
    acc_scaling_penalties = None
    penalizer_orchestrator = None
    grammar_mask = None
    logit_bias = None
    need_top_k_sampling = False
    need_top_p_sampling = False

    def __init__(self, bs: int):
        self._bs = bs

    def __len__(self):
        return self._bs


class _SampledInfo(_SamplingInfo):
    """A sampled batch's state, every request alike: what ``SamplingBatchInfo`` carries
    for ``temperature``, ``top_k``, ``top_p`` and ``min_p`` (upstream's need_* flags)."""

    is_all_greedy = False
    sampling_seed = None

    def __init__(self, bs: int, setting: "Sampling"):
        super().__init__(bs)
        self.temperatures = torch.full((bs, 1), setting.temperature)
        self.top_ks = torch.full((bs,), setting.top_k, dtype=torch.int32)
        self.top_ps = torch.full((bs,), setting.top_p)
        self.min_ps = torch.full((bs,), setting.min_p)
        self.need_top_k_sampling = setting.top_k != TOP_K_ALL
        self.need_top_p_sampling = setting.top_p != 1.0
        self.need_min_p_sampling = setting.min_p > 0


def _no_sampler_kernels(*args):
    raise AssertionError("the verify's fused draw does not call the sampler's kernels")


class Sampling(NamedTuple):
    temperature: float
    top_k: int = TOP_K_ALL
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Optional["Sampling"]:
        """``T[/top_k[/top_p[/min_p]]]`` (top_k 0: none); ``0``: greedy (None)."""
        parts = text.split("/")
        if not 1 <= len(parts) <= 4:
            raise ValueError(f"a sampling setting is T[/top_k[/top_p[/min_p]]], got {text!r}")
        t = float(parts[0])
        if t == 0:
            return None
        k = int(parts[1]) if len(parts) > 1 else 0
        return cls(t, k if k > 0 else TOP_K_ALL, *(float(x) for x in parts[2:]))

    def label(self) -> str:
        out = f"T={self.temperature:g}"
        if self.top_k != TOP_K_ALL:
            out += f" k={self.top_k}"
        if self.top_p != 1.0:
            out += f" p={self.top_p:g}"
        if self.min_p > 0:
            out += f" min-p={self.min_p:g}"
        return out


@contextlib.contextmanager
def _patched(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


class StepWorld:
    """A worker of ``algo`` ("DDTREE" or "DFLASH") with stand-in models, and a decode batch."""

    HIDDEN = 64
    CONTEXT = 4096

    def __init__(self, algo: str, bs: int, budget: int, block: int, vocab: int, *, tree_mask_bits: bool = True,
                 seed: int = 0, sampling: Optional[Sampling] = None):  # fmt: skip
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info
        from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler

        self.algo, self.bs = algo, bs
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.counter: Optional[StepOpCounter] = None
        if algo == "DDTREE":
            from sglang.srt.speculative.ddtree.budget import TreeBudget
            from sglang.srt.speculative.ddtree.worker import DDTreeWorker as cls

            tree = TreeBudget.resolve(budget, None, block, vocab)
            block = tree.draft_block
            self.width = budget + 1
        elif algo == "DFLASH":
            from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2 as cls

            self.width = block
        else:
            raise ValueError(f"algo must be DDTREE or DFLASH, got {algo!r}")
        self.block = block
        w = cls.__new__(cls)
        self.worker = w
        pool_rows = max(8, 2 * bs)
        req_to_token = torch.randperm(pool_rows * self.CONTEXT, generator=gen).view(pool_rows, self.CONTEXT)
        attn_backend = SimpleNamespace(consumes_tree_mask_bits=tree_mask_bits)
        target_runner = SimpleNamespace(
            model=_TargetModel(vocab, self.HIDDEN, gen),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token.to(torch.int32)),
            model_config=SimpleNamespace(vocab_size=vocab, context_len=self.CONTEXT),
            attn_backend=attn_backend,
            device="cpu",
        )
        w.__dict__.update(
            _target_worker=SimpleNamespace(
                model_runner=target_runner, forward_batch_generation=self._target_forward
            ),
            model_runner=target_runner,
            draft_model_runner=SimpleNamespace(forward=self._draft_forward),
            ps=SimpleNamespace(tp_rank=0, attn_tp_rank=0),
            # Eager throughout: the counts are of the eager step (no CUDA graphs, no step graphs).
            server_args=SimpleNamespace(disable_cuda_graph=True),
            device="cpu",
            block_size=block,
            _mask_token_id=vocab - 1,
            _block_pos_offsets=torch.arange(block, dtype=torch.int64),
            _draft_block_spec_info=make_draft_block_spec_info(draft_token_num=block, device="cpu"),
            _use_triton_prepare_block=True,
            _use_triton_accept_bonus=True,
            _use_fused_kv_materialize=True,
            _need_mamba_verify_commit=False,
            use_compact_draft_cache=False,
            _warned_sampling_fallback=False,
            _draft_sampler=None,
            _append_target_hidden_to_draft_kv_by_loc=self._stand_in("draft_context_kv_writer", lambda **kw: None),
            # A greedy batch never reaches the sampler's draw; a sampled one takes the fused
            # draw (the default), which never calls the sampler's either.
            verify_sampler=VerifySampler(vocab_size=vocab, device="cpu",
                                          sampler=SimpleNamespace(_sample_from_probs=_no_sampler_kernels),
                                          sampling_backend="flashinfer"),
        )  # fmt: skip
        for name in ("_draft_block_ids_buf", "_draft_block_positions_buf", "_draft_block_tokens_buf",
                     "_draft_verify_out_cache_loc_buf", "_draft_block_end_buf", "_draft_seq_lens_cpu_buf",
                     "_accept_len_buf"):  # fmt: skip
            setattr(w, name, None)
        w.__dict__.update(_accept_bonus_buffer_cap=0, _accept_bonus_buffer_slot=0, _commit_lens_bufs=[],
                          _bonus_id_bufs=[], _out_tokens_bufs=[], _new_seq_lens_bufs=[])  # fmt: skip
        if algo == "DDTREE":
            from sglang.srt.speculative.ddtree.dflash_internals import DFlashInternals
            from sglang.srt.speculative.ddtree.draft_topk import DraftTopKHead
            from sglang.srt.speculative.ddtree.metrics import DDTreeStepStats
            from sglang.srt.speculative.ddtree.verify_graphs import VerifyGraphs
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            w.__dict__.update(
                _dflash=DFlashInternals(w), _linear_state=False, tree=tree, tree_from_transitions=False,
                budget_policy=None,
                # The step graphs (step_graphs.SegmentGraphs) need CUDA: these are the eager counts.
                _tree_graphs=None, _selector_tree_graphs=None, _tail_graphs=None, _sampled_tail_graphs=None,
                _verify_graphs=VerifyGraphs(target_runner),  # no graph budgets: the runner's own
                _algo=SpeculativeAlgorithm.from_string("DDTREE"), _context_len=self.CONTEXT, _tree_routing=False,
                stats=DDTreeStepStats(budget, interval=1 << 30),
            )  # fmt: skip
            # The draft graph's top-K head (``DraftTopKHead``): its ops are in the graph.
            w._draft_sampler = DraftTopKHead(weight=target_runner.model.lm_head.weight, block_size=block,
                                             topk=tree.topk, id_offset=0, num_valid=vocab, max_bs=bs)  # fmt: skip
        else:
            # The folded greedy head of DFlash's draft graph: its argmax is in the graph.
            w._draft_sampler = SimpleNamespace(out=torch.zeros(bs * (block - 1), dtype=torch.int64))

        self.seq_lens = torch.randint(64, self.CONTEXT // 2, (bs,), generator=gen)
        self.batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            is_extend_in_batch=False,
            return_logprob=False,
            has_grammar=False,
            sampling_info=_SamplingInfo(bs) if sampling is None else _SampledInfo(bs, sampling),
            reqs=[None] * bs if sampling is None else [
                SimpleNamespace(sampling_params=SimpleNamespace(top_k=sampling.top_k, top_p=sampling.top_p,
                                                                min_p=sampling.min_p))] * bs,
            seq_lens=self.seq_lens.clone(),
            seq_lens_cpu=self.seq_lens.to(torch.int32),
            seq_lens_sum=int(self.seq_lens.sum()),
            req_pool_indices=torch.randperm(pool_rows, generator=gen)[:bs],
            out_cache_loc=None,
            spec_info=DFlashDraftInputV2(
                topk_p=torch.empty((bs, 0)),
                topk_index=torch.empty((bs, 0), dtype=torch.int64),
                bonus_tokens=torch.randint(0, vocab - 1, (bs,), generator=gen),
                new_seq_lens=self.seq_lens.clone(),
                hidden_states=torch.empty((bs, 0), dtype=torch.float16),
            ),
        )
        self.vocab = vocab

    def _stand_in(self, name, fn):
        def run(*args, **kwargs):
            if self.counter is None:
                return fn(*args, **kwargs)
            return self.counter.stand_in(name)(fn)(*args, **kwargs)

        return run

    def _draft_forward(self, forward_batch):
        def fwd(fb):
            rows = fb.input_ids.shape[0]
            hidden = torch.randn(rows, self.HIDDEN, generator=self.gen)
            # A replay runs the graph's tail hook (the folded head) with the forward.
            if callable(self.worker._draft_sampler):
                self.worker._draft_sampler(hidden, fb.input_ids)
            return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden), can_run_graph=True)

        return self._stand_in("draft_forward", fwd)(forward_batch)

    def _target_forward(self, *, batch, forward_batch, is_verify, skip_attn_backend_init):
        # The verify's width (a step below the full budget verifies fewer tokens).
        width = int(getattr(getattr(forward_batch, "spec_info", None), "draft_token_num", None) or self.width)

        def fwd():
            rows = self.bs * width
            logits = torch.randn(rows, self.vocab, generator=self.gen)
            hidden = torch.randn(rows, self.HIDDEN, generator=self.gen)
            return SimpleNamespace(
                logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
                can_run_cuda_graph=True,
            )

        return self._stand_in("target_verify_forward", fwd)()

    def _prepare_for_verify(self, verify_input, batch, target_worker):
        # Upstream's ForwardBatch.init_new + graph load_batch: the same for DDTREE and DFLASH.
        return SimpleNamespace(spec_info=verify_input), True

    @contextlib.contextmanager
    def _environment(self) -> Iterator[None]:
        from sglang.srt.speculative import dflash_info
        from sglang.srt.speculative.ddtree import worker as ddtree_worker
        from sglang.srt.speculative.verify_sampling import verify_sampler

        tp = SimpleNamespace(world_size=1)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(ddtree_worker, "get_tp_group", lambda: tp))
            stack.enter_context(_patched(verify_sampler, "get_tp_group", lambda: tp))
            stack.enter_context(
                _patched(dflash_info.DFlashVerifyInput, "prepare_for_verify",
                         lambda vi, batch, tw: self._stand_in("prepare_for_verify", self._prepare_for_verify)(vi, batch, tw))
            )  # fmt: skip
            # CPU tensors take no CUDA stream: count the call, skip the bookkeeping.
            stack.enter_context(
                _patched(torch.Tensor, "record_stream",
                         lambda t, s: self.counter.stand_ins.update(["record_stream"]) if self.counter else None)
            )  # fmt: skip
            yield

    def step(self):
        """One decode step; returns its ``GenerationBatchResult``."""
        self.batch.seq_lens = self.seq_lens.clone()
        self.batch.seq_lens_cpu = self.seq_lens.to(torch.int32)
        with self._environment():
            return self.worker.forward_batch_generation(self.batch)

    def count_step(self) -> dict:
        """Op counts of one steady-state step (after a first step allocated the reused buffers)."""
        counter = StepOpCounter()
        with gpu_accept_path(counter):
            self.step()  # first step: the worker's lazily allocated buffers
            counter.extension.clear()
            counter.sites.clear()
            self.counter = counter
            counter.mark_host(self.worker._draft_seq_lens_cpu_buf)
            try:
                self.batch.seq_lens = self.seq_lens.clone()
                self.batch.seq_lens_cpu = self.seq_lens.to(torch.int32)
                counter.mark_host(self.batch.seq_lens_cpu)
                with self._environment(), counting_triton(counter), counter:
                    self.worker.forward_batch_generation(self.batch)
            finally:
                self.counter = None
        return counter.summary()


# --------------------------------------------------------------------------- run


def run_matrix(bss, budgets, block: int, vocab: int, dense_mask: bool, samplings=(None,)) -> List[dict]:
    rows = []
    for sampling in samplings:
        label = "greedy" if sampling is None else sampling.label()
        for bs in bss:
            if sampling is None:  # DFLASH's sampled verify is upstream's draft sampler's: not stood in here
                rows.append({"algo": "DFLASH", "bs": bs, "budget": None, "block": block, "sampling": label,
                             **StepWorld("DFLASH", bs, 0, block, vocab).count_step()})  # fmt: skip
            for budget in budgets:
                variants = [True] + ([False] if dense_mask else [])
                for bits in variants:
                    world = StepWorld("DDTREE", bs, budget, block, vocab, tree_mask_bits=bits, sampling=sampling)
                    algo = "DDTREE" if bits else "DDTREE (dense mask)"
                    rows.append({"algo": algo, "bs": bs, "budget": budget, "block": world.block, "sampling": label,
                                 **world.count_step()})  # fmt: skip
    return rows


def _key(row: dict) -> tuple:
    return row["algo"], row["bs"], row["budget"], row.get("sampling", "greedy")


def plot(result: dict, path: Path) -> None:
    from benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    base = {_key(r): r for r in (result.get("baseline") or {}).get("rows", [])}
    labels = [f"{r['algo']}\nbs{r['bs']}" + (f" B{r['budget']}" if r["budget"] else "") for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 5))
    x = range(len(rows))
    width = 0.4 if base else 0.8
    if base:
        ax.bar([i - 0.2 for i in x], [base.get(_key(r), {}).get("launches", 0) for r in rows], width,
               label=f"launches, baseline ({result['baseline'].get('commit', '')[:10]})", color="0.7")  # fmt: skip
    ax.bar([i + (0.2 if base else 0) for i in x], [r["launches"] for r in rows], width,
           label=f"launches ({result['meta'].get('commit', '')[:10]})", color="C0")  # fmt: skip
    ax.plot([i + (0.2 if base else 0) for i in x], [r["dispatched"] + r["triton"] + r["extension"] for r in rows],
            "k_", markersize=14, label="all dispatched ops + launches")  # fmt: skip
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("per decode step, outside the model forwards")
    ax.set_title(f"Eager work per decode step, CPU, op counts (deterministic), {result['meta']['date']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--block", type=int, default=16, help="the drafter's block size (DFlash's default)")
    ap.add_argument("--vocab", type=int, default=512, help="stand-in vocabulary (does not change the counts)")
    ap.add_argument("--dense-mask", action="store_true",
                    help="also count DDTREE on a backend that takes the dense custom mask")  # fmt: skip
    ap.add_argument("--sampling", default="0",
                    help="comma-separated settings T[/top_k[/top_p[/min_p]]] (0: greedy), e.g. 0,1,0.7/20/0.8/0.05: "
                         "DDTREE's step also counted with every request sampling so")  # fmt: skip
    ap.add_argument("--baseline", type=Path, help="an earlier run's JSON to compare with")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--tag", default=f"cpu_{datetime.date.today().isoformat()}")
    args = ap.parse_args(argv)
    try:
        samplings = [Sampling.parse(x) for x in args.sampling.split(",") if x]
    except ValueError as e:
        ap.error(f"--sampling: {e}")

    from sglang.srt.speculative.ddtree.tree_build import triton_interpreted

    if not triton_interpreted():
        print("error: Triton is not in interpreter mode; set TRITON_INTERPRET=1 before running", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = run_matrix(args.bs, args.budgets, args.block, args.vocab, args.dense_mask, samplings or [None])
    result = {
        "label": "CPU, op counts",
        "meta": {
            "date": datetime.date.today().isoformat(),
            "host": f"{platform.machine()} CPU, {platform.python_implementation()} {platform.python_version()}",
            "torch": torch.__version__,
            "triton_interpret": True,
            "commit": _commit(),
            "command": "python3 -m benchmarks.step_ops " + " ".join(argv if argv is not None else sys.argv[1:]),
            "note": "counts of the eager work of one decode step outside the model forwards (greedy, or "
                    "sampled as each row's sampling says); deterministic, not timings",
        },  # fmt: skip
        "rows": rows,
    }
    if args.baseline:
        result["baseline"] = {"path": str(args.baseline), **json.loads(args.baseline.read_text())["meta"],
                              "rows": json.loads(args.baseline.read_text())["rows"]}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"step_ops_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    base = {_key(r): r for r in (result.get("baseline") or {}).get("rows", [])}
    print(f"{'algo':<22}{'sampling':<26}{'bs':>4}{'budget':>8}{'launches':>10}{'device':>8}{'triton':>8}{'ext':>5}"
          f"{'views':>7}{'allocs':>8}{'host':>6}{'baseline':>10}")  # fmt: skip
    for r in rows:
        b = base.get(_key(r), {}).get("launches", "")
        print(f"{r['algo']:<22}{r.get('sampling', 'greedy'):<26}{r['bs']:>4}{str(r['budget'] or '-'):>8}"
              f"{r['launches']:>10}{r['device_ops']:>8}{r['triton']:>8}{r['extension']:>5}{r['view_ops']:>7}"
              f"{r['alloc_ops']:>8}{r['host_ops']:>6}{b:>10}")  # fmt: skip
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
