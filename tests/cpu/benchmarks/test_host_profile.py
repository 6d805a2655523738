# SPDX-License-Identifier: Apache-2.0
"""benchmarks/host_profile.py: a py-spy speedscope profile shared out below one function, on a
constructed profile whose shares are known and on a real scheduler profile of the learned pair."""

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import host_profile as hp

REPO = Path(__file__).resolve().parents[3]
REAL = REPO / "benchmarks" / "results" / "hostprof_learned_sampling_h200_2026-12-03_ddtree16.json.gz"


def speedscope(path: Path, frames, threads) -> Path:
    """frames: (name, file, line); threads: [[(stack of frame indices, weight), ...], ...]."""
    data = {
        "shared": {"frames": [{"name": n, "file": f, "line": ln} for n, f, ln in frames]},
        "profiles": [{"type": "sampled", "samples": [s for s, _ in t], "weights": [w for _, w in t]}
                     for t in threads] + [{"type": "evented", "events": []}],
    }
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(data, f)
    return path


FRAMES = [
    ("Scheduler.loop", "/x/scheduler.py", 10),  # 0
    ("Worker.forward_batch_generation", "/x/worker.py", 5),  # 1
    ("Worker.draft", "/x/worker.py", 20),  # 2
    ("Worker.draft", "/x/worker.py", 21),  # 3: another line of the same function
    ("Runner.replay", "/x/runner.py", 7),  # 4
    ("commit", "/x/step_io.py", 3),  # 5
    ("Scheduler.idle", "/x/scheduler.py", 30),  # 6
    ("JITFunction._do_compile", "/x/jit.py", 849),  # 7
]


@pytest.fixture
def constructed(tmp_path):
    return speedscope(tmp_path / "p.json.gz", FRAMES, [
        [((0, 1, 2, 4), 2.0), ((0, 1, 3), 1.0), ((0, 1, 5), 1.0)],
        [((0, 6), 4.0)],  # another thread, outside the root
    ])


def test_shares_below_the_root_are_the_constructed_ones(constructed):
    s = hp.summarize(hp.load(constructed), "forward_batch_generation", depth=3, min_share=0.0)
    assert s["samples_inside"] == 4.0 and s["share_of_all_samples"] == 0.5
    tree = {tuple(r["path"]): r["share"] for r in s["tree"]}
    draft, replay, commit = "Worker.draft (worker.py)", "Runner.replay (runner.py)", "commit (step_io.py)"
    assert tree == {(draft,): 0.75, (draft, replay): 0.5, (commit,): 0.25}  # the two lines of draft merged
    assert [r["path"] for r in s["tree"]] == [[draft], [draft, replay], [commit]]  # depth first, largest first
    assert {x["function"]: x["share"] for x in s["self"]} == {replay: 0.5, draft: 0.25, commit: 0.25}


def test_own_code_by_line_and_compiles_left_out(tmp_path, constructed):
    s = hp.summarize(hp.load(constructed), min_share=0.0)
    assert {x["line"]: x["share"] for x in s["lines"]} == {
        "Runner.replay (runner.py:7)": 0.5, "Worker.draft (worker.py:21)": 0.25, "commit (step_io.py:3)": 0.25}
    assert s["compile_share"] is None
    with_compile = speedscope(tmp_path / "c.json", FRAMES, [[((0, 1, 2, 4), 2.0), ((0, 1, 5, 7), 2.0)]])
    kept = hp.summarize(hp.load(with_compile), min_share=0.0, skip_compiles=True)
    assert kept["compile_share"] == 0.5 and kept["samples_inside"] == 2.0
    assert {tuple(r["path"]) for r in kept["tree"]} == {("Worker.draft (worker.py)",),
                                                        ("Worker.draft (worker.py)", "Runner.replay (runner.py)")}
    assert hp.summarize(hp.load(with_compile), min_share=0.0)["samples_inside"] == 4.0


def test_depth_min_share_and_the_root_by_class_or_file(constructed):
    samples = hp.load(constructed)
    for root in ("Worker.forward_batch_generation", "Worker.forward_batch_generation (worker.py)"):
        assert hp.summarize(samples, root)["samples_inside"] == 4.0
    shallow = hp.summarize(samples, depth=1, min_share=0.3)
    assert [r["path"] for r in shallow["tree"]] == [["Worker.draft (worker.py)"]]
    whole = hp.summarize(samples, "Scheduler.loop", depth=1, min_share=0.0)
    assert whole["share_of_all_samples"] == 1.0
    assert {r["path"][0]: r["share"] for r in whole["tree"]} == {
        "Worker.forward_batch_generation (worker.py)": 0.5, "Scheduler.idle (scheduler.py)": 0.5}


def test_a_root_never_sampled_or_a_file_that_is_not_a_profile_is_refused(constructed, tmp_path, capsys):
    with pytest.raises(ValueError, match="no sample runs inside 'Worker.verify'"):
        hp.summarize(hp.load(constructed), "Worker.verify")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"profiles": []}))
    with pytest.raises(SystemExit):
        hp.main([str(bad), "--out-dir", str(tmp_path)])
    assert "not a speedscope file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hp.main([str(constructed), "--depth", "0", "--out-dir", str(tmp_path)])


def test_a_real_scheduler_profile(tmp_path):
    """The learned pair's DDTREE B=16 server of 2026-12-03 under py-spy: the verify's graph
    inputs sit below the worker's verify, and the run writes its JSON and plot."""
    assert hp.main([str(REAL), "--tag", "real", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "host_profile_real.json").read_text())
    (prof,) = result["profiles"]
    assert 0 < prof["share_of_all_samples"] < 1
    top = {r["path"][0]: r["share"] for r in prof["tree"] if len(r["path"]) == 1}
    assert "DDTreeWorker._verify (worker.py)" in top and sum(top.values()) <= 1.0
    assert any(r["path"][:2] == ["DDTreeWorker._verify (worker.py)", "DFlashVerifyInput.prepare_for_verify (dflash_info.py)"]
               for r in prof["tree"])
    assert 0 < sum(s["share"] for s in prof["self"]) <= 1.0
    assert (tmp_path / "host_profile_real.png").stat().st_size > 0
