# SPDX-License-Identifier: Apache-2.0
"""The training text: Python sources and docs of the installed interpreter, chosen by rule.

No download: the files are the standard library and the site-packages of the Python that
runs the build (on the GPU host, the image's numpy, scipy, torch, transformers, jax, ...).
The selection is a pure function of the file list and the file contents:

1. walk each root in sorted order, keep files with an extension in ``EXTENSIONS`` and a size
   in ``[MIN_BYTES, MAX_BYTES]`` (outside ``__pycache__`` and ``*.dist-info`` / ``*.egg-info``);
   a file is named ``<root label>/<path under the root>``;
2. drop files that do not decode as UTF-8 and duplicates by content (vendored copies; the
   first name in sorted order is kept);
3. if the text exceeds ``max_bytes``, keep a file iff a hash of its name falls below
   ``max_bytes / total`` (a fixed pseudo-random subset, independent of walk order);
4. a file is held out iff another hash of its name falls below ``heldout_fraction``.

So the held-out prompts come from files the target never saw, and the same image gives the
same corpus on every run (the manifest lists every file with its sha256 to check that).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

EXTENSIONS = (".py", ".pyi", ".md", ".rst")
MIN_BYTES = 256
MAX_BYTES = 512 * 1024  # larger files are generated tables and data, not prose or code
SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")
SKIP_DIRS = {"__pycache__", ".git"}


@dataclass(frozen=True)
class Doc:
    name: str  # "<root label>/<relative path>"
    sha256: str
    text: str


@dataclass
class Corpus:
    train: list[Doc] = field(default_factory=list)
    heldout: list[Doc] = field(default_factory=list)
    roots: dict = field(default_factory=dict)
    candidates: int = 0
    dropped_undecodable: int = 0
    dropped_duplicate: int = 0
    dropped_by_cap: int = 0

    def bytes(self, split: str) -> int:
        return sum(len(d.text.encode()) for d in getattr(self, split))

    def manifest(self) -> dict:
        return {
            "roots": self.roots,
            "rule": {"extensions": list(EXTENSIONS), "min_bytes": MIN_BYTES, "max_bytes": MAX_BYTES},
            "candidates": self.candidates,
            "dropped_undecodable": self.dropped_undecodable,
            "dropped_duplicate": self.dropped_duplicate,
            "dropped_by_cap": self.dropped_by_cap,
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_bytes": self.bytes("train"),
            "heldout_bytes": self.bytes("heldout"),
        }

    def file_list(self) -> list[dict]:
        return [{"name": d.name, "sha256": d.sha256, "split": split}
                for split in ("train", "heldout") for d in getattr(self, split)]


def default_roots() -> dict[str, Path]:
    """The running interpreter's standard library and site-packages, labelled."""
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"]), "site-packages": Path(paths["purelib"])}
    if Path(paths["platlib"]) != Path(paths["purelib"]):
        roots["site-packages-plat"] = Path(paths["platlib"])
    return {k: v for k, v in roots.items() if v.is_dir()}


def unit_hash(tag: str, name: str) -> float:
    """A uniform number in [0, 1) from a name (selection and split rules)."""
    return int.from_bytes(hashlib.sha256(f"{tag}:{name}".encode()).digest()[:8], "big") / 2.0 ** 64


def list_files(roots: dict[str, Path], exclude: Iterable[Path] = ()) -> list[tuple[str, Path]]:
    """(name, path) of every candidate file, sorted by name."""
    exclude = [Path(e).resolve() for e in exclude]
    out = []
    for label, root in sorted(roots.items()):
        root = Path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(
                d for d in dirnames
                if d not in SKIP_DIRS and not d.endswith(SKIP_DIR_SUFFIXES)
                and not any((here / d).resolve() == e for e in exclude)
                and not (here / d).is_symlink()
            )
            if label == "stdlib" and here == root:
                dirnames[:] = [d for d in dirnames if d != "site-packages"]
            for f in sorted(filenames):
                if not f.endswith(EXTENSIONS):
                    continue
                p = here / f
                try:
                    size = p.stat().st_size
                except OSError:
                    continue
                if MIN_BYTES <= size <= MAX_BYTES and not p.is_symlink():
                    out.append((f"{label}/{p.relative_to(root).as_posix()}", p))
    out.sort(key=lambda x: x[0])
    return out


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def build_corpus(roots: Optional[dict[str, Path]] = None, max_bytes: int = 160 * 2**20,
                 heldout_fraction: float = 0.02, exclude: Iterable[Path] = (), threads: int = 16) -> Corpus:
    roots = roots or default_roots()
    files = list_files(roots, exclude)
    corpus = Corpus(roots={k: str(v) for k, v in roots.items()}, candidates=len(files))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        texts = list(pool.map(_read, [p for _, p in files]))
    seen: set[str] = set()
    docs = []
    for (name, _), text in zip(files, texts):
        if text is None:
            corpus.dropped_undecodable += 1
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            corpus.dropped_duplicate += 1
            continue
        seen.add(digest)
        docs.append(Doc(name, digest, text))
    total = sum(len(d.text.encode()) for d in docs)
    if total > max_bytes:
        keep = max_bytes / total
        kept = [d for d in docs if unit_hash("select", d.name) < keep]
        corpus.dropped_by_cap = len(docs) - len(kept)
        docs = kept
    for d in docs:
        (corpus.heldout if unit_hash("heldout", d.name) < heldout_fraction else corpus.train).append(d)
    return corpus
