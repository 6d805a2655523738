# SPDX-License-Identifier: Apache-2.0
"""`python -m sglang.cli.ddtree_doctor` on this GPU-less machine, with the real patched sglang."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from sglang.cli import ddtree_doctor as doctor


def test_cli_reports_no_gpu_cleanly():
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", "-m", "sglang.cli.ddtree_doctor"],
        capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert proc.stdout.startswith("NO GPU VISIBLE:"), out
    assert "--gpus all" in proc.stdout
    assert "patch stamp" in proc.stdout and "Traceback" not in out


@pytest.fixture(scope="module")
def report_120():
    return doctor.collect((12, 0))


def test_no_gpu_is_detected(report_120):
    assert report_120["gpu_visible"] is False
    assert report_120["nvml"]["ok"] is False
    assert report_120["torch_cuda"]["available"] is False
    assert doctor.NO_GPU_HELP in report_120["problems"]


def test_sm120_verdicts_come_from_the_arch_helpers(report_120):
    arch = report_120["verdicts"]["12.0"]["arch"]
    assert arch["arch"] == "sm_120"
    assert arch["is_sm120"] is True and arch["is_sm12x"] is True and arch["is_sm121"] is False
    assert arch["is_datacenter_blackwell"] is False and arch["has_tcgen05"] is False
    assert arch["max_shared_memory_per_block"] == 101376


@pytest.mark.parametrize("cap,true_preds", [
    ((12, 1), {"is_sm121", "is_sm12x"}),
    ((9, 0), {"is_hopper", "has_wgmma"}),
    ((10, 0), {"is_datacenter_blackwell", "is_sm100", "has_tcgen05"}),
])
def test_verdicts_for_other_gpus(cap, true_preds):
    arch = doctor.arch_verdicts(cap)
    assert {p for p in doctor.ARCH_PREDICATES if arch.get(p) is True} == true_preds


def test_backends_come_from_the_startup_gating_table(report_120):
    from sglang.srt.layers.attention import backend_support as bs

    backends = report_120["verdicts"]["12.0"]["backends"]
    assert backends["mla default"] == bs.default_backend((12, 0), "mla") == "triton"
    assert backends["mha default"] == bs.default_backend((12, 0), "mha")
    assert backends["mla prefill"] == ", ".join(bs.backends_for((12, 0), "mla", "prefill"))
    assert "fa3" not in backends["mha prefill"].split(", ")
    assert "triton" in backends["mla DDTree tree verify"].split(", ")


def test_ungated_gpus_say_so():
    assert "not gated" in doctor.backend_verdicts((9, 0))["gating"]


REPO = pathlib.Path(__file__).resolve().parents[3]


def test_stamp_matches_the_repo_series(report_120, monkeypatch):
    """`make test` applied this repo's series: the doctor must see exactly that digest, computed
    by its own code, and the venv's files must be the ones the apply tool wrote."""
    from patchkit.series import load_series

    monkeypatch.setattr(doctor, "SERIES_SRC", str(REPO))
    series = doctor.probe_series()
    assert series["ok"], series
    assert series["shipped_digest"] == series["digest"]
    assert series["upstream_version"] == "0.5.17"
    assert series["changed_files"] == []
    for mode in ("copy", "link"):
        assert doctor.series_digest(REPO, mode) == load_series(REPO / "patches", REPO / "sglang").digest(mode)


def _source_copy(dst: pathlib.Path) -> pathlib.Path:
    """What the image ships in /opt/ddtree/src, without the repository's scripts."""
    shutil.copytree(REPO / "patches", dst / "patches")
    shutil.copytree(REPO / "sglang", dst / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "upstream.lock", dst / "upstream.lock")
    return dst


def test_a_changed_series_is_reported(tmp_path, monkeypatch):
    src = _source_copy(tmp_path / "src")
    doc = src / "sglang" / "cli" / "ddtree_doctor.py"
    doc.write_text(doc.read_text() + "\n# edited after the image was built\n")
    monkeypatch.setattr(doctor, "SERIES_SRC", str(src))
    series = doctor.probe_series()
    assert series["ok"] is False
    assert "differs from the series" in series["error"]


def test_the_doctor_needs_no_repository_scripts(tmp_path):
    """In a fresh interpreter, against a shipped source without scripts/: the digest is computed
    and nothing from the repository's patch tools is imported."""
    src = _source_copy(tmp_path / "src")
    code = ("import json, sys\nfrom sglang.cli import ddtree_doctor as d\ns = d.probe_series()\n"
            "print(json.dumps({'series': s, 'patchkit': any(m.startswith('patchkit') for m in sys.modules)}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**env, "DDTREE_SRC": str(src)})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["patchkit"] is False
    assert got["series"]["ok"], got
    assert got["series"]["shipped_digest"] == got["series"]["digest"]


def test_files_changed_after_applying_are_reported(tmp_path, monkeypatch):
    """The real series applied to a copy of the pristine tree, then one patched file and one
    overlay file edited: the doctor names both."""
    from patchkit import apply_cli
    from patchkit.series import read_lock

    pristine = REPO / ".cache" / "upstream" / f"sglang-{read_lock()['version']}"
    root = tmp_path / "site"
    shutil.copytree(pristine / "sglang", root / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert apply_cli.main(["--target", str(root), "--quiet"]) == 0
    monkeypatch.setattr(doctor, "SERIES_SRC", str(tmp_path / "none"))
    assert doctor.probe_series(root / "sglang")["ok"]
    for rel in ("sglang/srt/server_args.py", "sglang/srt/speculative/ddtree/flags.py"):
        text = (root / rel).read_text()
        (root / rel).unlink()
        (root / rel).write_text(text + "# edited\n")
    series = doctor.probe_series(root / "sglang")
    assert series["ok"] is False
    assert sorted(series["changed_files"]) == ["sglang/srt/server_args.py", "sglang/srt/speculative/ddtree/flags.py"]
    assert "2 file(s) differ from what the series wrote" in series["error"]


def test_render_and_json_roundtrip(report_120):
    text = doctor.render(report_120)
    assert text.startswith("NO GPU VISIBLE")
    assert "verdicts for compute capability 12.0 (sm_120)" in text
    assert json.loads(json.dumps(report_120, default=str))["verdicts"]["12.0"]["arch"]["is_sm120"]


def test_build_record_and_image_arch(tmp_path, monkeypatch):
    build = tmp_path / "build.json"
    build.write_text(json.dumps({"gpu_arch": "12.0,12.1", "series_digest": "x" * 64,
                                 "upstream_version": "0.5.17", "dropped": ["sgl_kernel/sm90/"]}))
    monkeypatch.setattr(doctor, "BUILD_INFO", str(build))
    report = doctor.collect((9, 0))
    assert report["verdicts"]["9.0"]["in_image_gpu_arch"] is False
    assert any("differs from the image's recorded series" in p for p in report["problems"])
    assert "left out: sgl_kernel/sm90/" in doctor.render(report)


def test_without_a_gpu_the_images_targets_are_judged(tmp_path, monkeypatch):
    build = tmp_path / "build.json"
    build.write_text(json.dumps({"gpu_arch": "12.0,12.1", "upstream_version": "0.5.17"}))
    monkeypatch.setattr(doctor, "BUILD_INFO", str(build))
    report = doctor.collect(None)
    assert sorted(report["verdicts"]) == ["12.0", "12.1"]
    assert report["verdicts"]["12.1"]["arch"]["is_sm121"] is True
    assert not report["verdicts"]["12.0"]["visible"]
    assert "verdicts for compute capability 12.1 (sm_121), a GPU not visible here:" in doctor.render(report)
