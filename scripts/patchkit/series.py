# SPDX-License-Identifier: Apache-2.0
"""The patch series and the overlay as they stand in the repository."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import tomllib

from .unidiff import Patch, parse_patch

REPO = pathlib.Path(__file__).resolve().parents[2]
OVERLAY_SKIP = ("__pycache__",)
HEADER_FIELDS = ("Description", "Author", "Forwarded", "Last-Update", "Upstream-Version")


class SeriesError(RuntimeError):
    pass


def read_text(path: pathlib.Path, what: str) -> str:
    """A series file as text; a clear SeriesError for bytes that are not UTF-8 (not a patch)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SeriesError(
            f"{path}: not a text file (byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8); "
            f"a {what} is a UTF-8 text file (see docs/DEVELOPING.md)"
        ) from e


def read_lock(repo: pathlib.Path = REPO) -> dict:
    with open(repo / "upstream.lock", "rb") as f:
        return tomllib.load(f)["upstream"]


@dataclasses.dataclass
class Series:
    patches: list[Patch]
    overlay_root: pathlib.Path
    overlay_files: list[str]  # paths relative to the overlay root's parent, e.g. sglang/srt/x.py
    upstream_version: str

    def digest(self, mode: str = "copy") -> str:
        h = hashlib.sha256()
        h.update(f"mode={mode}\nupstream={self.upstream_version}\n".encode())
        for p in self.patches:
            h.update(f"patch {p.name}\n".encode())
            h.update(p.text.encode())
        for rel in self.overlay_files:
            h.update(f"overlay {rel}\n".encode())
            h.update((self.overlay_root.parent / rel).read_bytes())
        return h.hexdigest()

    def touched_files(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.patches:
            for f in p.files:
                seen.setdefault(f.path, None)
        return list(seen)


def load_series(
    patches_dir: pathlib.Path = REPO / "patches",
    overlay_root: pathlib.Path = REPO / "sglang",
    upstream_version: str | None = None,
) -> Series:
    series_file = patches_dir / "series"
    names: list[str] = []
    if series_file.exists():
        for raw in read_text(series_file, "series file").splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                names.append(line)
    if len(set(names)) != len(names):
        raise SeriesError(f"{series_file}: a patch is listed twice")
    patches = []
    for name in names:
        path = patches_dir / name
        if not path.exists():
            raise SeriesError(f"{series_file} lists {name}, but {path} does not exist")
        patch = parse_patch(name, read_text(path, "patch"))
        missing = [k for k in HEADER_FIELDS if not patch.header_field(k)]
        if missing:
            raise SeriesError(f"{path}: header lacks {', '.join(missing)} (see docs/DEVELOPING.md)")
        patches.append(patch)
    unlisted = sorted(
        p.name for p in patches_dir.glob("*.patch") if p.name not in set(names)
    ) if patches_dir.exists() else []
    if unlisted:
        raise SeriesError(f"patches not listed in {series_file}: {', '.join(unlisted)}")
    overlay_files: list[str] = []
    if overlay_root.exists():
        for f in sorted(overlay_root.rglob("*")):
            if f.is_file() and not any(s in f.parts for s in OVERLAY_SKIP) and f.suffix != ".pyc":
                overlay_files.append(f.relative_to(overlay_root.parent).as_posix())
    version = upstream_version or read_lock()["version"]
    return Series(patches, overlay_root, overlay_files, version)
