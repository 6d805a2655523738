# SPDX-License-Identifier: Apache-2.0
"""The image's build inputs: scripts parse and explain themselves, the Dockerfile and the
.dockerignore agree on what the build context must hold, and the build fails loudly."""

import fnmatch
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = ["scripts/build_wheelhouse.sh", "scripts/make_base_image.sh", "scripts/test_image.sh"]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_has_help(script):
    assert subprocess.run(["bash", "-n", REPO / script]).returncode == 0
    proc = subprocess.run(["bash", REPO / script, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Usage:" in proc.stdout, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_rejects_unknown_arguments(script):
    proc = subprocess.run(["bash", REPO / script, "--no-such-option"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "unknown argument '--no-such-option'" in proc.stderr


def test_wheelhouse_needs_an_output_dir():
    proc = subprocess.run(["bash", REPO / "scripts/build_wheelhouse.sh"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--out DIR is required" in proc.stderr


def _dockerignore_includes(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches a file's parents."""
    included = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:] if negate else line
        parts = rel.split("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(c, pat) for c in candidates)
        if hit:
            included = negate
    return included


def test_build_context_holds_what_the_dockerfile_copies():
    used = set(re.findall(r"/ctx/([\w./-]+)", DOCKERFILE))
    used |= {"upstream.lock", "constraints/dev.txt", "docker/wheelhouse.py"}  # read by build_wheelhouse.sh
    assert used, "the Dockerfile copies nothing from the context?"
    for rel in sorted(used):
        assert (REPO / rel).exists(), f"Dockerfile needs {rel}, which is not in the repo"
        assert _dockerignore_includes(rel), f".dockerignore keeps {rel} out of the build context"
    for rel in [".venv/bin/python", ".cache/upstream", "tests/cpu/conftest.py", "docker/Dockerfile"]:
        assert not _dockerignore_includes(rel), f"{rel} should stay out of the build context"


def test_overlay_and_patches_reach_the_context():
    for f in list((REPO / "sglang").rglob("*.py"))[:50] + list((REPO / "patches").glob("*")):
        rel = f.relative_to(REPO).as_posix()
        assert _dockerignore_includes(rel), rel


def test_series_is_applied_in_the_failing_install_step():
    run = DOCKERFILE[DOCKERFILE.index("FROM base AS runtime"):]
    step = run[run.index("RUN "):run.index("\nENV ")]
    assert "set -eu;" in step, "a failing command must fail the build"
    assert "apply_patches.sh --python /opt/venv/bin/python" in step
    assert "finish_build.py" in step and "--expect-digest" in step
    assert "--require-hashes" in step and "--no-index" in step
    apply = step.index("bash /opt/ddtree/src/scripts/apply_patches.sh")
    assert step.index("pip install") < apply < step.index("finish_build.py --src")


def test_image_metadata_is_declared():
    assert re.search(r"^EXPOSE 30000$", DOCKERFILE, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*entrypoint.py\", \"healthcheck\"", DOCKERFILE, re.M)
    assert 'ENTRYPOINT ["/opt/venv/bin/python", "/opt/ddtree/entrypoint.py"]' in DOCKERFILE
    for label in ("ddtree.upstream.version", "ddtree.series.digest", "org.opencontainers.image.revision"):
        assert label in DOCKERFILE
    # The shipped base is the one scripts/test_image.sh builds and tests (docs/docker.md, "Which base").
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", DOCKERFILE, re.M)
    assert "bookworm" in (REPO / "scripts" / "make_base_image.sh").read_text()
    assert 'NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in DOCKERFILE


def test_nothing_writes_a_layer_after_the_install():
    """On storage drivers without copy-on-write every later layer would copy the ~9 GB tree."""
    run = DOCKERFILE[DOCKERFILE.index("FROM base AS runtime"):]
    after = run[run.index("\nENV ", run.index("RUN ")):]
    instructions = re.findall(r"^([A-Z]+)\s", after, re.M)
    assert instructions and set(instructions) <= {"ENV", "LABEL", "EXPOSE", "HEALTHCHECK",
                                                   "ENTRYPOINT", "CMD", "ARG"}, instructions


def test_the_toolkit_tree_is_built_and_checked_in_the_install_step():
    run = DOCKERFILE[DOCKERFILE.index("FROM base AS runtime"):]
    step = run[run.index("RUN "):run.index("\nENV ")]
    assert "cuda_home.py build --out /opt/cuda" in step  # build runs the nvcc/header check
    assert step.index("finish_build.py --src") < step.index("cuda_home.py build")
    for f in ("cuda_home.py", "compile_kernels.py", "jit_modules.json"):
        assert f"/ctx/docker/{f}" in step, f


def test_the_image_test_compiles_the_kernel_list_in_the_image():
    text = (REPO / "scripts" / "test_image.sh").read_text()
    assert "python /opt/ddtree/compile_kernels.py" in text
    assert '"^[0-9]+ passed, 0 failed"' in text
    make = (REPO / "Makefile").read_text()
    assert "ddtree-sglang:sm120-test" in make and "TAG=ddtree-sglang:sm120-test" in text


def test_readme_and_docs_build_line_agree():
    """The documented build passes the series digest (the build then checks it)."""
    docs = (REPO / "docs" / "docker.md").read_text()
    assert "--build-arg SERIES_DIGEST=$(python3 docker/wheelhouse.py series-digest) ." in docs
    assert "--build-arg SERIES_DIGEST=$(python3 docker/wheelhouse.py series-digest) ." in DOCKERFILE
