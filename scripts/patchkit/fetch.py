# SPDX-License-Identifier: Apache-2.0
"""Download an upstream sglang wheel, check its hash, unpack its pristine tree.

The pinned release is checked against upstream.lock; other releases (bumps) against the
sha256 that PyPI publishes for the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import urllib.request
import zipfile

from .series import REPO, read_lock

PYPI_SIMPLE = "https://pypi.org/simple/{name}/"


class FetchError(RuntimeError):
    pass


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pypi_hashes(name: str) -> dict[str, str]:
    req = urllib.request.Request(
        PYPI_SIMPLE.format(name=name), headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        data = json.load(r)
    return {f["filename"]: f["hashes"]["sha256"] for f in data["files"] if "sha256" in f.get("hashes", {})}


def download_wheel(version: str, dest: pathlib.Path, python: str = sys.executable) -> pathlib.Path:
    """pip-download the sglang wheel that `python` would install."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob(f"sglang-{version}-*.whl"))
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           f"sglang=={version}", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(l for l in proc.stderr.splitlines() if "is ignored" not in l)[-2000:]
        raise FetchError(f"pip could not download sglang=={version}:\n{tail}")
    tag = subprocess.run(
        [python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    wheels = sorted(dest.glob(f"sglang-{version}-{tag}-*.whl")) or sorted(set(dest.glob(f"sglang-{version}-*.whl")) - before)
    if not wheels:
        raise FetchError(f"pip reported success but no sglang-{version} wheel for {tag} is in {dest}")
    return wheels[-1]


def verify(wheel: pathlib.Path, expected: dict[str, str]) -> str:
    want = expected.get(wheel.name)
    if want is None:
        raise FetchError(f"{wheel.name} has no recorded sha256 (known: {', '.join(sorted(expected)) or 'none'})")
    digest = sha256_of(wheel)
    if digest != want:
        raise FetchError(f"{wheel.name}: sha256 {digest} does not match the recorded {want}; refusing to use it")
    return digest


def unpack_sglang(wheel: pathlib.Path, dest_root: pathlib.Path, digest: str) -> pathlib.Path:
    """Unpack only the sglang/ package; reuse an earlier unpack of the same wheel."""
    marker = dest_root / ".wheel-sha256"
    if marker.exists() and marker.read_text().strip() == digest and (dest_root / "sglang").is_dir():
        return dest_root
    if dest_root.exists():
        shutil.rmtree(dest_root)
    tmp = dest_root.with_name(dest_root.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.startswith("sglang/"):
                z.extract(member, tmp)
    (tmp / ".wheel-sha256").write_text(digest + "\n")
    tmp.rename(dest_root)
    return dest_root


def fetch_pinned(cache: pathlib.Path, python: str) -> tuple[pathlib.Path, pathlib.Path]:
    lock = read_lock()
    version = lock["version"]
    wheel = download_wheel(version, cache / "wheels", python)
    digest = verify(wheel, lock["sha256"])
    tree = unpack_sglang(wheel, cache / f"sglang-{version}", digest)
    return wheel, tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fetch_upstream.sh", description=(
        "Download the pinned sglang wheel for PYTHON, verify it against upstream.lock and unpack "
        "the pristine tree. Prints the wheel path and the tree path."))
    ap.add_argument("--python", default=sys.executable, help="interpreter whose wheel tag to fetch")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "upstream"))
    args = ap.parse_args(argv)
    try:
        wheel, tree = fetch_pinned(pathlib.Path(args.cache), args.python)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(wheel)
    print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
