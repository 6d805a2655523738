# SPDX-License-Identifier: Apache-2.0
"""The profiler-trace breakdown of benchmarks/e2e_profile.py on small synthetic Chrome traces,
and its kernel-name rules against the real kernel names in the installed (patched) sglang."""

import ast
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
from benchmarks import e2e_profile as ep


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def synthetic_trace(steps=4):
    """Per step: 2 tree-verify launches (30 + 10 us), one extend (50), a MoE (100),
    a GEMM (200), an elementwise (5), a memcpy (5); plus CPU ops that must be ignored."""
    ev, t = [], 1000.0
    for _ in range(steps):
        for name, dur, cat in [("_tree_verify_split_kernel", 30, "kernel"),
                               ("_tree_verify_combine_kernel", 10, "kernel"),
                               ("_fwd_kernel", 50, "kernel"),
                               ("fused_moe_kernel", 100, "kernel"),
                               ("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 200, "kernel"),
                               ("void at::native::vectorized_elementwise_kernel<4>", 5, "kernel"),
                               ("Memcpy DtoD (Device -> Device)", 5, "gpu_memcpy")]:
            ev.append(kernel(name, t, dur, cat))
            t += dur + 1
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999})
    ev.append({"ph": "i", "cat": "kernel", "name": "_tree_verify_split_kernel", "ts": 0})  # not complete
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 12345})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def test_breakdown_sums_per_category_and_step():
    b = ep.breakdown(synthetic_trace(steps=4), steps=4)
    cats = b["categories"]
    assert cats["tree_verify"]["ms_per_step"] == pytest.approx(0.040)
    assert cats["tree_verify"]["launches"] == 8
    assert cats["extend_attention"]["ms_per_step"] == pytest.approx(0.050)
    assert cats["moe"]["ms_per_step"] == pytest.approx(0.100)
    assert cats["gemm"]["ms_per_step"] == pytest.approx(0.200)
    assert cats["memcpy"]["ms_per_step"] == pytest.approx(0.005)
    assert cats["other"]["ms_per_step"] == pytest.approx(0.005)
    assert "decode_attention" not in cats  # absent categories are left out
    assert b["gpu_ms_per_step"] == pytest.approx(0.400)
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert cats["tree_verify"]["share"] == pytest.approx(0.1)
    # span: back-to-back kernels with 1 us gaps, 7 per step
    assert b["span_ms_per_step"] == pytest.approx((4 * 407 - 1) / 1000 / 4)
    top = b["top_kernels"]
    assert top[0]["name"].startswith("nvjet") and top[0]["category"] == "gemm"
    assert top[0]["launches_per_step"] == pytest.approx(1.0)
    by_cat = b["kernels_by_category"]
    assert [k["name"] for k in by_cat["tree_verify"]] == ["_tree_verify_split_kernel", "_tree_verify_combine_kernel"]
    assert by_cat["other"] == [{"name": "void at::native::vectorized_elementwise_kernel<4>",
                                "ms_per_step": pytest.approx(0.005), "launches_per_step": pytest.approx(1.0)}]
    assert list(by_cat) == [c for c in ep.ORDER if c in cats]


def test_kernels_by_category_keep_the_costliest_and_cut_long_names():
    long = "void cutlass::" + "x" * 5000
    ev = [kernel(f"elementwise_{i}", 100.0 * i, 1.0 + i, "kernel") for i in range(15)]
    ev.append(kernel(long, 9000.0, 3.0, "kernel"))
    b = ep.breakdown({"traceEvents": ev}, steps=1, per_category=4)
    other = b["kernels_by_category"]["other"]
    assert [k["name"] for k in other] == ["elementwise_14", "elementwise_13", "elementwise_12", "elementwise_11"]
    names = [k["name"] for rows in b["kernels_by_category"].values() for k in rows]
    assert all(len(n) <= ep.NAME_CHARS for n in names)


def test_host_side_graph_launches_kernel_launches_and_syncs():
    t = synthetic_trace(steps=4)
    ev = t["traceEvents"]
    for i in range(4):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10 * i, "dur": 3})
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 50, "dur": 800})
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 60, "dur": 2})  # not a sync
    ev.append({"ph": "X", "cat": "cuda_driver", "name": "cuMemcpyDtoH_v2", "ts": 70, "dur": 200})
    h = ep.breakdown(t, steps=4)["host"]
    assert h["graph_launches_per_step"] == pytest.approx(0.25)  # the one cudaGraphLaunch
    assert h["kernel_launches_per_step"] == pytest.approx(1.0)
    assert h["host_syncs_per_step"] == pytest.approx(0.5)
    assert h["host_sync_ms_per_step"] == pytest.approx(1.0 / 4)
    assert h["host_sync_calls"] == {"cudaStreamSynchronize": 1, "cuMemcpyDtoH_v2": 1}


def test_gpu_idle_merges_overlapping_streams():
    ev = [kernel("a", 0, 10), kernel("b", 5, 10), kernel("c", 30, 5), kernel("d", 31, 1)]
    b = ep.breakdown(ev, steps=1)
    assert b["gpu_idle_ms_per_step"] == pytest.approx(15 / 1000)  # the gap 15..30 only
    assert b["span_ms_per_step"] == pytest.approx(35 / 1000)


def test_breakdown_divides_by_the_given_steps():
    t = synthetic_trace(steps=4)
    assert ep.breakdown(t, steps=2)["gpu_ms_per_step"] == pytest.approx(2 * ep.breakdown(t, steps=4)["gpu_ms_per_step"])


def test_breakdown_rejects_traces_without_gpu_work_and_bad_steps():
    with pytest.raises(ValueError, match="no GPU kernel events"):
        ep.breakdown({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 5}]}, steps=1)
    with pytest.raises(ValueError, match="steps"):
        ep.breakdown(synthetic_trace(), steps=0)


def test_bare_event_list_is_accepted():
    assert ep.breakdown(synthetic_trace()["traceEvents"], steps=4)["gpu_ms_per_step"] == pytest.approx(0.4)


@pytest.mark.parametrize("name,cat", [
    ("_tree_verify_split_kernel", "tree_verify"),
    ("_fwd_kernel", "extend_attention"),
    ("_fwd_kernel_unified", "extend_attention"),
    ("_fwd_kernel_stage2", "decode_attention"),
    ("_fwd_grouped_kernel_stage1", "decode_attention"),
    ("BatchPrefillWithPagedKVCacheKernel", "other_attention"),
    ("merge_state_v2_kernel", "other_attention"),
    ("_tree_verify_page_gather_kernel", "tree_verify"),
    ("void sm90::flash_fwd_splitkv_mla_kernel<Traits<cutlass::bfloat16_t, 576>>(DenseAttnDecodeParams)", "flashmla"),
    ("void smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 512, 8, 64, 256>(CombineParams)", "flashmla"),
    ("get_mla_metadata_kernel(GetDecodingMetadataParams)", "flashmla"),
    ("void flashinfer::mla::BatchMLAPagedAttentionKernel<KernelTraits<...>, MLAParams<...>>(...)", "flashinfer_mla"),
    ("void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<...>(...)", "flashinfer_mla"),
    ("fused_moe_kernel", "moe"),
    # triton_kernels' MoE matmuls (gpt-oss's experts on moe_runner_backend triton_kernel): the
    # name its make_matmul_repr gives them, not a dense GEMM
    ("_matmul_ogs_NNT_bf16xbf16xbf16_64x128x64x1", "moe"),
    ("_matmul_og_ptma_NNT_bf16xbf16xbf16_128x256x64x1", "moe"),
    ("moe_align_block_size_kernel", "moe"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>", "gemm"),
    ("void at::native::reduce_kernel<512, 1>", "other"),
])
def test_categorize(name, cat):
    assert ep.categorize(name) == cat


def _triton_kernels(path: Path) -> set:
    """Names of the @triton.jit functions defined in a source file."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                src = ast.unparse(d)
                if "triton.jit" in src or src == "jit":
                    out.add(node.name)
    return out


def _sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    return Path(list(spec.submodule_search_locations)[0])


def test_rules_match_the_real_kernel_names():
    """Every fused tree-verify kernel of the overlay, upstream's extend and decode attention
    kernels and its Triton MoE kernel land in the category the breakdown reports them in."""
    overlay = REPO / "sglang" / "srt" / "layers" / "attention" / "tree_verify" / "prefix_split.py"
    tv = _triton_kernels(overlay)
    assert tv and all(ep.categorize(n) == "tree_verify" for n in tv if n.startswith("_tree_verify_"))
    assert any(n.startswith("_tree_verify_") for n in tv)
    ops = _sglang_dir() / "kernels" / "ops"
    extend = _triton_kernels(ops / "attention" / "extend_attention.py")
    assert {"_fwd_kernel", "_fwd_kernel_unified"} <= extend
    assert {ep.categorize(n) for n in ("_fwd_kernel", "_fwd_kernel_unified")} == {"extend_attention"}
    decode = {n for n in _triton_kernels(ops / "attention" / "decode_attention.py") if n.startswith("_fwd")}
    assert decode and {ep.categorize(n) for n in decode} == {"decode_attention"}
    assert "fused_moe_kernel" in _triton_kernels(ops / "moe" / "fused_moe_triton_kernels.py")


def test_linear_attention_rules_match_the_real_kernel_names():
    """The Gated DeltaNet layers' kernels, by the names upstream's Triton sources give them:
    what the TARGET_VERIFY branch of the GDN backend runs (the tree-mode conv update and the
    gated-delta update, the kernels patch 0054 puts in tree mode) and the copy of the
    accepted node's state are ``linear_verify``; the layers' decode, prefill, gating,
    splits and norms are ``linear_other``; the fused tree-verify kernels, which also serve
    the sliding-window and sink layers (their window and sinks are constexpr switches of
    the same kernels), stay ``tree_verify``."""
    root = _sglang_dir()
    ops = root / "kernels" / "ops"
    fla = ops / "attention" / "fla"
    conv = _triton_kernels(ops / "mamba" / "causal_conv1d_triton.py")
    recurrent = _triton_kernels(fla / "fused_sigmoid_gating_recurrent.py")
    scatter = _triton_kernels(ops / "mamba" / "mamba_state_scatter_triton.py")
    assert {"_causal_conv1d_update_kernel", "_causal_conv1d_fwd_kernel"} <= conv and recurrent
    verify = {"_causal_conv1d_update_kernel", "_fused_mamba_state_scatter_with_mask_kernel",
              "_fused_conv_window_scatter_with_mask_kernel"} | recurrent
    assert verify - recurrent - conv <= scatter
    assert {n: ep.categorize(n) for n in verify} == {n: "linear_verify" for n in verify}
    # The verify branch of upstream's GDN backend calls exactly these two kernels' wrappers.
    backend = (root / "srt" / "layers" / "attention" / "linear" / "gdn_backend.py").read_text()
    kernels = (root / "srt" / "layers" / "attention" / "linear" / "kernels" / "gdn_triton.py").read_text()
    assert "causal_conv1d_update(" in backend.split("if is_target_verify:")[2]
    assert "fused_sigmoid_gating_delta_rule_update(" in kernels.split("def target_verify(")[1]
    other = (conv - {"_causal_conv1d_update_kernel"}) | (scatter - verify)
    for path in (fla / "fused_recurrent.py", fla / "fused_gdn_gating.py", fla / "fused_norm_gate.py",
                 fla / "layernorm_gated.py", fla / "l2norm.py", fla / "chunk_o.py", fla / "cumsum.py",
                 fla / "wy_fast.py", fla / "chunk_delta_h.py", fla / "chunk_fwd.py",
                 ops / "attention" / "triton_gdn_fused_proj.py"):
        other |= {n for n in _triton_kernels(path) if "kda" not in n}
    assert len(other) > 15
    assert {n: ep.categorize(n) for n in other} == {n: "linear_other" for n in other}
    overlay = REPO / "sglang" / "srt" / "layers" / "attention" / "tree_verify" / "prefix_split.py"
    assert all(ep.categorize(n) == "tree_verify" for n in _triton_kernels(overlay) if n.startswith("_tree_verify_"))
    assert ep.ORDER.index("tree_verify") < ep.ORDER.index("linear_verify") < ep.ORDER.index("other_attention")


def test_linear_verify_ms_only_on_a_speculative_hybrid_step():
    hybrid = {"categories": {"linear_verify": {"ms_per_step": 3.0}, "linear_other": {"ms_per_step": 1.0},
                             "tree_verify": {"ms_per_step": 0.5}}}
    assert ep.linear_verify_ms(hybrid, "fused") == 3.0
    assert ep.linear_verify_ms(hybrid, "auto") == 3.0
    assert ep.linear_verify_ms(hybrid, "-") is None  # no speculation: those kernels are its decode
    assert ep.linear_verify_ms({"categories": {"tree_verify": {"ms_per_step": 0.5}}}, "fused") is None


def test_verify_attention_ms_fused_and_upstream_with_drafter_twin():
    fused = {"categories": {"tree_verify": {"ms_per_step": 2.0}, "extend_attention": {"ms_per_step": 0.5}}}
    upstream = {"categories": {"extend_attention": {"ms_per_step": 10.5}}}
    assert ep.verify_attention_ms(fused, "fused") == 2.0
    assert ep.verify_attention_ms(upstream, "upstream_extend", fused) == pytest.approx(10.0)
    assert ep.verify_attention_ms(upstream, "upstream_extend") is None  # not separable alone
    assert ep.verify_attention_ms(fused, "-") is None
    flashmla = {"categories": {"tree_verify": {"ms_per_step": 0.5}, "flashmla": {"ms_per_step": 2.0}}}
    assert ep.verify_attention_ms(flashmla, "flashmla_split") == pytest.approx(2.5)
    assert ep.verify_attention_ms(flashmla, "auto") == pytest.approx(2.5)  # the default's choice
    assert ep.verify_attention_ms(fused, "auto") == 2.0
    flashinfer = {"categories": {"tree_verify": {"ms_per_step": 0.5}, "flashinfer_mla": {"ms_per_step": 1.5}}}
    assert ep.verify_attention_ms(flashinfer, "flashinfer_split") == pytest.approx(2.0)
    # On a FlashInfer MLA server those kernels are also upstream's own decode and prefill.
    assert ep.verify_attention_ms({**flashinfer, "backend": "flashinfer"}, "auto") == pytest.approx(0.5)


def test_trace_roundtrip_and_wait(tmp_path):
    path = tmp_path / "x-TP-0.trace.json.gz"
    assert not ep.wait_for_trace(path, timeout=0.6)
    with gzip.open(path, "wt") as f:
        json.dump(synthetic_trace(), f)
    assert ep.wait_for_trace(path, timeout=5)
    assert ep.breakdown(ep.load_trace(path), steps=4)["gpu_ms_per_step"] == pytest.approx(0.4)
    broken = tmp_path / "y.trace.json.gz"
    broken.write_bytes(path.read_bytes()[:40])  # a half-written gzip never counts as done
    assert not ep.wait_for_trace(broken, timeout=1.2)


def _phase_trace(steps=2):
    """Per step on the scheduler's thread (tid 1): ddtree.step [0, 100) holding ddtree.draft
    [5, 35) and ddtree.verify [40, 90); the draft launches a graph (two kernels of 4 and 6 us)
    and the verify a graph (20 us) and one kernel (3 us); a kernel launched after the step
    (the scheduler's: 2 us); a launch on another thread inside the step's time (9 us)."""
    ev, corr = [], 0

    def rng(name, ts, dur, tid=1):
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid})

    def launch(call, ts, kernels, tid=1):
        nonlocal corr
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": call, "ts": ts, "dur": 1, "tid": tid,
                   "args": {"correlation": corr}})  # fmt: skip
        for i, dur in enumerate(kernels):
            ev.append({"ph": "X", "cat": "kernel", "name": f"k{corr}_{i}", "ts": ts + 200 + 10 * i, "dur": dur,
                       "tid": 99, "args": {"correlation": corr}})  # fmt: skip

    for s in range(steps):
        t = 1000.0 * s
        rng("ddtree.step", t, 100)
        rng("ddtree.draft", t + 5, 30)
        rng("ddtree.verify", t + 40, 50)
        launch("cudaGraphLaunch", t + 10, [4, 6])
        launch("cudaGraphLaunch", t + 50, [20])
        launch("cudaLaunchKernel", t + 60, [3])
        launch("cudaLaunchKernel", t + 95, [1])  # in the step, in no inner phase
        launch("cudaLaunchKernel", t + 150, [2])  # after the step
        launch("cudaLaunchKernel", t + 20, [9], tid=2)  # another thread
        rng("other.range", t + 300, 10)  # not a DDTREE phase
    return {"traceEvents": ev}


def test_phase_breakdown_charges_kernels_to_the_innermost_range_of_their_launch():
    phases = ep.phase_breakdown(_phase_trace(steps=2), steps=2)
    assert list(phases) == ["draft", "step", "verify", "outside"]
    assert phases["draft"] == {"host_ms_per_step": 0.030, "gpu_ms_per_step": 0.010, "gpu_launches_per_step": 2}
    assert phases["verify"] == {"host_ms_per_step": 0.050, "gpu_ms_per_step": 0.023, "gpu_launches_per_step": 2}
    # The step's own host time is what its phases leave: 100 - 30 - 50 us.
    assert phases["step"]["host_ms_per_step"] == pytest.approx(0.020)
    assert phases["step"]["gpu_ms_per_step"] == pytest.approx(0.001)
    assert phases["outside"] == {"host_ms_per_step": 0.0, "gpu_ms_per_step": 0.011, "gpu_launches_per_step": 2}


def test_phase_breakdown_is_none_without_ranges_and_in_breakdown():
    assert ep.phase_breakdown(synthetic_trace(), steps=4) is None
    assert ep.breakdown(synthetic_trace(), steps=4)["phases"] is None
    t = _phase_trace(steps=1)
    assert ep.breakdown(t, steps=1)["phases"]["verify"]["gpu_launches_per_step"] == 2
    with pytest.raises(ValueError):
        ep.phase_breakdown(t, steps=0)


def test_ddtree_step_opens_every_phase_range_under_the_profiler(tmp_path):
    """The real DDTREE decode step (benchmarks/step_ops' CPU world) under torch's profiler:
    every phase range in the trace, nested in the step, and what phase_breakdown reads; no
    range outside a profile."""
    from torch.profiler import ProfilerActivity, profile

    from sglang.srt.speculative.ddtree.tree_build import triton_interpreted

    if not triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before triton loads (the step's Triton kernels on the CPU)")

    from benchmarks import step_ops
    from sglang.srt.speculative.ddtree.step_phases import PHASES

    world = step_ops.StepWorld("DDTREE", 2, 16, 16, 256)
    world.step()  # untraced: nothing opens (and the step runs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        world.step()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert sorted(n for n in names if n.startswith("ddtree.")) == sorted("ddtree." + p for p in PHASES)
    phases = ep.phase_breakdown(trace, steps=1)
    assert set(phases) == set(PHASES)
    assert all(v["host_ms_per_step"] > 0 for v in phases.values()), phases
