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
