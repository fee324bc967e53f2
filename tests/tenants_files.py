"""Tenants files for servers that tests start: the factory behind the ``tenants_file`` fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from chunkline.server.core.tenants import add_key

TenantsFile = Callable[..., tuple[Path, dict[str, str]]]


def tenants_file_factory(tmp_path_factory: pytest.TempPathFactory) -> TenantsFile:
    """``make(text, keys)`` writes ``text`` (TOML; no file when None) to a fresh folder, adds one key
    per name in ``keys`` (creating the tenants when ``text`` is None) and returns the path and the
    keys by tenant name."""

    def make(text: str | None = None, keys: Iterable[str] = ()) -> tuple[Path, dict[str, str]]:
        path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
        if text is not None:
            path.write_text(text)
        return path, {name: add_key(path, name, create_tenant=text is None)[0] for name in keys}

    return make
