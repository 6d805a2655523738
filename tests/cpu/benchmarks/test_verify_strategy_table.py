# SPDX-License-Identifier: Apache-2.0
"""The pure parts of benchmarks/verify_strategy_table.py: the table section a run writes
(read back by the real policy), merging it into a table, and the policy's choices."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
from benchmarks import verify_strategy_table as vst

META = {"date": "2026-12-02", "gpu": "NVIDIA H200", "sms": 132, "capability": [9, 0], "torch": "2.11.0",
        "triton": "3.6.0", "flashinfer": "0.6.15", "sm120_proxy": True}  # fmt: skip
ROWS = [
    {"H": 16, "N": 65, "P": 1024, "bs": 1, "ms": {"fused": 0.05, "flashinfer_split": 0.07}},
    {"H": 16, "N": 65, "P": 16384, "bs": 1, "ms": {"fused": 0.41, "flashinfer_split": 0.21}},
    {"H": 16, "N": 65, "P": 16384, "bs": 8, "ms": {"fused": 1.9, "flashinfer_split": 2.2}},
    {"H": 16, "N": 4, "P": 65536, "bs": 1, "ms": {}, "errors": {"fused": "boom"}},
]


def test_the_section_is_a_table_the_policy_reads():
    from sglang.srt.layers.attention.tree_verify.policy import StrategyTable, VerifyShape, choose_strategy

    section = vst.section_from_rows(ROWS, "sm12x", META, "python3 benchmarks/verify_strategy_table.py --sm120-proxy")
    assert section["proxy"] is True and len(section["rows"]) == 3  # the failed shape has no timing
    assert "NVIDIA H200" in section["hardware"] and "flashinfer 0.6.15" in section["hardware"]
    table = StrategyTable.from_json({"sections": [section]})
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), {"fused", "flashinfer_split"}, table) == "flashinfer_split"


def test_a_section_replaces_the_same_familys_only():
    old = {"what": "w", "sections": [{"arch": "sm12x", "proxy": True, "rows": [1]},
                                     {"arch": "sm90", "proxy": False, "rows": [2]}]}  # fmt: skip
    new = vst.section_from_rows(ROWS, "sm12x", META, "c")
    merged = vst.merge_section(old, new)
    assert merged["what"] == "w" and [s["arch"] for s in merged["sections"]] == ["sm90", "sm12x"]
    assert merged["sections"][1] is new


def test_the_shipped_table_takes_a_section(tmp_path):
    shipped = json.loads(vst.SHIPPED_TABLE.read_text())
    merged = vst.merge_section(shipped, vst.section_from_rows(ROWS, "sm12x", META, "c"))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(merged))
    from sglang.srt.layers.attention.tree_verify.policy import StrategyTable

    assert StrategyTable.from_json(json.loads(path.read_text())).rows_for("sm12x", "mla")


def test_policy_choices_against_the_fused_kernel():
    got = {(c["P"], c["bs"]): c for c in vst.apply_policy(ROWS, "sm12x", (12, 0))}
    short = got[(1024, 1)]  # one choice per batch size: the long prefix decides
    assert short["chosen"] == "flashinfer_split" and short["fastest"] == "fused"
    assert short["chosen_over_fused"] == pytest.approx(0.07 / 0.05)
    assert got[(16384, 1)]["chosen_over_fused"] == pytest.approx(0.21 / 0.41)
    assert got[(16384, 8)]["chosen"] == "fused"
    assert (65536, 1) not in got


def test_bad_arguments_fail_before_any_gpu_work(tmp_path):
    with pytest.raises(SystemExit):
        vst.main(["--strategies", "fused,upstream_extend", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        vst.main(["--shapes", "16:65:16384", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        vst.main(["--deadline-s", "0", "--out-dir", str(tmp_path)])


def test_a_passed_deadline_measures_no_shape_and_returns_them_all(monkeypatch):
    """A run cut short keeps the shapes it did not reach (listed as 'unmeasured'), so its
    section holds only what it measured; past the deadline no shape's inputs are made."""
    import time

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the script imports its neighbours by name
    shapes = [vst.mla_shape(16, 65, 16384, 1), vst.mla_shape(128, 65, 65536, 8)]
    rows, unmeasured = vst.measure(shapes, ["fused"], proxy=True, deadline=time.monotonic() - 1)
    assert rows == [] and unmeasured == shapes


GQA_ROWS = [
    {"kind": "mha", "H": 32, "Hkv": 8, "D": 128, "N": 65, "P": 1024, "bs": 1,
     "ms": {"fused": 0.05, "flashinfer_split": 0.06}},
    {"kind": "mha", "H": 32, "Hkv": 8, "D": 128, "N": 65, "P": 65536, "bs": 1,
     "ms": {"fused": 0.90, "flashinfer_split": 0.40}},
    {"kind": "mha", "H": 32, "Hkv": 8, "D": 64, "N": 65, "P": 65536, "bs": 1,
     "ms": {"fused": 0.30, "flashinfer_split": 0.45}},
]  # fmt: skip


def test_gqa_rows_keep_their_layout_and_the_mla_section():
    """A GQA run's section carries each row's layout; merged beside the same family's MLA
    section (not over it), both are read: MLA shapes from the one, GQA shapes by layout."""
    from sglang.srt.layers.attention.tree_verify.policy import StrategyTable, VerifyShape, choose_strategy

    gqa = vst.section_from_rows(GQA_ROWS, "sm12x", META, "c --attn gqa")
    assert [(r["kind"], r["Hkv"], r["D"]) for r in gqa["rows"]] == [("mha", 8, 128), ("mha", 8, 128), ("mha", 8, 64)]
    merged = vst.merge_section(vst.merge_section({"sections": []}, vst.section_from_rows(ROWS, "sm12x", META, "c")),
                               gqa)  # fmt: skip
    assert len(merged["sections"]) == 2
    again = vst.merge_section(merged, vst.section_from_rows(GQA_ROWS[:1], "sm12x", META, "c --attn gqa"))
    assert len(again["sections"]) == 2 and len(again["sections"][1]["rows"]) == 1  # a GQA run replaces GQA
    table = StrategyTable.from_json(merged)
    both = {"fused", "flashinfer_split"}
    assert choose_strategy((12, 0), VerifyShape(16, 65, 1), both, table) == "flashinfer_split"
    at = lambda d: choose_strategy((12, 0), VerifyShape(32, 65, 1, kind="mha", kv_heads=8, head_dim=d), both, table)  # noqa: E731
    assert at(128) == "flashinfer_split" and at(64) == "fused"
    got = {(c["D"], c["P"]): c for c in vst.apply_policy(GQA_ROWS, "sm12x", (12, 0))}
    assert got[(128, 65536)]["chosen"] == "flashinfer_split" and got[(64, 65536)]["chosen"] == "fused"
    assert got[(128, 1024)]["kind"] == "mha" and got[(128, 1024)]["Hkv"] == 8


def test_the_gqa_matrix_covers_the_layouts():
    m = vst.gqa_matrix()
    assert {(r["H"], r["Hkv"], r["D"]) for r in m} == {(h, 8, d) for h in (32, 64) for d in (64, 128, 256)}
    assert {r["N"] for r in m} == {17, 65, 129} and {r["bs"] for r in m} == {1, 8}
    assert len({vst.shape_key(r) for r in m}) == len(m)


def test_gqa_shapes_flag_takes_the_layout(tmp_path):
    with pytest.raises(SystemExit):
        vst.main(["--attn", "gqa", "--shapes", "32:65:16384:1", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        vst.main(["--attn", "gqa", "--shapes", "32:0:128:65:16384:1", "--out-dir", str(tmp_path)])


def test_the_xqa_candidate_stays_out_of_the_table(tmp_path):
    """A candidate's time is reported against the policy's choice, and the section the
    policy reads holds only serving strategies (the table loader refuses other names)."""
    rows = [{**GQA_ROWS[1], "candidates_ms": {"xqa": 0.2}}]
    (choice,) = vst.apply_policy(rows, "sm90", (9, 0))
    assert choice["chosen"] == "flashinfer_split"
    assert choice["candidate_over_chosen"] == {"xqa": pytest.approx(0.5)}
    section = vst.section_from_rows(rows, "sm90", META, "cmd")
    assert set(section["rows"][0]["ms"]) == {"fused", "flashinfer_split"}
    with pytest.raises(SystemExit):  # XQA serves MHA/GQA only
        vst.main(["--strategies", "fused,xqa", "--out-dir", str(tmp_path)])


def test_the_shipped_table_meets_the_sm12x_targets():
    """The shipped sm12x MLA section (measured as the proxy) makes the policy choose, at the two
    target shapes, a strategy measured within the target (docs/tree-verify.md); its MHA/GQA
    section sits beside it, and sm90 has its own."""
    from sglang.srt.layers.attention.tree_verify.policy import load_table

    table = load_table()
    assert table.rows_for("sm12x", "mla") and table.rows_for("sm12x", "mha") and table.rows_for("sm90", "mla")
    rows = {vst.shape_key(r): r for r in table.rows_for("sm12x", "mla")}
    policy = {vst.shape_key(c): c for c in vst.apply_policy(list(rows.values()), "sm12x", (12, 0))}
    for (h, n, p, bs), target in vst.SM12X_TARGETS.items():
        chosen = policy[vst.shape_key(vst.mla_shape(h, n, p, bs))]
        assert chosen["chosen"] != "flashmla_split" and chosen["chosen_ms"] <= target, chosen
