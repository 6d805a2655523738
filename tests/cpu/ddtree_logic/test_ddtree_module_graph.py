# SPDX-License-Identifier: Apache-2.0
"""The modules of ``speculative/ddtree`` import each other without a cycle,
counting imports inside functions too (a deferred import hides a cycle from
Python, not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

import sglang.srt.speculative.ddtree as pkg

PACKAGE = "sglang.srt.speculative.ddtree"
ROOT = Path(pkg.__file__).parent


def _imports(path: Path) -> set:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                out |= {a.name for a in node.names}
            elif node.module.startswith(PACKAGE + "."):
                out.add(node.module[len(PACKAGE) + 1 :].split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    out.add(a.name[len(PACKAGE) + 1 :].split(".")[0])
    return out


def _graph() -> dict:
    mods = {p.stem for p in ROOT.glob("*.py")}
    return {p.stem: _imports(p) & mods - {p.stem} for p in ROOT.glob("*.py")}


def _cycle(graph: dict):
    state = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_import_cycle():
    graph = _graph()
    assert graph["tree_build"] and "reference" in graph["tree_build"]  # the scan sees real edges
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_reference_depends_only_on_the_tree_format():
    assert _graph()["reference"] <= {"draft_tree"}


def test_the_scan_finds_a_cycle_when_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
