# SPDX-License-Identifier: Apache-2.0
"""Where the GPU time of one decode step goes, from the server's own torch profiler.

SGLang 0.5.17 profiles through ``POST /start_profile`` (body: the ``ProfileReq`` fields of
``srt/managers/io_struct.py``). Without ``start_step`` the scheduler starts the profiler at
once and, with ``num_steps=S``, stops it by itself when the S-th forward after the request
has been launched (``SchedulerProfilerManager._profile_batch_predicate``); it then writes
``<output_dir>/<profile_id>-TP-0.trace.json.gz`` (``output_dir`` defaults to
``$SGLANG_TORCH_PROFILER_DIR`` or /tmp). One forward is one decode step, or one
draft + verify step under speculation. CUDA-graph replays are traced kernel by kernel.

:func:`breakdown` sums the traced GPU kernel time per category and divides by S. The
profiler starts and stops between scheduler iterations while the GPU may still be running
the previous one, so the step count is good to about one step in S; the *shares* do not
depend on it. On the upstream verify path the target's verify attention runs upstream's
Triton extend kernel, which the DFlash drafter's own attention also uses, so
``extend_attention`` there holds both; subtract the same configuration's fused-path
``extend_attention`` (the drafter part) to isolate the verify (``verify_attention_ms``).
On a hybrid target the Gated DeltaNet layers verify the tree with their own kernels
(``linear_verify``, :func:`linear_verify_ms`), beside the full-attention layers' verify.

:func:`host_calls` and ``gpu_idle_ms_per_step`` read the host side: a step whose GPU idles
between kernels (the host launching one by one, or blocked in a sync) is host-bound, and
no kernel speed-up shortens it.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path
from typing import Iterable, Optional

#: (category, pattern on the kernel name), first match wins. Names are Triton function
#: names (``_tree_verify_split_kernel`` ...) or CUDA library symbols.
CATEGORIES = (
    ("tree_verify", re.compile(r"^_tree_verify_")),
    # upstream's Triton extend attention (kernels/ops/attention/extend_attention.py)
    ("extend_attention", re.compile(r"^_fwd_kernel(_unified)?$")),
    # upstream's Triton decode attention (kernels/ops/attention/decode_attention.py)
    ("decode_attention", re.compile(r"^_fwd_(grouped_)?kernel_stage[12]$")),
    # FlashMLA (sgl_kernel): the prefix pass of the flashmla_split verify path
    ("flashmla", re.compile(r"flash_fwd_splitkv_mla|flash_fwd_mla_combine|get_mla_metadata")),
    # FlashInfer's MLA kernels (fa2 mla.cuh, fa3 mla_hopper.cuh): on a Triton-backend server
    # the prefix pass of the flashinfer_split verify path
    ("flashinfer_mla", re.compile(r"BatchMLAPagedAttentionKernel|BatchMLAPageAttentionHopperKernel")),
    # The linear-attention (Gated DeltaNet) layers of a hybrid target. Their tree verify
    # (patch 0054 switches upstream's kernels to tree mode): the short causal conv and the
    # gated-delta recurrence along each node's root path, then the copy of the accepted
    # node's state into the request's slot (kernels/ops/mamba/causal_conv1d_triton.py,
    # kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py,
    # kernels/ops/mamba/mamba_state_scatter_triton.py). A speculative step runs no target
    # decode forward, so there these are the verify's; a no-speculation step's decode
    # shares the conv kernel.
    ("linear_verify", re.compile(r"^(_causal_conv1d_update_kernel|fused_sigmoid_gating_delta_rule_update_kernel"
                                 r"|_fused_mamba_state_scatter_with_mask_kernel"
                                 r"|_fused_conv_window_scatter_with_mask_kernel)$")),
    # The rest of those layers: their decode and prefill kernels, the gating, the
    # projection splits and the gated norm around the recurrence.
    ("linear_other", re.compile(r"^(_causal_conv1d_fwd_kernel|fused_recurrent_gated_delta_rule_\w*kernel"
                                r"|fused_gdn_gating_kernel|chunk_gated_delta_rule_\w+|chunk_fwd_kernel_o"
                                r"|chunk_local_cumsum_\w+|recompute_w_u_fwd_kernel|l2norm_fwd_kernel1?"
                                r"|fused_qkvzba_split_reshape_cat(_contiguous)?_kernel|fused_qkv_split_gdn_prefill_kernel"
                                r"|layer_norm_gated_fwd_kernel1?|_layer_norm_fwd_1pass_kernel"
                                r"|track_mamba_state_if_needed_kernel|track_mamba_states_all_layers_kernel)$")),
    ("other_attention", re.compile(r"attn|attention|flashinfer|flash_|mla|merge_state|BatchPrefill|BatchDecode",
                                   re.IGNORECASE)),
    # upstream's fused MoE, and the triton_kernels matmuls upstream runs gpt-oss's experts
    # with (moe_runner_backend triton_kernel: ``_matmul_ogs_...``, or ``_matmul_o<g|s>...``
    # after their gather / scatter in newer releases)
    ("moe", re.compile(r"moe|expert|matmul_ogs|^_matmul_o[gs]+_", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|bmm|splitk", re.IGNORECASE)),
)
MEMORY_EVENT_CATS = {"gpu_memcpy", "gpu_memset"}
KERNEL_EVENT_CATS = {"kernel"} | MEMORY_EVENT_CATS
#: The host side of the trace: CUDA runtime / driver calls made by the server's threads.
RUNTIME_EVENT_CATS = {"cuda_runtime", "cuda_driver"}
#: Calls that block the host until the GPU catches up (a blocking copy to the host included).
HOST_SYNC_CALL = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpyDtoH(_v2)?$")
GRAPH_LAUNCH_CALL = re.compile(r"^cu(da)?GraphLaunch")
KERNEL_LAUNCH_CALL = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel)")
ORDER = [name for name, _ in CATEGORIES] + ["memcpy", "other"]


def categorize(name: str, cat: str = "kernel") -> str:
    if cat.lower() in MEMORY_EVENT_CATS:
        return "memcpy"
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def gpu_events(trace: dict) -> Iterable[dict]:
    """Complete ('X') GPU kernel / memcpy / memset events of a Chrome trace."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    for ev in events:
        if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() in KERNEL_EVENT_CATS and "dur" in ev:
            yield ev


#: Kernel names in the per-category lists are cut to this many characters (CUTLASS
#: template names run to thousands).
NAME_CHARS = 160


def breakdown(trace: dict, steps: int, top: int = 12, per_category: int = 10) -> dict:
    """GPU time per step per category (Chrome trace durations are microseconds).
    ``kernels_by_category`` lists each category's ``per_category`` costliest kernels,
    so that a category's growth between two configurations (the many small "other"
    kernels of a tree step, say) can be read off the JSON without the trace."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    per_cat = {c: 0.0 for c in ORDER}
    count = {c: 0 for c in ORDER}
    per_kernel: dict[str, list] = {}
    first, last = None, None
    for ev in gpu_events(trace):
        name, dur, ts = ev.get("name", "?"), float(ev["dur"]), float(ev.get("ts", 0.0))
        category = categorize(name, ev["cat"])
        per_cat[category] += dur
        count[category] += 1
        k = per_kernel.setdefault(name, [category, 0.0, 0])
        k[1] += dur
        k[2] += 1
        first = ts if first is None else min(first, ts)
        last = ts + dur if last is None else max(last, ts + dur)
    total = sum(per_cat.values())
    if total <= 0:
        raise ValueError("the trace holds no GPU kernel events (was the GPU activity profiled?)")
    categories = {
        c: {"ms_per_step": per_cat[c] / 1000 / steps, "share": per_cat[c] / total, "launches": count[c]}
        for c in ORDER
        if count[c]
    }
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    kernels = ranked[:top]
    by_category: dict[str, list] = {}
    for n, (c, t, k) in ranked:
        rows = by_category.setdefault(c, [])
        if len(rows) < per_category:
            rows.append({"name": n[:NAME_CHARS], "ms_per_step": t / 1000 / steps, "launches_per_step": k / steps})
    return {
        "steps": steps,
        "gpu_ms_per_step": total / 1000 / steps,
        "span_ms_per_step": (last - first) / 1000 / steps,
        "gpu_idle_ms_per_step": _idle_us(gpu_events(trace)) / 1000 / steps,
        "host": host_calls(trace, steps),
        "phases": phase_breakdown(trace, steps),
        "categories": categories,
        "top_kernels": [
            {"name": n, "category": c, "ms_per_step": t / 1000 / steps, "launches_per_step": k / steps}
            for n, (c, t, k) in kernels
        ],
        "kernels_by_category": {c: by_category[c] for c in ORDER if c in by_category},
    }


#: The profiler ranges DDTREE's worker opens around the phases of a decode step
#: (``speculative/ddtree/step_phases.py``; the trace's ``user_annotation`` events).
PHASE_PREFIX = "ddtree."
#: GPU work launched outside every phase range: the scheduler's own, or another worker's.
OUTSIDE = "outside"


def phase_breakdown(trace: dict, steps: int, prefix: str = PHASE_PREFIX) -> Optional[dict]:
    """Per step and per phase range (``<prefix><phase>``): the host milliseconds inside the
    range, less its inner ranges (``host_ms_per_step``), and the GPU milliseconds and
    launches of the kernels and copies launched from inside it, charged to the innermost
    range (a CUDA-graph replay's kernels to the range that launched the graph). A kernel is
    matched to its launch through the trace's correlation ids. ``None`` if the trace has no
    such range (an algorithm that opens none)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    ranges: dict = {}  # tid -> [(start, end, phase)]
    launches: dict = {}  # correlation id -> (tid, ts)
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        if cat == "user_annotation" and name.startswith(prefix):
            start = float(ev.get("ts", 0.0))
            ranges.setdefault(ev.get("tid"), []).append((start, start + float(ev["dur"]), name[len(prefix):]))
        elif cat in RUNTIME_EVENT_CATS:
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (ev.get("tid"), float(ev.get("ts", 0.0)))
    if not ranges:
        return None
    for spans in ranges.values():
        spans.sort(key=lambda r: (r[0], -r[1]))

    def innermost(tid, ts) -> str:
        # Ranges nest: the last one to open before ts that still holds it is the innermost.
        best = None
        for start, end, name in ranges.get(tid, ()):
            if start > ts:
                break
            if end >= ts:
                best = name
        return best or OUTSIDE

    host = {}
    for spans in ranges.values():
        for i, (start, end, name) in enumerate(spans):
            inner = 0.0
            reach = start
            for s2, e2, _ in spans[i + 1:]:
                if s2 >= end:
                    break
                if s2 >= reach:  # a direct child (deeper ones lie inside it)
                    inner += min(e2, end) - s2
                    reach = e2
            host[name] = host.get(name, 0.0) + (end - start) - inner
    gpu, count = {}, {}
    for ev in gpu_events(trace):
        corr = (ev.get("args") or {}).get("correlation")
        where = launches.get(corr)
        name = innermost(*where) if where is not None else OUTSIDE
        gpu[name] = gpu.get(name, 0.0) + float(ev["dur"])
        count[name] = count.get(name, 0) + 1
    names = sorted(set(host) | set(gpu), key=lambda n: (n == OUTSIDE, n))
    return {
        n: {
            "host_ms_per_step": host.get(n, 0.0) / 1000 / steps,
            "gpu_ms_per_step": gpu.get(n, 0.0) / 1000 / steps,
            "gpu_launches_per_step": count.get(n, 0) / steps,
        }
        for n in names
    }


def _idle_us(events: Iterable[dict]) -> float:
    """Time inside the traced span when no kernel or copy ran on any stream."""
    spans = sorted((float(ev.get("ts", 0.0)), float(ev.get("ts", 0.0)) + float(ev["dur"])) for ev in events)
    idle, reach = 0.0, None
    for start, end in spans:
        if reach is not None and start > reach:
            idle += start - reach
        reach = end if reach is None else max(reach, end)
    return idle


def host_calls(trace: dict, steps: int) -> dict:
    """Per step: CUDA-graph launches, single kernel launches, and the calls that made the
    host wait for the GPU (count and blocked ms). A step the GPU idles in while the
    host launches kernels one by one, or waits in a sync, shows here."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    graphs = kernels = syncs = 0
    sync_us = 0.0
    sync_names: dict[str, int] = {}
    for ev in events:
        if ev.get("ph") != "X" or str(ev.get("cat", "")).lower() not in RUNTIME_EVENT_CATS:
            continue
        name = ev.get("name", "")
        if GRAPH_LAUNCH_CALL.search(name):
            graphs += 1
        elif KERNEL_LAUNCH_CALL.search(name):
            kernels += 1
        elif HOST_SYNC_CALL.search(name):
            syncs += 1
            sync_us += float(ev.get("dur", 0.0))
            sync_names[name] = sync_names.get(name, 0) + 1
    return {
        "graph_launches_per_step": graphs / steps,
        "kernel_launches_per_step": kernels / steps,
        "host_syncs_per_step": syncs / steps,
        "host_sync_ms_per_step": sync_us / 1000 / steps,
        "host_sync_calls": sync_names,
    }


def verify_category(verify: Optional[str]) -> Optional[str]:
    """The category that holds the target's verify attention on a verify path (the
    prefix passes of flashmla_split and flashinfer_split add theirs to it)."""
    if verify is None or verify == "-":
        return None
    return "extend_attention" if verify == "upstream_extend" else "tree_verify"


def verify_attention_ms(prof: dict, verify: Optional[str], fused_twin: Optional[dict] = None) -> Optional[float]:
    """Verify attention ms per step; on the upstream path minus the drafter's share of the
    extend kernel, taken from the fused-path profile of the same configuration when given."""
    category = verify_category(verify)
    if category is None:
        return None
    cats = prof["categories"]
    ms = cats.get(category, {}).get("ms_per_step", 0.0)
    if category == "tree_verify":
        # FlashMLA runs in these servers only as our strategy's prefix pass (forced, or
        # the policy's choice); so do FlashInfer's MLA kernels on a Triton-backend server.
        ms += cats.get("flashmla", {}).get("ms_per_step", 0.0)
        if prof.get("backend", "triton") == "triton":
            ms += cats.get("flashinfer_mla", {}).get("ms_per_step", 0.0)
    if category == "extend_attention":
        if fused_twin is None:
            return None  # not separable from the drafter's attention without the twin
        ms -= fused_twin["categories"].get("extend_attention", {}).get("ms_per_step", 0.0)
    return max(ms, 0.0)


def linear_verify_ms(prof: dict, verify: Optional[str]) -> Optional[float]:
    """The linear-attention layers' tree verify, ms per step, on a hybrid target's
    speculative server; None without speculation or without linear-attention layers."""
    if verify is None or verify == "-":
        return None
    cats = prof["categories"]
    if "linear_verify" not in cats and "linear_other" not in cats:
        return None
    return cats.get("linear_verify", {}).get("ms_per_step", 0.0)


def load_trace(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def start_profile(server, out_dir: Path, profile_id: str, steps: int, host: bool = False) -> Path:
    """Ask the server to trace the next ``steps`` forwards, no stacks: GPU activity only, or
    with ``host`` the host's ops too, which the phase ranges (:func:`phase_breakdown`) need;
    recording them slows the host, so its milliseconds then read high."""
    out_dir.mkdir(parents=True, exist_ok=True)
    body = {
        "output_dir": str(out_dir),
        "num_steps": steps,
        "activities": ["CPU", "GPU"] if host else ["GPU"],
        "with_stack": False,
        "record_shapes": False,
        "profile_id": profile_id,
    }
    _post_text(server, "/start_profile", body)
    return out_dir / f"{profile_id}-TP-0.trace.json.gz"


def _post_text(server, path: str, body: dict) -> str:
    """The profiler endpoints answer plain text, not JSON."""
    import urllib.request

    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def wait_for_trace(path: Path, timeout: float) -> bool:
    """The scheduler writes the gzip in one go after the last step; wait until it is whole."""
    deadline = time.time() + timeout
    size = -1
    while time.time() < deadline:
        if path.exists():
            now = path.stat().st_size
            if now == size and now > 0:
                try:
                    load_trace(path)
                    return True
                except (OSError, EOFError, ValueError):
                    pass
            size = now
        time.sleep(0.5)
    return False
