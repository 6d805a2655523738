# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_host/run_gpu_tier.sh: the GPU tier's pieces cover every test directory and e2e
configuration, run at most --jobs at a time with the tensor-parallel piece alone after them,
and a run in which nothing ran is a failure. Run here for real, on a machine without a GPU,
where every GPU test module skips itself."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_host" / "run_gpu_tier.sh"
GPU_DIRS = sorted(p.name for p in (REPO / "tests" / "gpu").iterdir() if p.is_dir() and p.name != "__pycache__")


def tier(*args, **env):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("DDTREE_E2E_", "CUDA_VISIBLE", "DDTREE_GPU_HOST")) and k != "OUT"}
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          env={**clean, **env}, timeout=600)


def pieces(*args, **env) -> list[tuple[str, str, str, str]]:
    r = tier("--list", *args, **env)
    assert r.returncode == 0, r.stderr
    return [tuple(line.split("|")) for line in r.stdout.splitlines()]


def e2e_configs() -> list[str]:
    """The keys of CONFIGS in tests/gpu/e2e/test_server_e2e.py, read without importing it."""
    tree = ast.parse((REPO / "tests" / "gpu" / "e2e" / "test_server_e2e.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CONFIGS" for t in node.targets):
            return [k.value for k in node.value.keys]
    raise AssertionError("no CONFIGS in test_server_e2e.py")


def test_pieces_cover_every_dir_and_e2e_configuration_once():
    ps = pieces()
    assert sorted({d for _, d, _, _ in ps}) == GPU_DIRS
    shared = [c for name, d, env, _ in ps if d == "e2e" for c in env.split("=", 1)[1].split(",")]
    assert sorted(shared) == sorted(e2e_configs())
    for name, d, env, mode in ps:
        if d == "e2e":
            configs = env.split("=", 1)[1].split(",")
            assert len(configs) >= 2, name  # the cross-configuration check needs two
            assert (mode == "all-gpus") == any("tp2" in c for c in configs), name
        else:
            assert env == "", name
            # servers at the default memory flags size their pools from the whole GPU; the soak
            # times itself under load
            assert mode == ("alone" if d in ("serving_defaults", "soak") else ""), name


def test_caller_selection_makes_one_piece():
    assert pieces("--only", "e2e,ddtree", DDTREE_E2E_CONFIGS="triton-nospec", DDTREE_E2E_SERVERS="ddtree") == [
        ("e2e", "e2e", "", ""), ("ddtree", "ddtree", "", "")]
    assert pieces("--only", "e2e", DDTREE_E2E_CONFIGS="triton-nospec,triton-dflash-tp2") == [
        ("e2e", "e2e", "", "all-gpus")]
    assert pieces("--only", "ddtree", DDTREE_E2E_SERVERS="ddtree", DDTREE_E2E_EXTRA_ARGS="--tp-size 2") == [
        ("ddtree", "ddtree", "", "all-gpus")]


@pytest.mark.parametrize("args,error", [
    (["--jobs", "0"], "--jobs takes a positive whole number"),
    (["--jobs", "x"], "--jobs takes a positive whole number"),
    (["--dir-timeout", "soon"], "--dir-timeout takes seconds"),
    (["--only", "e2e,nope"], "no tests/gpu/nope"),
])
def test_bad_arguments_are_refused(args, error):
    r = tier(*args)
    assert r.returncode == 2 and error in r.stderr


def test_a_run_where_nothing_ran_fails(tmp_path):
    """Without a GPU every piece collects nothing or skips everything, and the tier fails. Three at a
    time at most, and the pieces that need the GPUs alone (tensor parallel, servers at the default
    memory flags) only after every other piece has finished, one at a time. Run as if it were not
    the GPU host (DDTREE_GPU_HOST=0: skips stay skips) with two GPUs named; the logs go to the
    OUT environment variable's folder when --out is not given."""
    out = tmp_path / "out"
    r = tier("--jobs", "3", PYTHON=sys.executable, OUT=str(out), DDTREE_GPU_LOG_ROOT=str(tmp_path / "logs"),
             DDTREE_TEST_MODELS=str(tmp_path / "models"), DDTREE_GPU_HOST="0", CUDA_VISIBLE_DEVICES="0,1")
    assert r.returncode == 1, r.stdout + r.stderr
    names = [p[0] for p in pieces()]
    summary = (out / "gpu-tier-summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == names
    assert all("passed=0" in line for line in summary)
    assert "e2e-triton               rc=5(nothing collected)" in summary[names.index("e2e-triton")]
    for name in names:
        assert (out / f"{name}-pytest.log").read_text().startswith("env ")
    assert (tmp_path / "models" / "manifest.json").is_file()  # server pieces need the test models

    alone = [p[0] for p in pieces() if p[3] in ("all-gpus", "alone")]
    assert alone == ["e2e-tp2", "serving_defaults", "soak"]
    running, most, finished = 0, 0, []
    events = r.stdout.split("--- summary")[0].splitlines()
    for line in events:
        if line.startswith("--- start "):
            name = line.split()[2]
            if name in alone:
                assert running == 0, name
                assert set(n for n in names if n not in alone) <= set(finished), name
            running += 1
            most = max(most, running)
        elif line.startswith("gpu-tier "):
            running -= 1
            finished.append(line.split()[1])
    assert most == 3 and running == 0 and sorted(finished) == sorted(names)


def test_a_run_where_everything_skipped_fails(tmp_path):
    r = tier("--only", "arch_gating", "--out", tmp_path, PYTHON=sys.executable, DDTREE_GPU_HOST="0")
    assert r.returncode == 5 and "no test passed" in r.stdout, r.stdout + r.stderr
    assert "no test passed" in (tmp_path / "gpu-tier-summary.txt").read_text()


def test_on_the_gpu_host_a_skip_is_a_failure(tmp_path):
    """env.sh marks the host (DDTREE_GPU_HOST=1): the arch-gating tests, which skip elsewhere for
    want of a GPU, fail instead, and the log says why. --out wins over the OUT variable."""
    r = tier("--only", "arch_gating", f"--out={tmp_path}", PYTHON=sys.executable, OUT=str(tmp_path / "env-out"))
    assert not (tmp_path / "env-out").exists() and f"logs in {tmp_path}" in r.stdout
    assert r.returncode == 1, r.stdout + r.stderr
    line = (tmp_path / "gpu-tier-summary.txt").read_text()
    assert "rc=1(failed)" in line and "skipped=0" in line and "passed=0" in line
    log = (tmp_path / "arch_gating-pytest.log").read_text()
    assert "DDTREE_GPU_HOST=1 and this cannot run: needs a CUDA GPU" in log


def test_the_tensor_parallel_piece_is_left_out_with_one_gpu(tmp_path):
    r = tier("--only", "e2e", "--jobs", "3", "--out", tmp_path, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="0",
             DDTREE_GPU_HOST="0", DDTREE_GPU_LOG_ROOT=str(tmp_path / "logs"), DDTREE_TEST_MODELS=str(tmp_path / "m"))
    summary = (tmp_path / "gpu-tier-summary.txt").read_text()
    assert "gpu-tier e2e-tp2                  not run: needs 2 GPUs, 1 visible" in summary, summary
    assert "--- start e2e-tp2" not in r.stdout and not (tmp_path / "e2e-tp2-pytest.log").exists()
    assert sorted(line.split()[1] for line in summary.splitlines()) == ["e2e-flashinfer", "e2e-qwen3", "e2e-tp2",
                                                                         "e2e-triton"]


@pytest.mark.parametrize("piece", ["serving_defaults", "soak"])
def test_the_whole_gpu_piece_runs_with_one_gpu(tmp_path, piece):
    """serving_defaults and soak need one GPU to themselves, not two: on a one-GPU host they run (alone)."""
    r = tier("--only", piece, "--out", tmp_path, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="0",
             DDTREE_GPU_HOST="0", DDTREE_GPU_LOG_ROOT=str(tmp_path / "logs"), DDTREE_TEST_MODELS=str(tmp_path / "m"))
    summary = (tmp_path / "gpu-tier-summary.txt").read_text()
    assert "not run" not in summary, summary
    assert f"--- start {piece} (tests/gpu/{piece}, every GPU, alone)" in r.stdout, r.stdout
    assert (tmp_path / f"{piece}-pytest.log").exists()



def test_env_sh_puts_the_installed_stacks_scripts_on_path_once(tmp_path):
    """py-spy and the other console scripts of the installed wheel set run by name (the budget
    sweep's host profiles look py-spy up on PATH), after the image's own, and sourcing twice
    adds nothing."""
    env_sh = REPO / "scripts" / "gpu_host" / "env.sh"
    r = subprocess.run(["bash", "-c", f'source "{env_sh}"; source "{env_sh}"; echo "$PATH"'], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "DDTREE_SITE": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split(":") == ["/usr/bin", "/bin", f"{tmp_path}/bin"]
