# SPDX-License-Identifier: Apache-2.0
"""benchmarks/moe_default_tiles.py on the CPU: the configs each rule picks (real patched
upstream function), the report, and its refusals. The timing itself runs on the GPU host."""

import pytest

from benchmarks import moe_default_tiles as bench


@pytest.fixture(scope="module", autouse=True)
def published():
    bench.publish_minimal_server_args()


def test_rules_differ_exactly_on_tree_verify_batches_above_the_expert_count():
    lite = bench.SHAPES["deepseek-v2-lite"]
    differ = [m for m in bench.TOKENS
              if bench.config_for(lite, m, "upstream") != bench.config_for(lite, m, "rows_per_expert")]
    assert differ == [65, 96, 128, 130, 136, 160]


def test_the_rule_in_force_is_restored():
    before = bench.default_row_tile.TILE_RULE
    bench.config_for(bench.SHAPES["qwen3-30b-a3b"], 200, "upstream")
    assert bench.default_row_tile.TILE_RULE == before


def test_markdown_and_plot(tmp_path):
    rows = []
    for m, (up, ours) in {65: (0.40, 0.28), 520: (0.9, 0.9)}.items():
        row = dict(shape="deepseek-v2-lite", tokens=m, what=bench.NAMED[m], expert_rows=7,
                   experts_touched=64)
        for rule, ms in (("upstream", up), ("rows_per_expert", ours)):
            row[rule] = dict(ms=ms, block_m=16, roofline=0.5)
        row["speedup"] = up / ours
        rows.append(row)
    md = bench.markdown(rows)
    assert "| deepseek-v2-lite | 65 | B=64 bs1 | 7 | 0.400 (16) | 0.280 (16) | 1.43x | 0.50 |" in md
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, msg", [(["--shapes", "llama"], "unknown shape"),
                                       (["--tokens", "0,16"], "positive integers")])
def test_bad_arguments_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
