"""The docs cover what the code accepts and cite only files the repository has."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from chunkline.bench.cli import SUITES
from chunkline.server.core.tenants.schema import KeyEntry, LimitsConfig, TenantConfig, TenantsFile

ROOT = Path(__file__).resolve().parents[1]


def _documented_keys() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("## The tenants file"):]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def test_every_tenants_file_key_is_documented() -> None:
    expected: set[str] = set(TenantsFile.model_fields) - {"tenants"} | {"tenants.<name>"}
    models: list[tuple[str, Any]] = [("", TenantConfig), ("limits.", LimitsConfig), ("keys[].", KeyEntry)]
    for prefix, model in models:
        expected |= {prefix + name for name in model.model_fields if not (prefix == "" and name in ("limits", "keys"))}
    assert expected - _documented_keys() == set()


def test_benchmarks_doc_lists_every_suite_and_cites_no_missing_file() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [name for name in SUITES if f"`{name}`" not in text]
    assert not missing
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), (doc.name, target)
        assert "DESIGN.md" not in doc.read_text() or doc.name == "architecture.md", doc.name


def _names_in(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module, each with the names defined in its body (methods, fields)."""
    import ast

    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            names[node.name] = members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.Assign):
            names.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
    return names


def _resolve(cited: str) -> Path | None:
    """A cited ``path.py``: from the repository's root, else the one file whose path ends so."""
    if (ROOT / cited).is_file():
        return ROOT / cited
    found = [p for top in ("server", "client", "broker", "safety", "policies", "bench") for p in (ROOT / top).rglob("*.py")
             if p.as_posix().endswith("/" + cited)]
    return found[0] if len(found) == 1 else None


def test_every_file_and_symbol_the_architecture_page_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = re.findall(r"`([\w/]+\.py): ([A-Za-z_][\w.]*)", text)
    assert cited, "the page names no file: symbol pairs any more"
    missing = []
    for file, symbol in cited:
        path = _resolve(file)
        if path is None:
            missing.append(f"{file} (no such file)")
            continue
        top, *rest = symbol.split(".")
        names = _names_in(path)
        if top not in names or (rest and rest[0] not in names[top]):
            missing.append(f"{file}: {symbol}")
    assert not missing, missing
