# SPDX-License-Identifier: Apache-2.0
"""benchmarks/sampling_floors.py on the CPU (Triton interpreted): its ways to the floors (the
search in one program per row and split over several, the sorts) agree, rows the candidates
leave undecided are really exercised, and a table is written."""

import json

from benchmarks import sampling_floors as bench


def test_the_paths_agree_and_the_search_is_exercised():
    row = bench.measure(rows=6, vocab=4096, setting="top_p=0.95", slices=(2,))
    assert row["undecided_rows"] == 3  # the flat half
    assert row["slices"] == 1  # 4 tiles of 1,024: one slice, as search_single
    for name in ("search", "search_single", "search_s2", "sort_undecided"):
        assert row[f"{name}_rows_differ"] == 0, name
        assert row[f"{name}_rows_at_cut"] == 0, name  # the interpreter sums alike
    assert "search_ms" not in row  # no timings without CUDA


def test_bounded_rows_skip_the_search():
    row = bench.measure(rows=4, vocab=3000, setting="top_k=20,top_p=0.8")
    assert row["candidates"] == 20 and row["undecided_rows"] == 0
    assert row["search_rows_differ"] == row["search_rows_at_cut"] == 0


def test_cli_writes_the_table_and_refuses_unknown_settings(tmp_path, capsys):
    assert bench.main(["--vocab", "2048", "--rows", "4", "--settings", "min_p=0.01",
                       "--tag", "t", "--out-dir", str(tmp_path)]) == 0  # fmt: skip
    result = json.loads((tmp_path / "t.json").read_text())
    assert [r["setting"] for r in result["rows"]] == ["min_p=0.01"]
    try:
        bench.main(["--settings", "top_p=0.5", "--out-dir", str(tmp_path)])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("an unknown setting was accepted")
    assert "unknown settings" in capsys.readouterr().err
