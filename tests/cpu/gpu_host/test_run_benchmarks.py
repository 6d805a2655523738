# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_host/run_benchmarks.sh: every flag a piece passes exists where it goes, the time
budget skips what does not fit, and a run executes its pieces for real (here with a stand-in
``python3`` on PATH that records its arguments), stops one at its limit and says so."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_host" / "run_benchmarks.sh"


def run(*args, path_dir=None, **env):
    clean = dict(os.environ)
    if path_dir is not None:
        clean["PATH"] = f"{path_dir}:{clean['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          env={**clean, **env}, timeout=120)


def listed() -> dict:
    r = run("--list")
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        name, rest = line.split(None, 1)
        out[name] = rest.split(")  ", 1)[1]
    return out


def _target_files(argv: list) -> list:
    """The files whose source must name the flags of one command (a benchmark module, a
    script, and for serve_sweep.sh the sweep that takes the arguments after --)."""
    if argv[:2] == ["python3", "-m"]:
        module = REPO / argv[2].replace(".", "/")
        return [module / "__main__.py" if module.is_dir() else module.with_suffix(".py")]
    if argv[0] == "python3":
        return [REPO / argv[1]]
    if argv[:2] == ["bash", "scripts/learned_pair/serve_sweep.sh"]:
        return [REPO / argv[1], REPO / "benchmarks" / "budget_sweep.py"]
    return [REPO / argv[1]]


def test_every_flag_of_every_piece_is_one_its_program_takes():
    pieces = listed()
    assert {"floors", "steps_qwen3", "steps_v2lite", "steps_sampled", "learned", "steps_v2lite_routes",
            "learned_dflash2", "sampling_check", "tables_mla_proxy", "tables_gqa_proxy", "tables_sm90",
            "sampling_cost", "soak"} <= set(pieces)
    for name, cmd in pieces.items():
        commands = _simple_commands(cmd)
        assert commands, name
        for argv in commands:
            files = _target_files(argv)
            assert all(f.is_file() for f in files), (name, files)
            source = "".join(f.read_text() for f in files)
            for flag in (a for a in argv if a.startswith("--") and a != "--"):
                assert re.search(rf"[\"' ]{re.escape(flag)}[\"' )=]", source), f"{name}: {flag} is not in {files}"


def _simple_commands(cmd: str) -> list:
    """The programs a piece runs: its command split at ``&&``, ``||`` and ``;``, less the
    braces that group them and the ``[ ... ]`` tests between them."""
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, argv = [], []
    for token in [*lexer, ";"]:
        if token in ("&&", "||", ";"):
            argv = [a for a in argv if a not in ("{", "}")]
            if argv and argv[0] != "[":
                out.append(argv)
            argv = []
        else:
            argv.append(token)
    return out


def test_a_dry_run_fills_every_placeholder_and_skips_what_does_not_fit():
    r = run("--dry-run", "--seconds", 1000, "--only", "floors,learned,soak,tables_sm90")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # floors (~60 s), learned (~300 s) and soak (~480 s) fit into 1000 - 20 s, each at most its
    # limit; then 140 s are left, under tables_sm90's ~240 s
    assert lines[0].startswith("floors (300 s): python3 -m benchmarks.sampling_floors")
    assert lines[1].startswith("learned (560 s): bash scripts/learned_pair/serve_sweep.sh --seconds 545 ")
    assert lines[2] == "soak (600 s): bash scripts/gpu_host/run_gpu_tier.sh --only soak --out /tmp/ddtree-out/bench/soak"
    assert lines[3] == "tables_sm90 skipped: 140 s left, ~240 s needed" and len(lines) == 4
    assert not any("{" in line for line in lines)
    date = subprocess.run(["date", "+%Y-%m-%d"], capture_output=True, text=True).stdout.strip()
    assert f"--tag sampling_floors_cpu_{date} --out-dir /tmp/ddtree-out/bench" in lines[0]


def test_the_budget_skips_pieces_once_the_time_is_spent():
    r = run("--dry-run", "--seconds", 400, "--only", "soak,floors,steps_qwen3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "soak skipped: 380 s left, ~480 s needed",
        "floors (300 s): python3 -m benchmarks.sampling_floors --slices 8,16 --tag sampling_floors_cpu_"
        + r.stdout.split("sampling_floors_cpu_")[1].split()[0] + " --out-dir /tmp/ddtree-out/bench",
        "steps_qwen3 (320 s): python3 -m benchmarks.e2e_step --target qwen3-8b --backend flashinfer --configs nospec,dflash,ddtree16 "
        "--ctx 1024,16384 --batch 1,8 --profile-host --deadline-s 305 --tag qwen3_8b_phases_cpu_"
        + r.stdout.split("qwen3_8b_phases_cpu_")[1].split()[0] + " --out-dir /tmp/ddtree-out/bench",
    ]


@pytest.mark.parametrize("args,msg", [
    (["--only", "floors,nope"], "no piece 'nope'; pieces: floors"),
    (["--seconds", "0"], "--seconds takes a whole number"),
    (["--seconds", "ten"], "--seconds takes a whole number"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])  # fmt: skip
def test_bad_arguments_say_what_to_use(args, msg):
    r = run(*args)
    assert r.returncode == 2 and msg in r.stderr and not r.stdout


def test_a_run_executes_its_pieces_logs_them_and_fails_if_one_fails(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python3"
    # the stand-in records its arguments; the sampling-cost benchmark "fails"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\necho ran\n"
                    "case \"$*\" in *verify_sampling_cost*) exit 3 ;; esac\nexit 0\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = run("--only", "floors,sampling_cost", "--seconds", 1000, "--out", out, path_dir=bin_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    assert calls.read_text().splitlines()[0].startswith("-m benchmarks.sampling_floors --slices 8,16 --tag ")
    assert "-m benchmarks.verify_sampling_cost" in calls.read_text().splitlines()[1]
    summary = (out / "benchmarks-summary.txt").read_text().splitlines()
    assert [s.split()[:2] for s in summary] == [["floors", "rc=0"], ["sampling_cost", "rc=3"]]
    assert (out / "floors.log").read_text() == "ran\n"


def test_a_piece_ended_by_its_time_limit_is_named_so(tmp_path):
    """``timeout`` ends a piece with status 124 (137 after its kill); the stand-in exits so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/sh\nexit 124\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = run("--only", "floors", "--seconds", 1000, "--out", out, path_dir=bin_dir)
    assert r.returncode == 1
    assert (out / "benchmarks-summary.txt").read_text().startswith("floors rc=124 ")
    assert "(stopped at its limit)" in (out / "benchmarks-summary.txt").read_text()
