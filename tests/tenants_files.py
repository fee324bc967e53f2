"""Tenants files for servers that tests start: ``write_tenants`` and the factory behind the
``tenants_file`` fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from chunkline.server.core.tenants import add_key

TenantsFile = Callable[..., tuple[Path, dict[str, str]]]


def write_tenants(folder: Path, text: str | None = None, keys: Iterable[str] = ()) -> tuple[Path, dict[str, str]]:
    """Writes ``text`` (TOML; no file when None) to ``folder/tenants.toml``, adds one key per name in
    ``keys`` (creating the tenants when ``text`` is None) and returns the path and the keys by
    tenant name."""
    path = folder / "tenants.toml"
    if text is not None:
        path.write_text(text)
    return path, {name: add_key(path, name, create_tenant=text is None)[0] for name in keys}


def tenants_file_factory(tmp_path_factory: pytest.TempPathFactory) -> TenantsFile:
    """``make(text, keys)``: :func:`write_tenants` in a fresh folder."""

    def make(text: str | None = None, keys: Iterable[str] = ()) -> tuple[Path, dict[str, str]]:
        return write_tenants(tmp_path_factory.mktemp("tenants"), text, keys)

    return make
