# SPDX-License-Identifier: Apache-2.0
"""What the patched Triton backend refills before a TARGET_VERIFY graph's replay.

A captured graph whose layers all took the tree-verify path reads the hook's buffers and the
backend's prefix row pointers only, so a replay refills just those; upstream's own verify
buffers (query and mask row pointers, prefix indices) are left as they are. Once any layer has
been left to upstream's path, or with SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM=1, every replay
refills them as upstream does; on a hybrid SWA pool the window's write slots are refilled either
way. The capture and the replays run the real patched
``init_forward_metadata_out_graph`` and ``forward_extend`` (eagerly: the buffers, not a CUDA
graph, are under test; ``test_hooked_backend_gpu.py`` replays real graphs).
"""

import pytest
import torch

from _setup import MAX_CTX, Pool, Verify, dense_reference, layer_for, model_runner, qkv, triton_backend

H, HKV, D = 4, 2, 64
N = 6
GRAPH_BS = 4
SENTINEL = -7


def _captured(algorithm: str, gen: torch.Generator):
    """A backend after the capture of a padded ``GRAPH_BS`` verify: one layer through the
    patched forward_extend, then upstream's verify buffers set to a sentinel."""
    verify = Verify([7, 0, 12], N, algorithm, gen)
    pool = Pool(HKV, D, D, torch.float16, mla=False)
    be = triton_backend(model_runner(algorithm), pool, verify, mla=False)
    be.cuda_graph_kv_indices = torch.zeros(8 * MAX_CTX, dtype=torch.int32)
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * N)
    layer = layer_for("mha", H, HKV, D, D)
    fb = _padded(verify)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    q, k, v = qkv(verify, H, HKV, D, D, torch.float16, False, gen)
    be.forward_extend(_pad_rows(q, verify), _pad_rows(k, verify), _pad_rows(v, verify), layer, fb)
    _poison(be)
    return be, pool, layer, verify.req_to_token


def _padded(verify: Verify):
    """The graph's view of a batch: padded rows at pool row 0 with length 1, their tree
    slots 0 (the pool's padding slot)."""
    pad = GRAPH_BS - verify.bs
    return verify.forward_batch(
        batch_size=GRAPH_BS,
        req_pool_indices=torch.cat([verify.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.cat([verify.prefix, torch.ones(pad, dtype=torch.int64)]),
        out_cache_loc=torch.cat([verify.out_cache_loc, torch.zeros(pad * verify.n, dtype=torch.int64)]),
    )


def _pad_rows(x: torch.Tensor, verify: Verify) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((GRAPH_BS - verify.bs) * verify.n, *x.shape[1:])])


def _poison(be) -> None:
    for buf in (be.qo_indptr, be.mask_indptr, be.cuda_graph_kv_indices):
        buf.fill_(SENTINEL)


def _upstream_refilled(be) -> bool:
    return bool((be.qo_indptr[: GRAPH_BS + 1] != SENTINEL).all())


def _replay(be, pool, layer, req_to_token, prefix, gen):
    """One replay's preparation and layer: its output against the dense reference."""
    verify = Verify(prefix, N, "DDTREE" if be.consumes_tree_mask_bits else "DFLASH", gen)
    req_to_token.copy_(verify.req_to_token)  # one table for the whole run, as in the server
    verify.req_to_token = req_to_token
    fb = _padded(verify)
    be.init_forward_metadata_out_graph(fb)
    assert torch.equal(be.kv_indptr[1 : GRAPH_BS + 1], torch.cumsum(fb.seq_lens, 0).to(torch.int32))
    q, k, v = qkv(verify, H, HKV, D, D, torch.float16, False, gen)
    o = be.forward_extend(_pad_rows(q, verify), _pad_rows(k, verify), _pad_rows(v, verify), layer, fb)
    ref = dense_reference(verify, q.view(-1, H, D), pool, layer.scaling)
    torch.testing.assert_close(o.view(-1, H, D)[: verify.bs * N].float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("algorithm", ["DDTREE", "DFLASH"])
def test_replay_fills_only_what_the_hooked_layers_read(algorithm):
    gen = torch.Generator().manual_seed(11)
    be, pool, layer, req_to_token = _captured(algorithm, gen)
    for prefix in ([30, 2], [1, 1, 1, 40], [0, 9, 3]):
        _replay(be, pool, layer, req_to_token, prefix, gen)
        assert not _upstream_refilled(be)
        assert (be.mask_indptr == SENTINEL).all() and (be.cuda_graph_kv_indices == SENTINEL).all()


def test_a_layer_left_to_upstream_brings_the_refill_back():
    """A DFLASH layer the hook cannot serve (here one with a score_mod) takes upstream's
    path, which reads upstream's buffers: from then on every replay refills them."""
    gen = torch.Generator().manual_seed(12)
    be, pool, layer, req_to_token = _captured("DFLASH", gen)
    _replay(be, pool, layer, req_to_token, [5, 20], gen)
    assert not _upstream_refilled(be)
    verify = Verify([3, 8], N, "DFLASH", gen)
    q = torch.randn(verify.bs * N, H, D, generator=gen).half()
    served = be.tree_verify.run(q, pool.k, pool.v, layer, verify.forward_batch(), unsupported="score_mod")
    assert served is None  # left to upstream's path
    _replay(be, pool, layer, req_to_token, [30, 2, 9], gen)
    assert _upstream_refilled(be)
    assert torch.equal(be.qo_indptr[: GRAPH_BS + 1], torch.arange(GRAPH_BS + 1) * N)
    assert (be.cuda_graph_kv_indices[: 41 + 1] != SENTINEL).all()  # 30 + 2 + 9 prefix slots, the padding row 1


def test_replays_with_the_torch_verify_indices(monkeypatch):
    """SGLANG_DDTREE_VERIFY_INDICES_TORCH=1 (the A/B of the one-launch kernel) builds the same
    indices with torch ops: the replays still equal the reference."""
    from sglang.srt.layers.attention.tree_verify.verify_indices import verify_indices_reference

    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_INDICES_TORCH", "1")
    gen = torch.Generator().manual_seed(16)
    be, pool, layer, req_to_token = _captured("DDTREE", gen)
    assert be.tree_verify._fill_indices is verify_indices_reference
    for prefix in ([30, 2], [1, 1, 1, 40]):
        _replay(be, pool, layer, req_to_token, prefix, gen)


def test_refill_can_be_forced(monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_REFILL_UPSTREAM", "1")
    gen = torch.Generator().manual_seed(13)
    be, pool, layer, req_to_token = _captured("DDTREE", gen)
    _replay(be, pool, layer, req_to_token, [4, 4, 4], gen)
    assert _upstream_refilled(be)


def test_no_refill_is_skipped_before_a_graph_layer_ran():
    """Before any captured layer took the hook's path nothing shows the graphs do not read
    upstream's buffers: a replay refills them."""
    gen = torch.Generator().manual_seed(14)
    verify = Verify([6, 2], N, "DDTREE", gen)
    be = triton_backend(model_runner("DDTREE"), Pool(HKV, D, D, torch.float16, False), verify, False)
    be.cuda_graph_kv_indices = torch.zeros(8 * MAX_CTX, dtype=torch.int32)
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * N)
    _poison(be)
    be.init_forward_metadata_out_graph(_padded(verify))
    assert _upstream_refilled(be)


def test_replay_on_a_hybrid_swa_pool_refills_the_window_write_slots():
    """gpt-oss's layout (a sliding layer with sinks in the SWA pool, a full layer): a replay
    that leaves upstream's window buffers unfilled still refills the SWA slots the captured
    KV store writes to, and both layers equal the reference on fresh requests."""
    from tests.cpu.tree_verify_integration._swa import FULL_LAYER, SWA_LAYER, Shape, SWAVerify, reference
    from tests.cpu.tree_verify_integration._swa import layer as swa_layer

    shape, n = Shape(), 7
    sinks = torch.tensor([1.5, -0.5, 3.0, 0.0], dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(15)
    sv = SWAVerify([9, 3, 30], n, "DDTREE", gen, shape=shape)
    be = sv.backend(
        cuda_graph_kv_indices=torch.zeros(8 * shape.max_ctx, dtype=torch.int32),
        cuda_graph_window_kv_indices=torch.zeros(8 * shape.max_ctx, dtype=torch.int32),
        cuda_graph_window_num_kv_splits=torch.zeros(8, dtype=torch.int32),
        cuda_graph_window_kv_offsets=torch.zeros(8, dtype=torch.int32),
        cuda_graph_swa_out_cache_loc=torch.zeros(8 * n, dtype=torch.int64),
    )
    be.tree_verify.init_graph_state(max_bs=8, max_num_tokens=8 * n)

    def forward(step, fb, layer_id, window):
        t = step.verify.bs * n
        q = torch.randn(t, shape.h * shape.d, generator=gen).half()
        k = torch.randn(t, shape.hkv, shape.d, generator=gen).half()
        v = torch.randn(t, shape.hkv, shape.d, generator=gen).half()
        o = be.forward_extend(_pad_rows(q, step.verify), _pad_rows(k, step.verify), _pad_rows(v, step.verify),
                              swa_layer(shape, layer_id, window), fb, sinks=sinks)  # fmt: skip
        ref = reference(step, q.view(t, shape.h, shape.d), k, v, layer_id, window, sinks)
        torch.testing.assert_close(o.view(-1, shape.h, shape.d)[:t].float(), ref, atol=3e-3, rtol=3e-3)

    fb = _padded(sv.verify)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    for layer_id, window in ((SWA_LAYER, shape.window), (FULL_LAYER, None)):
        forward(sv, fb, layer_id, window)
    _poison(be)
    for buf in (be.window_kv_indptr, be.cuda_graph_window_kv_indices):
        buf.fill_(SENTINEL)
    for prefix in ([44, 1], [2, 2, 2, 15]):
        step = sv.step(prefix, n, "DDTREE", gen)  # new requests on the same pools
        be.req_to_token = be.tree_verify.req_to_token = step.verify.req_to_token
        fb = _padded(step.verify)
        be.init_forward_metadata_out_graph(fb)
        translate = step.pool.translate_loc_from_full_to_swa
        written = be.cuda_graph_swa_out_cache_loc[: fb.out_cache_loc.numel()]
        assert torch.equal(written, translate(fb.out_cache_loc))
        for layer_id, window in ((SWA_LAYER, shape.window), (FULL_LAYER, None)):
            forward(step, fb, layer_id, window)
        assert not _upstream_refilled(be)
        assert (be.window_kv_indptr == SENTINEL).all() and (be.cuda_graph_window_kv_indices == SENTINEL).all()
