# SPDX-License-Identifier: Apache-2.0
"""Unified-diff parsing and zero-fuzz hunk application.

GNU patch would do for applying, but the series tooling needs more than it gives: exact
reasons when a hunk does not match (what it expected and the nearest near-miss), offsets
reported per hunk for bump reports, and in-memory application so a failed series never
touches the target.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = "\\ No newline at end of file"


class PatchFormatError(ValueError):
    pass


@dataclasses.dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[str]  # each starts with ' ', '-' or '+', newline kept

    @property
    def header(self) -> str:
        return f"@@ -{self.old_start},{self.old_len} +{self.new_start},{self.new_len} @@"

    def old_lines(self) -> list[str]:
        return [l[1:] for l in self.lines if l[0] in " -"]

    def new_lines(self) -> list[str]:
        return [l[1:] for l in self.lines if l[0] in " +"]

    def reversed(self) -> "Hunk":
        flip = {" ": " ", "-": "+", "+": "-"}
        return Hunk(
            self.new_start,
            self.new_len,
            self.old_start,
            self.old_len,
            [flip[l[0]] + l[1:] for l in self.lines],
        )


@dataclasses.dataclass
class FileDiff:
    path: str  # relative to the directory holding the `sglang` package
    hunks: list[Hunk]


@dataclasses.dataclass
class Patch:
    name: str
    header: str  # everything before the first '--- ' line
    files: list[FileDiff]
    text: str

    def header_field(self, key: str) -> str | None:
        for line in self.header.splitlines():
            if line.lower().startswith(key.lower() + ":"):
                return line.split(":", 1)[1].strip()
        return None


def _strip_prefix(path: str) -> str:
    path = path.split("\t")[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_patch(name: str, text: str) -> Patch:
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        i += 1
    header = "".join(lines[:i])
    files: list[FileDiff] = []
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchFormatError(f"{name}: '--- ' at line {i + 1} is not followed by '+++ '")
        old, new = _strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:])
        if old == "/dev/null" or new == "/dev/null" or old != new:
            raise PatchFormatError(
                f"{name}: line {i + 1}: patches may only edit existing upstream files "
                f"(got {old!r} -> {new!r}); new files belong in the overlay"
            )
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK_RE.match(lines[i])
            if not m:
                raise PatchFormatError(f"{name}: bad hunk header at line {i + 1}: {lines[i]!r}")
            old_start, old_len = int(m.group(1)), int(m.group(2) or 1)
            new_start, new_len = int(m.group(3)), int(m.group(4) or 1)
            i += 1
            body: list[str] = []
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                l = lines[i]
                if l.rstrip("\n") == NO_NEWLINE:
                    body[-1] = body[-1].rstrip("\n")
                    i += 1
                    continue
                tag = l[:1]
                if l in ("\n", ""):
                    l, tag = " \n", " "  # some editors strip the context space of blank lines
                if tag not in " -+":
                    raise PatchFormatError(f"{name}: unexpected line {i + 1} in hunk: {l!r}")
                body.append(l)
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if (seen_old, seen_new) != (old_len, new_len):
                raise PatchFormatError(f"{name}: hunk at line {i} is truncated")
            if i < len(lines) and lines[i].rstrip("\n") == NO_NEWLINE:
                body[-1] = body[-1].rstrip("\n")
                i += 1
            hunks.append(Hunk(old_start, old_len, new_start, new_len, body))
        if not hunks:
            raise PatchFormatError(f"{name}: no hunks for {old}")
        files.append(FileDiff(old, hunks))
    if not files:
        raise PatchFormatError(f"{name}: contains no file diffs")
    return Patch(name, header, files, text)


@dataclasses.dataclass
class HunkResult:
    index: int  # 1-based
    header: str
    offset: int | None  # None = failed
    detail: str = ""


class HunkFailed(Exception):
    def __init__(self, path: str, result: HunkResult):
        super().__init__(f"{path}: hunk #{result.index} {result.header} does not apply")
        self.path = path
        self.result = result


def _matches_at(lines: list[str], want: list[str], pos: int) -> bool:
    return pos >= 0 and lines[pos : pos + len(want)] == want


#: Lines too common to say where a hunk belongs: matching them is no evidence of a near miss.
TRIVIAL = frozenset({"", ")", "]", "}", "),", "],", "},", "):", "else:", "try:", "finally:", "pass",
                     "return", "continue", "break", '"""', "#"})


def is_distinctive(line: str) -> bool:
    s = line.strip()
    return s not in TRIVIAL and len(s) > 3


def _describe_miss(lines: list[str], want: list[str], expected_at: int) -> str:
    """Say what the hunk expected and where the closest candidate differs.

    A candidate counts only the hunk's distinctive lines it holds, and must hold at least half of
    them: a window that shares a few blank lines and brackets with the hunk is no near miss.
    """
    out = [f"expected these {len(want)} lines near line {expected_at + 1}:"]
    out += ["    | " + w.rstrip("\n") for w in want[:12]]
    if len(want) > 12:
        out.append(f"    | ... ({len(want) - 12} more)")
    keys = [k for k, w in enumerate(want) if is_distinctive(w)] or list(range(len(want)))
    best, best_pos = -1, None
    for pos in range(0, max(1, len(lines) - len(want) + 1)):
        score = sum(pos + k < len(lines) and lines[pos + k] == want[k] for k in keys)
        if score > best or (score == best and abs(pos - expected_at) < abs(best_pos - expected_at)):
            best, best_pos = score, pos
    if best_pos is not None and best > 0 and 2 * best >= len(keys):
        out.append(f"nearest match: line {best_pos + 1} ({best} of the hunk's {len(keys)} distinctive lines equal); "
                   "first difference:")
        for k, w in enumerate(want):
            got = lines[best_pos + k] if best_pos + k < len(lines) else "<end of file>"
            if got != w:
                out.append(f"    line {best_pos + k + 1}: expected {w.rstrip(chr(10))!r}")
                out.append(f"    {' ' * len(str(best_pos + k + 1))}       found    {got.rstrip(chr(10))!r}")
                break
    else:
        out.append("no similar block exists in the file")
    return "\n".join(out)


def apply_file_diff(
    text: str, diff: FileDiff, reverse: bool = False, keep_going: bool = False
) -> tuple[str, list[HunkResult]]:
    """Apply one file's hunks with zero fuzz. Offsets are allowed and reported.

    With keep_going, failed hunks are skipped (for bump reports) instead of raising.
    """
    lines = text.splitlines(keepends=True)
    results: list[HunkResult] = []
    drift = 0  # how far earlier hunks moved the file
    for idx, hunk in enumerate(diff.hunks, 1):
        h = hunk.reversed() if reverse else hunk
        want = h.old_lines()
        expected = max(h.old_start - 1, 0) + drift
        if h.old_len == 0:  # pure insertion: position is after line old_start
            expected = h.old_start + drift
        pos = None
        for delta in range(0, len(lines) + 1):
            for cand in (expected - delta, expected + delta) if delta else (expected,):
                if 0 <= cand <= len(lines) and _matches_at(lines, want, cand):
                    pos = cand
                    break
            if pos is not None:
                break
        if pos is None:
            res = HunkResult(idx, hunk.header, None, _describe_miss(lines, want, expected))
            if keep_going:
                results.append(res)
                continue
            raise HunkFailed(diff.path, res)
        new = h.new_lines()
        lines[pos : pos + len(want)] = new
        results.append(HunkResult(idx, hunk.header, pos - expected + (0 if h.old_len else 0)))
        drift += len(new) - len(want) + (pos - expected)
    return "".join(lines), results


def make_file_diff(path: str, before: str, after: str, context: int = 3) -> str:
    """A unified diff with a/ b/ labels, as `diff -u` would write it (modulo hunk grouping)."""
    a = before.splitlines(keepends=True)
    b = after.splitlines(keepends=True)
    out: list[str] = []
    for line in difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=context):
        if line.startswith(("--- ", "+++ ")):
            line = line.rstrip() + "\n"
        if not line.endswith("\n"):
            line += "\n" + NO_NEWLINE + "\n"
        out.append(line)
    return "".join(out)
