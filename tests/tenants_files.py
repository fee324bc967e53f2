"""Tenants files for servers that tests start: ``write_tenants`` and the factory behind the
``tenants_file`` fixture. Tenants are given as data (name to ``TenantConfig`` fields), checked by
the schema before the file is written."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from chunkline.server.core.tenants import TenantsFile as TenantsSchema
from chunkline.server.core.tenants import add_key, write_tenants_file

TenantsFile = Callable[..., tuple[Path, dict[str, str]]]
Tenants = Mapping[str, Mapping[str, Any]]

#: a tenant that may send robot requests (the ``policy`` class) to every model, and nothing else
POLICY_ONLY: Mapping[str, Any] = {"classes": ["policy"]}


def write_tenants(folder: Path, tenants: Tenants | None = None, keys: Iterable[str] = ()) -> tuple[Path, dict[str, str]]:
    """Writes ``folder/tenants.toml`` holding ``tenants`` (no file when None), adds one key per name
    in ``keys`` (creating the tenant at default settings when ``tenants`` is None) and returns the
    path and the keys by tenant name."""
    path = folder / "tenants.toml"
    if tenants is not None:
        write_tenants_file(path, TenantsSchema.model_validate({"tenants": tenants}))
    return path, {name: add_key(path, name, create_tenant=tenants is None)[0] for name in keys}


def tenants_file_factory(tmp_path_factory: pytest.TempPathFactory) -> TenantsFile:
    """``make(tenants, keys)``: :func:`write_tenants` in a fresh folder."""

    def make(tenants: Tenants | None = None, keys: Iterable[str] = ()) -> tuple[Path, dict[str, str]]:
        return write_tenants(tmp_path_factory.mktemp("tenants"), tenants, keys)

    return make
