# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from sglang.srt.layers.attention.tree_verify import (
    StrategyUnavailable,
    causal_tree_mask,
    tree_verify_attention,
)
from sglang.srt.layers.attention.tree_verify.configs import (
    MLA,
    TreeVerifyConfig,
    head_class,
    head_dim_blocks,
    select_config,
)
from sglang.srt.layers.attention.tree_verify.strategies import get_strategy
from sglang.srt.layers.attention.tree_verify.prefix_split import choose_num_splits, num_splits_for


def inputs(bs=2, n=4, h=4, hkv=1, d=32, p=(5, 9)):
    k = torch.randn(64, hkv, d, dtype=torch.float16)
    indptr = torch.tensor([0, *torch.tensor(p).cumsum(0).tolist()], dtype=torch.int32)
    pidx = torch.arange(int(indptr[-1]), dtype=torch.int32)
    tidx = torch.arange(40, 40 + bs * n, dtype=torch.int32).view(bs, n)
    q = torch.randn(bs * n, h, d, dtype=torch.float16)
    return [q, k, k, indptr, pidx, tidx, causal_tree_mask(bs, n), 0.2]


def test_reference_on_cpu_by_default():
    args = inputs()
    out = tree_verify_attention(*args)
    assert out.shape == (8, 4, 32) and out.dtype == torch.float16
    # The chain root sees only the prefix and itself.
    q, k, _, indptr, pidx, tidx = args[:6]
    keys = torch.cat([k[pidx[:5].long(), 0], k[tidx[0, :1].long(), 0]]).float()
    probs = torch.softmax(q[0].float() @ keys.T * 0.2, -1)
    torch.testing.assert_close(out[0].float(), probs @ keys, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.__setitem__(0, a[0][:-1]), "rows"),
        (lambda a: a.__setitem__(6, a[6][:, :3]), "tree_mask"),
        (lambda a: a.__setitem__(3, a[3].long()), "int32"),
        (lambda a: a.__setitem__(slice(1, 3), [torch.zeros(64, 3, 32).half()] * 2), "multiple of KV heads"),
        (lambda a: a.__setitem__(1, a[1].bfloat16()), "dtype"),
        (lambda a: a.__setitem__(1, a[1].to(torch.float8_e4m3fn)), "both one fp8 dtype"),
        (lambda a: a.__setitem__(3, a[3][:2]), "bs\\+1"),
    ],
)
def test_bad_input_is_explained(mutate, match):
    args = inputs()
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        tree_verify_attention(*args)


def test_unknown_and_unavailable_strategies(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="unknown tree-verify strategy"):
        tree_verify_attention(*inputs(), strategy="nope")
    with pytest.raises(StrategyUnavailable, match="CUDA device"):
        tree_verify_attention(*inputs(), strategy="fused")
    with pytest.raises(StrategyUnavailable, match="sm_90a/sm_100a only"):
        get_strategy("flashmla_split").run(arch=(12, 0), kv_scales=None)


def test_fp8_kv_cache_scales_and_strategies(monkeypatch):
    """fp8 KV holds K / k_scale and V / v_scale; only fused and reference read it."""
    args = inputs()
    k8 = (args[1].float() / 0.5).to(torch.float8_e4m3fn)
    fp8 = [args[0], k8, k8, *args[3:]]
    dequant = [args[0], (k8.float() * 0.5).half(), (k8.float() * 0.5).half(), *args[3:]]
    out = tree_verify_attention(*fp8, k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(out, tree_verify_attention(*dequant), atol=1e-3, rtol=1e-3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(StrategyUnavailable, match="fused and reference strategies only"):
        tree_verify_attention(*fp8, strategy="upstream_extend")


def test_head_dim_split():
    assert head_dim_blocks(576, 512) == (512, 64, 512, 64, 512)
    assert head_dim_blocks(128, 128) == (128, 0, 128, 0, 128)
    assert head_dim_blocks(96, 96) == (96, 0, 128, 0, 128)
    assert head_class(576, 512) == MLA and head_class(128, 128) == "d128"


def test_config_tables_by_arch():
    assert select_config((9, 0), 576, 512).block_m == 64
    # sm_12x: one KV buffer, the next tile prefetched into registers (docs/verify-kernels.md)
    assert select_config((12, 0), 576, 512).register_prefetch
    assert not select_config((9, 0), 576, 512).register_prefetch
    # 12.0 and 12.1 (and Ada) use the 99 KiB table.
    assert select_config((12, 0), 576, 512) == select_config((12, 1), 576, 512)
    assert select_config((8, 9), 128, 128) == select_config((12, 0), 128, 128)


CFG = TreeVerifyConfig(block_m=64, block_n=32, num_warps=8, num_stages=3)


def test_splits_fill_the_gpu():
    # 17 row tiles (H16 x N65) over a 16K prefix on 132 SMs: enough splits to fill
    # most of the GPU, and no straggler wave (the last wave at least 3/4 full).
    s = choose_num_splits(17, 16384, 1, CFG, 132)
    waves = -(-17 * s // 132)
    assert 7 <= s <= 64
    assert 17 * s > 0.75 * waves * 132, (s, waves)
    # 130 row tiles (H128 x N65) already fill the GPU: one split.
    assert choose_num_splits(130, 65536, 1, CFG, 132) == 1
    assert choose_num_splits(17, 0, 1, CFG, 132) == 0  # no prefix: tail only
    assert choose_num_splits(17, 100, 1, CFG, 132) == 1  # tiny prefix


def test_split_count_reads_the_index_buffer_size_only():
    """Under CUDA graphs the prefix index buffer has its capacity (bs x context) and
    stale contents; the split count must come from that size and the static shape,
    so every replay launches the captured grid. Eagerly the buffer holds the exact sum."""
    bs, n, h = 4, 65, 16
    q = torch.empty(bs * n, h, 576, dtype=torch.float16)
    k = torch.empty(8, 1, 576, dtype=torch.float16)
    v = k[..., :512]
    row_tiles = -(-n * h // CFG.block_m) * bs  # one KV head, V read from the K tile
    capacity = torch.randint(0, 8, (bs * 65536,), dtype=torch.int32)
    exact = torch.zeros(bs * 1000, dtype=torch.int32)
    graph = num_splits_for(q, k, v, capacity, bs, n, CFG)
    eager = num_splits_for(q, k, v, exact, bs, n, CFG)
    assert graph == choose_num_splits(row_tiles, bs * 65536, bs, CFG, 132)
    assert eager == choose_num_splits(row_tiles, bs * 1000, bs, CFG, 132)
    assert graph != eager  # the size, not a constant, decides
    assert num_splits_for(q, k, v, capacity.flip(0), bs, n, CFG) == graph  # contents do not
