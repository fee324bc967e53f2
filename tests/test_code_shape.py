"""The code's shape limits: no module over 600 lines, and a class with over 20 instance attributes
says why in its docstring (naming its attributes, fields or counters)."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import ROOT as REPO

PACKAGES = ("server", "client", "policies", "broker", "safety", "bench")
MAX_LINES = 600
MAX_ATTRIBUTES = 20
REASON_WORDS = ("attribute", "field", "counter")


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def _attributes(cls: ast.ClassDef) -> set[str]:
    """``self.x`` assignments anywhere in the class, plus annotated class-level names (fields)."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.attr for t in targets
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def test_no_module_is_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_a_class_over_20_attributes_says_why() -> None:
    silent = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and len(_attributes(node)) > MAX_ATTRIBUTES:
                doc = (ast.get_docstring(node) or "").lower()
                if not any(word in doc for word in REASON_WORDS):
                    silent.append(f"{path.relative_to(REPO)}: {node.name} ({len(_attributes(node))})")
    assert not silent, silent
