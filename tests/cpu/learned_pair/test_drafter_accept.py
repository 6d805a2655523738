# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/drafter_accept.py`` on the toy pair: every drafter is replayed on the same
continuations (a copy of the reference drafter scores exactly ratio 1 at every setting, seed
and budget), the medians are the offline replay's, and bad drafters are refused."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from benchmarks import drafter_accept


@pytest.fixture
def pair_with_copy(toy_pair, tmp_path):
    pair = tmp_path / "pair"
    shutil.copytree(toy_pair[0], pair)
    shutil.copytree(pair / "drafter", pair / "drafter-copy")
    manifest = json.loads((pair / "manifest.json").read_text())
    manifest["drafter_copy"] = {"dir": "drafter-copy", "shape": manifest["shapes"]["drafter"], "init_from": "drafter"}
    (pair / "manifest.json").write_text(json.dumps(manifest))
    return pair


def test_same_drafter_same_accept_and_files(pair_with_copy, tmp_path):
    from scripts.learned_pair import checkpoint, evaluate
    from scripts.learned_pair.tokenizer import MASK_ID

    out = tmp_path / "out"
    argv = [str(pair_with_copy), "--drafters", "drafter,drafter-copy", "--sampling", "1,0.7/20/0.8",
            "--budgets", "1,4", "--seeds", "0,1", "--prompts", "2", "--new-tokens", "24", "--tag", "t",
            "--out-dir", str(out)]
    assert drafter_accept.main(argv) == 0
    result = json.loads((out / "t.json").read_text())
    assert [r["sampling"] for r in result["settings"]] == ["1", "0.7/20/0.8"]
    assert result["drafters"]["drafter-copy"]["init_from"] == "drafter"
    for row in result["settings"]:
        ratios = row["ratio_to_reference"]["drafter-copy"]
        assert set(ratios) == {"dflash", "ddtree1", "ddtree4"}
        assert all(r == 1.0 for c in ratios.values() for r in c["per_seed"])
    target, drafter = checkpoint.load_pair(pair_with_copy)
    prompts = [json.loads(line)["prompt_ids"] for line in (pair_with_copy / "prompts.jsonl").read_text().splitlines()[:2]]
    want = evaluate.offline_accept_sampled(drafter, target, prompts, 24, [1, 4], MASK_ID, 1, evaluate.Sampling(1.0),
                                           scorings=("raw",))  # fmt: skip
    got = result["settings"][0]["accept"]["drafter"]
    assert [got[c]["per_seed"][1] for c in ("dflash", "ddtree4")] == [want["dflash"], want["ddtree4"]]
    assert (out / "t.png").stat().st_size > 0


@pytest.mark.parametrize("drafters, message", [("drafter,drafter-x", "not found: \\['drafter-x'\\]"),
                                               ("drafter,drafter", "each once")])
def test_bad_drafters_are_refused(pair_with_copy, tmp_path, drafters, message, capsys):
    with pytest.raises(SystemExit):
        drafter_accept.main([str(pair_with_copy), "--drafters", drafters, "--tag", "t", "--out-dir", str(tmp_path)])
    assert re.search(message, capsys.readouterr().err)
