# SPDX-License-Identifier: Apache-2.0
"""The overlay's import graph, read from its source with ``ast``: every import
statement counts, at module level and inside functions (where an import that would
close a cycle at module level tends to hide).

An edge goes from a module to each overlay module an import statement names
(``from pkg import mod`` names ``pkg.mod`` when that is a module, else ``pkg``).
Importing ``a.b.c`` also runs ``a/b/__init__.py`` first; that is not an edge, since
a package's ``__init__`` re-exporting its submodules is no cycle unless one of them
imports the package's names back, which is an edge of its own.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
OVERLAY = REPO / "sglang"
TREE_VERIFY = "sglang.srt.layers.attention.tree_verify"
#: Packages ``tree_verify/`` may import inside a function: optional installs, and
#: upstream's FlashInfer backend, which imports ``tree_verify.backends`` (patch 0034).
OPTIONAL = ("flashinfer", "sgl_kernel", "sglang.srt.layers.attention.flashinfer_backend")


def module_files(root: pathlib.Path) -> Dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (its parent is the
    import root)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_names(module: str, path: pathlib.Path, function_level_only: bool = False) -> List[str]:
    """The dotted names ``module``'s import statements name (``from a import b``:
    ``a.b``; relative imports resolved), each once per statement."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = ast.walk(tree)
    if function_level_only:
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes = (n for f in funcs for n in ast.walk(f))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(root: pathlib.Path) -> Dict[str, Set[str]]:
    """Module -> the overlay modules its import statements name."""
    files = module_files(root)
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in files:  # ``from pkg import attr``: the module is pkg
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component that has one, as a path."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: Dict[str, Set[str]], component: Set[str]) -> List[str]:
    """A cycle through ``component``, from its first module back to it."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = min(w for w in graph[path[-1]] if w in component)
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


@pytest.fixture(scope="module")
def graph() -> Dict[str, Set[str]]:
    return import_graph(OVERLAY)


def test_the_graph_sees_module_and_function_level_imports(graph):
    """The parse finds edges of both kinds, so an empty answer below means something."""
    assert f"{TREE_VERIFY}.strategies" in graph[f"{TREE_VERIFY}.dispatch"]
    assert f"{TREE_VERIFY}.hook" in graph[f"{TREE_VERIFY}.backends"]
    # spec_algo imports the worker inside a function (it needs torch model code).
    assert "sglang.srt.speculative.ddtree.worker" in graph["sglang.srt.speculative.ddtree.spec_algo"]


def test_a_cycle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_the_overlay_has_no_import_cycle(graph):
    assert cycles(graph) == []


def test_strategy_modules_import_neither_dispatch_policy_nor_hook(graph):
    """A strategy is what the dispatcher, the policy and the hook look up: it
    imports the kernels it runs and the registry, never them."""
    above = {f"{TREE_VERIFY}.{m}" for m in ("dispatch", "policy", "hook", "routes", "backends")}
    strategies = [m for m in graph if m.startswith(f"{TREE_VERIFY}.strategies")]
    assert len(strategies) == 6  # the package and one module per strategy
    for module in strategies:
        assert not graph[module] & above, f"{module} imports {sorted(graph[module] & above)}"


def test_the_registry_imports_nothing_else_of_the_package():
    path = OVERLAY / "srt" / "layers" / "attention" / "tree_verify" / "registry.py"
    names = imported_names(f"{TREE_VERIFY}.registry", path)
    assert [n for n in names if n.split(".")[0] == "sglang"] == []


def test_tree_verify_imports_inside_functions_only_optional_packages():
    """Function-local imports there are for what may be missing from an install
    (FlashInfer, FlashMLA), never to hide a cycle."""
    files = module_files(OVERLAY)
    local = {
        module: [n for n in imported_names(module, path, function_level_only=True) if not n.startswith(OPTIONAL)]
        for module, path in files.items()
        if module.startswith(TREE_VERIFY)
    }
    assert {m: names for m, names in local.items() if names} == {}
