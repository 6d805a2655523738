# SPDX-License-Identifier: Apache-2.0
"""The verify-strategy policy: one function over a measured table, what can run
where (the strategies' own answers), the forced strategy, and the table's format."""

import json

import pytest
import torch

from sglang.srt.layers.attention.tree_verify import dispatch, flashmla_split, policy
from sglang.srt.layers.attention.tree_verify.dispatch import forced_strategy
from sglang.srt.layers.attention.tree_verify.policy import (
    FLASHMLA_MIN_ROWS,
    StrategyTable,
    StrategyTableError,
    VerifyShape,
    choose_strategy,
)
from sglang.srt.layers.attention.tree_verify.registry import SERVING_STRATEGIES, VerifyTarget
from sglang.srt.layers.attention.tree_verify.strategies import available_strategies
from sglang.srt.layers.attention.tree_verify.strategies.flashinfer_split import flashinfer_backend
from sglang.srt.utils import gpu_arch

ALL = frozenset(SERVING_STRATEGIES)
MLA = VerifyTarget.of(576, 512, 1, torch.bfloat16, torch.bfloat16)


def row(h, n, p, bs, kind="mla", **ms):
    return {"kind": kind, "H": h, "N": n, "P": p, "bs": bs, "ms": ms}


def table(arch, *rows, date="2026-12-01"):
    return StrategyTable.from_json({"sections": [
        {"arch": arch, "date": date, "hardware": "test", "command": "test", "rows": list(rows)}
    ]})  # fmt: skip


# H16 N65 bs1: flashinfer_split nearer the fastest over the prefixes (1.4x at the short one,
# where fused wins, against fused's 1.95x at the long one); bs8: fused. H16 N4: fused.
SM12X = table(
    "sm12x",
    row(16, 65, 1024, 1, fused=0.05, flashinfer_split=0.07),
    row(16, 65, 16384, 1, fused=0.41, flashinfer_split=0.21),
    row(16, 65, 1024, 8, fused=0.17, flashinfer_split=0.30),
    row(16, 65, 16384, 8, fused=1.9, flashinfer_split=2.2),
    row(16, 4, 65536, 1, fused=0.09, flashinfer_split=0.23),
)


def test_the_strategy_nearest_the_fastest_over_the_prefixes():
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), ALL, SM12X) == "flashinfer_split"
    assert choose_strategy((12, 0), VerifyShape(16, 65, 8), ALL, SM12X) == "fused"
    assert choose_strategy((12, 1), VerifyShape(16, 4, 1), ALL, SM12X) == "fused"


def test_ratios_not_milliseconds_decide():
    """fused saves 0.3 ms at the long prefix and loses only 0.014 ms at the short one, but
    that is 1.21x there against flashinfer_split's 1.10x at the long one: a least-total-time
    choice would take fused, the policy takes the one never far from the fastest."""
    gqa = table("sm12x", row(32, 65, 1024, 1, kind="mha", fused=0.080, flashinfer_split=0.066),
                row(32, 65, 65536, 1, kind="mha", fused=3.0, flashinfer_split=3.3))  # fmt: skip
    assert choose_strategy((12, 0), VerifyShape(32, 65, 1, kind="mha"), ALL, gqa) == "flashinfer_split"


# The two measured points of the shipped table where no one strategy is within 1.2x of the
# fastest at every prefix length (one CUDA graph per batch size serves them all):
# (arch, kind, H, N, bs).
NO_ONE_STRATEGY = {("sm12x", "mla", 16, 17, 1), ("sm90", "mla", 16, 17, 8)}


def test_the_shipped_table_choice_is_within_1_2x_of_the_fastest():
    shipped = policy.load_table()
    arch = {"sm12x": (12, 0), "sm90": (9, 0)}
    misses = set()
    for section in shipped.sections:
        for r in section.rows:
            shape = VerifyShape(r["H"], r["N"], r["bs"], kind=r["kind"], kv_heads=r.get("Hkv"),
                                head_dim=r.get("D"))  # fmt: skip
            chosen = choose_strategy(arch[section.arch], shape, ALL, shipped)
            if r["ms"][chosen] > 1.2 * min(r["ms"].values()):
                misses.add((section.arch, r["kind"], r["H"], r["N"], r["bs"]))
    assert misses == NO_ONE_STRATEGY


def test_one_prefix_length_asked_about():
    at = lambda p: choose_strategy((12, 0), VerifyShape(16, 65, 1, prefix=p), ALL, SM12X)  # noqa: E731
    assert at(1000) == "fused" and at(20000) == "flashinfer_split"


def test_the_nearest_measured_point_decides():
    # In log2: 9 nodes are nearer 4 than 65, 33 nearer 65; batch 2 nearer 1 than 8,
    # batch 6 nearer 8.
    assert choose_strategy((12, 0), VerifyShape(16, 9, 1), ALL, SM12X) == "fused"
    assert choose_strategy((12, 0), VerifyShape(16, 33, 1), ALL, SM12X) == "flashinfer_split"
    assert choose_strategy((12, 0), VerifyShape(16, 65, 2), ALL, SM12X) == "flashinfer_split"
    assert choose_strategy((12, 0), VerifyShape(16, 65, 6), ALL, SM12X) == "fused"


def test_only_available_strategies_are_chosen():
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), {"fused"}, SM12X) == "fused"
    # A strategy measured at only some prefixes of the point is not compared.
    partial = table("sm12x", row(16, 65, 1024, 1, fused=0.05), row(16, 65, 16384, 1, fused=0.4, flashinfer_split=0.1))
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), ALL, partial) == "fused"


def test_ties_keep_the_fused_kernel():
    tie = table("sm12x", row(16, 65, 1024, 1, fused=0.1, flashinfer_split=0.1))
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), ALL, tie) == "fused"


def test_rows_serve_their_family_and_kind_only():
    assert choose_strategy((9, 0), VerifyShape(16, 65, 1), {"fused", "flashinfer_split"}, SM12X) == "fused"
    mha = VerifyShape(32, 65, 1, kind="mha")
    assert choose_strategy((12, 0), mha, ALL, SM12X) == "fused"
    gqa = table("sm12x", row(32, 17, 16384, 1, kind="mha", fused=0.3, flashinfer_split=0.2))
    assert choose_strategy((12, 0), mha, ALL, gqa) == "flashinfer_split"


def test_gqa_rows_are_matched_by_kv_heads_and_head_dim():
    """MHA/GQA rows carry their layout (KV heads Hkv, head dim D): a verify takes the rows of the
    nearest layout, so a D=64 target is not served by what was measured at D=256."""
    gqa = table("sm12x",
                {**row(32, 65, 16384, 1, kind="mha", fused=0.30, flashinfer_split=0.20), "Hkv": 8, "D": 256},
                {**row(32, 65, 16384, 1, kind="mha", fused=0.10, flashinfer_split=0.15), "Hkv": 8, "D": 64},
                {**row(64, 65, 16384, 1, kind="mha", fused=0.50, flashinfer_split=0.25), "Hkv": 8, "D": 128})  # fmt: skip
    at = lambda h, d: choose_strategy((12, 0), VerifyShape(h, 65, 1, kind="mha", kv_heads=8, head_dim=d), ALL, gqa)  # noqa: E731
    assert at(32, 256) == "flashinfer_split"
    assert at(32, 64) == "fused"
    assert at(16, 64) == "fused"  # nearest: H32 D64
    assert at(64, 128) == "flashinfer_split"
    # A shape without a layout (as before) still matches on H, N and bs alone.
    assert choose_strategy((12, 0), VerifyShape(64, 65, 1, kind="mha"), ALL, gqa) == "flashinfer_split"
    with pytest.raises(StrategyTableError, match="Hkv must be a positive integer"):
        table("sm12x", {**row(32, 65, 1024, 1, kind="mha", fused=0.1), "Hkv": 0})


def test_the_latest_section_of_a_family_wins():
    two = StrategyTable.from_json({"sections": [
        {"arch": "sm12x", "date": "2026-12-01", "hardware": "a", "command": "c",
         "rows": [row(16, 65, 16384, 1, fused=0.4, flashinfer_split=0.2)]},
        {"arch": "sm12x", "date": "2026-12-03", "hardware": "b", "command": "c",
         "rows": [row(16, 65, 16384, 1, fused=0.2, flashinfer_split=0.3)]},
    ]})  # fmt: skip
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), ALL, two) == "fused"


def test_without_rows_sm90_takes_flashmla_for_wide_trees_only():
    empty = StrategyTable()
    wide = VerifyShape(16, 65, 1)
    assert wide.rows >= FLASHMLA_MIN_ROWS > VerifyShape(16, 17, 8).rows
    assert choose_strategy((9, 0), wide, ALL, empty) == "flashmla_split"
    assert choose_strategy((9, 0), VerifyShape(16, 17, 8), ALL, empty) == "fused"
    assert choose_strategy((9, 0), VerifyShape(128, 17, 1), ALL, empty) == "flashmla_split"
    assert choose_strategy((9, 0), wide, ALL - {"flashmla_split"}, empty) == "fused"
    assert choose_strategy((10, 0), wide, ALL, empty) == "fused"  # sm_100: not measured
    assert choose_strategy((12, 0), wide, ALL, empty) == "fused"
    assert choose_strategy((9, 0), VerifyShape(16, 65, 1, kind="mha"), ALL, empty) == "fused"


def test_the_shipped_table_follows_the_format():
    shipped = policy.load_table()
    assert shipped.path.endswith("strategy_table.json")
    for section in shipped.sections:
        assert section.date and section.hardware and section.command


@pytest.mark.parametrize("bad,match", [
    ({}, "'sections' list"),
    ({"sections": [{"arch": "sm12x"}]}, "lacks date, hardware, command, rows"),
    ({"sections": [{"arch": "sm75", "date": "d", "hardware": "h", "command": "c", "rows": []}]},
     "not a policy family"),
    ({"sections": [{"arch": "sm12x", "date": "d", "hardware": "h", "command": "c",
                    "rows": [{"H": 16, "N": 65, "P": 1024, "bs": 0, "ms": {"fused": 1.0}}]}]},
     r"rows\[0\]: bs must be a positive integer"),
    ({"sections": [{"arch": "sm12x", "date": "d", "hardware": "h", "command": "c",
                    "rows": [{"H": 16, "N": 65, "P": 1024, "bs": 1, "ms": {"upstream_extend": 1.0}}]}]},
     "'upstream_extend' is not one of"),
    ({"sections": [{"arch": "sm12x", "date": "d", "hardware": "h", "command": "c",
                    "rows": [{"H": 16, "N": 65, "P": 1024, "bs": 1, "ms": {"fused": -1}}]}]},
     "positive number"),
])  # fmt: skip
def test_a_bad_table_is_refused_with_where(bad, match):
    with pytest.raises(StrategyTableError, match=match):
        StrategyTable.from_json(bad, "t.json")


def test_the_table_variable_names_another_table(tmp_path, monkeypatch):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"sections": [
        {"arch": "sm12x", "date": "2026-12-02", "hardware": "x", "command": "c",
         "rows": [row(16, 65, 16384, 1, fused=0.4, flashinfer_split=0.2)]}
    ]}))  # fmt: skip
    monkeypatch.setenv(policy.TABLE_ENV, str(path))
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), ALL) == "flashinfer_split"
    monkeypatch.setenv(policy.TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(StrategyTableError, match="no strategy table at"):
        policy.load_table()
    path.write_text("{not json")
    monkeypatch.setenv(policy.TABLE_ENV, str(path))
    with pytest.raises(StrategyTableError, match="measured.json"):
        policy.load_table()


def test_forced_strategy(monkeypatch):
    monkeypatch.delenv(dispatch.STRATEGY_ENV, raising=False)
    assert forced_strategy() is None
    monkeypatch.setenv(dispatch.STRATEGY_ENV, " flashmla_split ")
    assert forced_strategy() == "flashmla_split"
    monkeypatch.setenv(dispatch.STRATEGY_ENV, "flashmla")
    with pytest.raises(ValueError, match="not a tree-verify strategy; choose from fused"):
        forced_strategy()


@pytest.fixture
def hopper(monkeypatch):
    """An sm_90 GPU whose sgl_kernel loads FlashMLA and FlashInfer imports."""
    monkeypatch.delenv(gpu_arch.SM120_PROXY_ENV, raising=False)
    monkeypatch.setattr(gpu_arch, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flashmla_split, "_flash_mla", lambda: (None, None))


def test_what_can_run_here(hopper, monkeypatch):
    available, why = available_strategies(MLA, (9, 0))
    assert available == ALL, why
    fp8 = VerifyTarget.of(576, 512, 1, torch.bfloat16, torch.float8_e4m3fn)
    available, why = available_strategies(fp8, (9, 0))
    assert available == {"fused"} and "float8" in why["flashmla_split"]
    gqa = VerifyTarget.of(128, 128, 8, torch.bfloat16, torch.bfloat16)
    assert available_strategies(gqa, (9, 0))[0] == {"fused", "flashinfer_split"}
    odd = VerifyTarget.of(192, 128, 8, torch.bfloat16, torch.bfloat16)
    assert "Dqk == Dv" in available_strategies(odd, (9, 0))[1]["flashinfer_split"]
    available, why = available_strategies(MLA, (12, 0))
    assert "flashmla_split" not in available and "sm_90a/sm_100a only" in why["flashmla_split"]


def test_the_sm120_proxy_takes_the_sm12x_policy_without_flashmla(hopper, monkeypatch):
    assert flashinfer_backend() == "auto"
    monkeypatch.setenv(gpu_arch.SM120_PROXY_ENV, "1")
    available, why = available_strategies(MLA, (9, 0))  # the real H200
    assert "flashmla_split" not in available and gpu_arch.SM120_PROXY_ENV in why["flashmla_split"]
    assert gpu_arch.policy_arch() == (12, 0)
    assert flashinfer_backend() == "fa2"
    assert choose_strategy(gpu_arch.policy_arch(), VerifyShape(16, 65, 1), available, SM12X) == "flashinfer_split"
