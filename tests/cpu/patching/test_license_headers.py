# SPDX-License-Identifier: Apache-2.0
"""Every source file of the overlay, the scripts, benchmarks, tests and the image carries the
Apache-2.0 SPDX line (after a shebang), as upstream SGLang's license asks of derived files."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HEADER = "# SPDX-License-Identifier: Apache-2.0"


def _sources() -> list:
    out = subprocess.run(["git", "ls-files", "sglang", "scripts", "benchmarks", "tests", "docker", ".ci"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    return [f for f in out if f.endswith((".py", ".sh")) or f == ".ci/run"]


def test_every_source_file_has_the_spdx_line():
    files = _sources()
    assert len(files) > 150  # the listing found the tree
    missing = []
    for f in files:
        lines = (REPO / f).read_text(encoding="utf-8").splitlines()
        head = lines[1:2] if lines[:1] and lines[0].startswith("#!") else lines[:1]
        if head != [HEADER]:
            missing.append(f)
    assert not missing, f"{len(missing)} files lack '{HEADER}' on their first line (after a shebang): {missing[:20]}"
