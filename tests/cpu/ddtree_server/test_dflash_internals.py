# SPDX-License-Identifier: Apache-2.0
"""DDTREE's access to upstream ``DFlashWorkerV2`` internals goes through one
adapter (``speculative/ddtree/dflash_internals.py``), and every private name the
adapter uses still exists, with the parameters passed, in the installed
upstream. An upstream bump that renames or moves one of them fails here."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

from sglang.srt.speculative.ddtree import dflash_internals
from sglang.srt.speculative.ddtree.dflash_internals import ATTRIBUTES, FUNCTIONS, HOOKS, METHODS
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

PACKAGE = Path(dflash_internals.__file__).parent
DFLASH_MODULES = {
    "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.speculative.dflash_utils",
    "sglang.srt.speculative.dflash_info",
    "sglang.srt.speculative.dflash_info_v2",
    "sglang.kernels.ops.speculative.dflash",
}


def _class_tree(cls) -> ast.ClassDef:
    return ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]


def _self_attrs(tree: ast.AST, receiver: str = "self") -> tuple[set, set]:
    """(attributes assigned on ``receiver``, attributes read from it)."""
    stored, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver:
            (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.attr)
    return stored, loaded


def _called_methods(tree: ast.AST) -> set:
    return {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
    }


UPSTREAM = _class_tree(DFlashWorkerV2)


@pytest.mark.parametrize("name", ATTRIBUTES)
def test_upstream_still_sets_each_attribute(name):
    stored, _ = _self_attrs(UPSTREAM)
    assert name in stored, f"DFlashWorkerV2 no longer assigns self.{name}; update dflash_internals.py"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_upstream_methods_take_the_parameters_passed(name):
    method = getattr(DFlashWorkerV2, name, None)
    assert callable(method), f"DFlashWorkerV2.{name} is gone; update dflash_internals.py"
    params = inspect.signature(method).parameters
    missing = [p for p in METHODS[name] if p not in params]
    assert not missing, f"DFlashWorkerV2.{name} no longer takes {missing}"


@pytest.mark.parametrize("name", HOOKS)
def test_overridden_hooks_are_still_called_by_upstream(name):
    assert callable(getattr(DFlashWorkerV2, name, None)), f"DFlashWorkerV2.{name} is gone"
    assert name in _called_methods(UPSTREAM), f"DFlashWorkerV2 no longer calls self.{name}(): the override is dead"


@pytest.mark.parametrize("where", sorted(FUNCTIONS))
def test_upstream_private_functions_take_the_parameters_passed(where):
    module, name = where
    fn = getattr(importlib.import_module(module), name, None)
    assert callable(fn), f"{module}.{name} is gone; update dflash_internals.py"
    params = inspect.signature(fn).parameters
    assert [p for p in FUNCTIONS[where] if p not in params] == []


def test_the_adapter_uses_only_the_listed_names():
    tree = ast.parse(Path(dflash_internals.__file__).read_text())
    used = set()
    for node in ast.walk(tree):
        # w._x or self._worker._x
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "w") or (
                isinstance(base, ast.Attribute) and base.attr == "_worker"
            ):
                used.add(node.attr)
    listed = set(ATTRIBUTES) | set(METHODS)
    assert used <= listed, sorted(used - listed)
    assert listed <= used, f"listed but unused: {sorted(listed - used)}"
    imported = {
        (n.module, a.name)
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
        if a.name.startswith("_")
    }
    assert imported == set(FUNCTIONS)


def test_no_other_ddtree_module_touches_upstream_private_members():
    """The worker reads only private members it defines itself (plus the
    overridden hooks); no other module of the package imports a private name
    of the DFlash worker's modules."""
    from sglang.srt.speculative.ddtree.worker import DDTreeWorker

    worker = _class_tree(DDTreeWorker)
    stored, loaded = _self_attrs(worker)
    own = stored | {n.name for n in worker.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    foreign = sorted(a for a in loaded if a.startswith("_") and not a.startswith("__") and a not in own)
    assert foreign == [], f"DDTreeWorker reads upstream private members {foreign}: go through DFlashInternals"
    assert set(HOOKS) <= own

    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "dflash_internals.py":
            continue
        tree = ast.parse(path.read_text())
        private = [
            (n.module, a.name)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module in DFLASH_MODULES
            for a in n.names
            if a.name.startswith("_") and not a.name.startswith("__")
        ]
        assert private == [], f"{path.name} imports upstream private names {private}"
