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
