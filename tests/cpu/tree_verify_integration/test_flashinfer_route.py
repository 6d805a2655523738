# SPDX-License-Identifier: Apache-2.0
"""flashinfer_split as the policy's choice on the patched Triton backend: FlashInfer
planned once per forward, outside the forward, from the device's exact prefix lengths
(a speculative verify's host lengths are an upper bound); under CUDA graphs one pass
per batch size, re-planned before each replay over the hook's persistent buffers; our
tail and merge (interpreted Triton) on top.

FlashInfer's kernels run on the GPU host only (tests/gpu/tree_verify_integration):
here its two wrappers are stand-ins that record each plan and compute the prefix pass
in torch from what was planned, so the routing, the planning and the merge are what
is tested."""

import json
import math

import pytest
import torch

from _setup import Pool, Verify, dense_reference, layer_for, model_runner, qkv, triton_backend
from sglang.srt.layers.attention.tree_verify import StrategyUnavailable, flashinfer_split
from sglang.srt.utils import gpu_arch

H, HKV, DQK, DV = 3, 1, 576, 512
MLA = ("mla", H, HKV, DQK, DV)


class PrefixWrapper:
    """Records plans; runs the planned prefix pass in torch (base-2 LSE, as FlashInfer)."""

    made = []

    def __init__(self, workspace, *args, use_cuda_graph=False, backend="auto", **buffers):
        self.graph, self.backend = use_cuda_graph, backend
        self.buffers = buffers
        self.plans = []
        PrefixWrapper.made.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, ckv_dim, kpe_dim,
             page_size, causal, sm_scale, q_dtype, kv_dtype):  # fmt: skip
        self.plans.append(dict(kv_indptr=kv_indptr, kv_indices_numel=kv_indices.numel()))
        self.qo_indptr = qo_indptr.tolist()
        self.kv_indptr = kv_indptr.tolist()
        self.kv_indices = self.buffers["kv_indices"] if self.graph else kv_indices
        self.sm_scale = sm_scale

    def run(self, q_nope, q_pe, ckv, kpe, return_lse=True):
        q = torch.cat([q_nope, q_pe], -1).float()
        k = torch.cat([ckv, kpe], -1)[:, 0].float()
        o = torch.zeros(q.shape[0], q.shape[1], ckv.shape[-1])
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf)
        for b in range(len(self.kv_indptr) - 1):
            rows = slice(self.qo_indptr[b], self.qo_indptr[b + 1])
            slots = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            if slots.numel() == 0:
                continue
            s = torch.einsum("nhd,td->nht", q[rows], k[slots]) * self.sm_scale
            lse[rows] = torch.logsumexp(s, -1) / math.log(2)
            o[rows] = torch.einsum("nht,td->nhd", torch.softmax(s, -1), k[slots, : ckv.shape[-1]])
        return o.to(q_nope.dtype), lse


class StandInFlashInfer:
    class mla:
        BatchMLAPagedAttentionWrapper = PrefixWrapper


@pytest.fixture
def sm120_with_table(monkeypatch, tmp_path):
    """A (fake) sm_120 GPU, FlashInfer's stand-in, and a measured table in which
    flashinfer_split wins at this test's shape."""
    PrefixWrapper.made.clear()
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
    monkeypatch.delenv(gpu_arch.SM120_PROXY_ENV, raising=False)
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(flashinfer_split, "_flashinfer", lambda: StandInFlashInfer)
    table = tmp_path / "table.json"
    rows = [{"H": H, "N": n, "P": 1024, "bs": bs, "ms": {"fused": 0.4, "flashinfer_split": 0.2}}
            for n in (5, 9) for bs in (1, 2, 3)]  # fmt: skip
    rows.append({"H": H, "N": 9, "P": 1024, "bs": 8, "ms": {"fused": 0.1, "flashinfer_split": 0.2}})
    table.write_text(json.dumps({"sections": [
        {"arch": "sm12x", "date": "2026-12-02", "hardware": "test", "command": "test", "rows": rows}
    ]}))  # fmt: skip
    monkeypatch.setenv("SGLANG_DDTREE_STRATEGY_TABLE", str(table))


def _backend(verify, pool, **runner_kw):
    return triton_backend(model_runner("DDTREE", attention=MLA, **runner_kw), pool, verify, mla=True)


def _layer_output(be, verify, pool, gen, fb, logit_cap=0.0):
    layer = layer_for("mla", H, HKV, DQK, DV, logit_cap=logit_cap)
    q, k, v = qkv(verify, H, HKV, DQK, DV, torch.float16, True, gen)
    o = be.forward_extend(q, k, v, layer, fb)
    ref = dense_reference(verify, q.view(-1, H, DQK), pool, layer.scaling, logit_cap)
    return o.view(-1, H, DV).float(), ref


def test_planned_once_per_forward_from_the_exact_lengths(sm120_with_table):
    """The host's seq_lens_cpu of a verify is an upper bound (the DFlash workers add a
    block to a copy that may lag the device): planned from it, FlashInfer would attend
    past each prefix. The plan takes the device's exact CSR."""
    gen = torch.Generator().manual_seed(3)
    verify = Verify([17, 0, 40], 9, "DDTREE", gen)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    be = _backend(verify, pool)
    fb = verify.forward_batch(seq_lens_cpu=verify.prefix + 9)  # the workers' host bound
    be.init_forward_metadata(fb)
    assert be.tree_verify.routes.strategy(3, 9, H) == "flashinfer_split"
    (wrapper,) = PrefixWrapper.made
    assert not wrapper.graph and wrapper.backend == "auto"
    (plan,) = wrapper.plans
    assert plan["kv_indptr"] is be.tree_verify.metadata.prefix_kv_indptr
    assert plan["kv_indptr"].tolist() == [0, 17, 17, 57] and plan["kv_indices_numel"] == 57
    for _ in range(2):  # two layers of the forward share the plan
        o, ref = _layer_output(be, verify, pool, gen, fb)
        torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)
    assert len(wrapper.plans) == 1
    be.init_forward_metadata(verify.forward_batch())  # the next forward plans anew, same wrapper
    assert len(PrefixWrapper.made) == 1 and len(wrapper.plans) == 2


def test_graph_passes_keep_their_buffers_and_replan(sm120_with_table):
    gen = torch.Generator().manual_seed(5)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    first = Verify([7, 30], 9, "DDTREE", gen)
    be = _backend(first, pool)
    be.tree_verify.init_graph_state(max_bs=4, max_num_tokens=4 * 9)
    for prefix in ([7, 30], [40, 1], [0, 22]):
        verify = Verify(prefix, 9, "DDTREE", gen)
        first.req_to_token.copy_(verify.req_to_token)
        verify.req_to_token = first.req_to_token
        fb = verify.forward_batch()
        be.kv_indptr[1:3] = torch.cumsum(fb.seq_lens, 0)
        meta = be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
        (wrapper,) = PrefixWrapper.made
        assert wrapper.graph and wrapper.buffers["kv_indices"].data_ptr() == meta.prefix_kv_indices.data_ptr()
        plan = wrapper.plans[-1]
        assert plan["kv_indptr"].tolist() == [0, prefix[0], sum(prefix)]
        assert plan["kv_indices_numel"] == 0  # the slots are read in place from the hook's buffer
        layer = layer_for("mla", H, HKV, DQK, DV)
        q, k, v = qkv(verify, H, HKV, DQK, DV, torch.float16, True, gen)
        pool.set_mla_kv_buffer(layer, verify.out_cache_loc, k[..., :DV], k[..., DV:])
        o = be.tree_verify.run(q.view(-1, H, DQK), pool.k, pool.get_value_buffer(0), layer, fb)
        ref = dense_reference(verify, q.view(-1, H, DQK), pool, layer.scaling)
        torch.testing.assert_close(o.float(), ref, atol=2e-3, rtol=2e-3)
    assert len(wrapper.plans) == 3


def test_what_the_pass_cannot_serve_runs_fused(sm120_with_table, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    verify = Verify([9, 3], 9, "DDTREE", gen)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    be = _backend(verify, pool)
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    o, ref = _layer_output(be, verify, pool, gen, fb, logit_cap=5.0)  # no logit cap in FlashInfer
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)
    # At batch 8 the table says fused: nothing is planned for it.
    assert be.tree_verify.routes.strategy(8, 9, H) == "fused"
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashinfer_split")  # forced: it must serve
    forced = _backend(verify, pool)
    forced.init_forward_metadata(fb)
    with pytest.raises(StrategyUnavailable, match="a logit cap"):
        _layer_output(forced, verify, pool, gen, fb, logit_cap=5.0)


def test_the_sm120_proxy_asks_for_fa2_on_another_gpu(sm120_with_table, monkeypatch):
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(gpu_arch.SM120_PROXY_ENV, "1")
    gen = torch.Generator().manual_seed(7)
    verify = Verify([11, 4], 9, "DDTREE", gen)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    be = _backend(verify, pool)
    assert "flashmla_split" not in be.tree_verify.routes.available
    fb = verify.forward_batch()
    be.init_forward_metadata(fb)
    assert PrefixWrapper.made[0].backend == "fa2"
    o, ref = _layer_output(be, verify, pool, gen, fb)
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)


def test_forced_flashinfer_without_flashinfer_is_refused_at_startup(monkeypatch):
    from sglang.srt.layers.attention.tree_verify.hook import TreeVerifyUnavailable

    def missing():
        raise StrategyUnavailable("flashinfer_split needs flashinfer: No module named 'flashinfer'")

    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(flashinfer_split, "_flashinfer", missing)
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "flashinfer_split")
    verify = Verify([3], 4, "DDTREE", torch.Generator().manual_seed(0))
    with pytest.raises(TreeVerifyUnavailable, match="flashinfer_split needs flashinfer"):
        _backend(verify, Pool(HKV, DQK, DV, torch.float16, mla=True))


def test_lengths_staged_before_the_draft_plan_on_the_host(sm120_with_table):
    """The DDTREE worker stages a step's committed lengths (the verify's seq_lens) before
    it queues the draft: the plan then reads them on the host, in the pass's own host
    arrays, and FlashInfer has nothing of the device's to copy back (no sync behind the
    draft). A forward without a stage plans from the device, as before. The worker stages
    while the last verify's strategy plans on the host: not before the first."""
    gen = torch.Generator().manual_seed(11)
    verify = Verify([17, 0, 40], 9, "DDTREE", gen)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    be = _backend(verify, pool)
    hook = be.tree_verify
    fb = verify.forward_batch(seq_lens_cpu=verify.prefix + 9)
    assert not hook.wants_prefix_lens
    hook.stage_prefix_lens(verify.prefix)
    be.init_forward_metadata(fb)
    (wrapper,) = PrefixWrapper.made
    assert wrapper.plans[-1]["kv_indptr"] is hook.metadata.prefix_kv_indptr  # from the device
    assert hook.wants_prefix_lens
    hook.stage_prefix_lens(verify.prefix)
    be.init_forward_metadata(fb)
    plan = wrapper.plans[-1]
    assert plan["kv_indptr"] is not hook.metadata.prefix_kv_indptr and plan["kv_indptr"].device.type == "cpu"
    assert wrapper.kv_indptr == [0, 17, 17, 57] and wrapper.qo_indptr == [0, 9, 18, 27]
    assert hook.metadata.staged_prefix_lens.for_rows(3).tolist() == [17, 0, 40]
    o, ref = _layer_output(be, verify, pool, gen, fb)
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)
    host_indptr = plan["kv_indptr"]

    # The next step's stage reuses the pass's host arrays; their values are the new ones.
    second = Verify([3, 25, 8], 9, "DDTREE", gen)
    verify.req_to_token.copy_(second.req_to_token)
    second.req_to_token = verify.req_to_token
    hook.stage_prefix_lens(second.prefix)
    be.init_forward_metadata(second.forward_batch())
    assert wrapper.plans[-1]["kv_indptr"].data_ptr() == host_indptr.data_ptr()
    assert wrapper.kv_indptr == [0, 3, 28, 36]
    o, ref = _layer_output(be, second, pool, gen, second.forward_batch())
    torch.testing.assert_close(o, ref, atol=2e-3, rtol=2e-3)

    # A stage serves one verify: the next forward plans from the device's CSR.
    be.init_forward_metadata(second.forward_batch())
    assert wrapper.plans[-1]["kv_indptr"] is hook.metadata.prefix_kv_indptr
    assert hook.metadata.staged_prefix_lens is None


def test_staged_lengths_under_graphs_pad_as_the_runner_does(sm120_with_table):
    """A replay pads the batch to the captured size with prefix length 1 (the backend's
    ``get_cuda_graph_seq_len_fill_value``); the staged lengths, the raw batch's, are padded
    the same way, so the host plan matches the device's CSR row for row."""
    gen = torch.Generator().manual_seed(12)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    verify = Verify([7, 30], 9, "DDTREE", gen)
    be = _backend(verify, pool)
    assert be.tree_verify.seq_len_fill_value == be.get_cuda_graph_seq_len_fill_value() == 1
    be.tree_verify.init_graph_state(max_bs=4, max_num_tokens=4 * 9)
    fb = verify.forward_batch(
        batch_size=3,
        req_pool_indices=torch.cat([verify.req_pool_indices, torch.zeros(1, dtype=torch.int64)]),
        seq_lens=torch.cat([verify.prefix, torch.ones(1, dtype=torch.int64)]),
    )
    be.kv_indptr[1:4] = torch.cumsum(fb.seq_lens, 0)
    be.tree_verify.prepare(fb, be.kv_indptr, graph=True)  # the first replay: from the device
    be.tree_verify.stage_prefix_lens(verify.prefix)
    meta = be.tree_verify.prepare(fb, be.kv_indptr, graph=True)
    (wrapper,) = PrefixWrapper.made
    assert wrapper.graph and len(wrapper.plans) == 2
    assert meta.staged_prefix_lens.for_rows(3).tolist() == [7, 30, 1]
    assert wrapper.kv_indptr == meta.prefix_kv_indptr[:4].tolist() == [0, 7, 37, 38]


def test_a_stage_is_dropped_where_it_cannot_serve(sm120_with_table, monkeypatch):
    gen = torch.Generator().manual_seed(13)
    verify = Verify([17, 40], 9, "DDTREE", gen)
    pool = Pool(HKV, DQK, DV, torch.float16, mla=True)
    be = _backend(verify, pool)
    hook = be.tree_verify
    be.init_forward_metadata(verify.forward_batch())
    # Any other forward in between drops it (its lengths may not be this verify's).
    hook.stage_prefix_lens(verify.prefix)
    assert hook._staged is not None
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    assert hook.prepare(verify.forward_batch(forward_mode=ForwardMode.DECODE)) is None
    be.init_forward_metadata(verify.forward_batch())
    assert hook.metadata.staged_prefix_lens is None
    # More staged rows than the verify has: not this verify's.
    hook.stage_prefix_lens(torch.tensor([17, 40, 5]))
    be.init_forward_metadata(verify.forward_batch())
    assert hook.metadata.staged_prefix_lens.for_rows(2) is None
    (wrapper,) = PrefixWrapper.made
    assert wrapper.plans[-1]["kv_indptr"] is hook.metadata.prefix_kv_indptr
    # After a verify the table sends to the fused kernel (batch 8) nothing is staged; a
    # stage made before it goes unread (the fused kernel plans nothing, never waits for it).
    wide = Verify([5] * 8, 9, "DDTREE", gen)
    hook.stage_prefix_lens(verify.prefix)
    be.init_forward_metadata(wide.forward_batch())
    assert hook.routes.strategy(8, 9, H) == "fused"
    assert len(PrefixWrapper.made) == 1 and len(wrapper.plans) == 3
    assert not hook.wants_prefix_lens
    hook.stage_prefix_lens(wide.prefix)
    assert hook._staged is None
    # A verify no strategy of which plans on the host stages nothing.
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "fused")
    fused = _backend(verify, pool)
    assert not fused.tree_verify.wants_prefix_lens
    fused.tree_verify.stage_prefix_lens(verify.prefix)
    assert fused.tree_verify._staged is None


def test_a_gqa_target_takes_the_rows_of_its_own_layout(monkeypatch, tmp_path):
    """The route asks the policy with the target's KV heads and head dim: of two measured
    GQA layouts it follows the rows of its own (here flashinfer_split), not the other's."""
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_STRATEGY", raising=False)
    monkeypatch.delenv(gpu_arch.SM120_PROXY_ENV, raising=False)
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(flashinfer_split, "_flashinfer", lambda: StandInFlashInfer)
    h, hkv, d = 4, 2, 64
    rows = [{"kind": "mha", "H": h, "N": 9, "P": 1024, "bs": 2, "Hkv": hkv, "D": d,
             "ms": {"fused": 0.4, "flashinfer_split": 0.2}},
            {"kind": "mha", "H": h, "N": 9, "P": 1024, "bs": 2, "Hkv": hkv, "D": 4 * d,
             "ms": {"fused": 0.1, "flashinfer_split": 0.3}}]  # fmt: skip
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"sections": [
        {"arch": "sm12x", "date": "2026-12-04", "hardware": "test", "command": "test", "rows": rows}
    ]}))  # fmt: skip
    monkeypatch.setenv("SGLANG_DDTREE_STRATEGY_TABLE", str(table))
    gen = torch.Generator().manual_seed(5)
    verify = Verify([17, 4], 9, "DDTREE", gen)
    pool = Pool(hkv, d, d, torch.float16, mla=False)
    be = triton_backend(model_runner("DDTREE", attention=("mha", h, hkv, d, d)), pool, verify, mla=False)
    assert be.tree_verify.routes.strategy(2, 9, h) == "flashinfer_split"
    rows[0]["Hkv"], rows[1]["Hkv"] = 8 * hkv, hkv  # now the D=256 row is the nearer layout
    rows[1]["D"] = d
    other = tmp_path / "other_table.json"
    other.write_text(json.dumps({"sections": [
        {"arch": "sm12x", "date": "2026-12-04", "hardware": "test", "command": "test", "rows": rows}
    ]}))  # fmt: skip
    monkeypatch.setenv("SGLANG_DDTREE_STRATEGY_TABLE", str(other))
    be = triton_backend(model_runner("DDTREE", attention=("mha", h, hkv, d, d)), pool, verify, mla=False)
    assert be.tree_verify.routes.strategy(2, 9, h) == "fused"
