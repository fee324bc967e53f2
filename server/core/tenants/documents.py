"""The tenants file as text: parsed strictly for validation, and edited in place for key changes.

Two views of the same text, on purpose:

* :func:`parse_text` gives plain data for :class:`~chunkline.server.core.tenants.schema.TenantsFile`
  (``tomllib``, strict and fast: the server reloads through it on every SIGHUP).
* :func:`open_document` gives a :class:`TenantsDocument` that ``chunkline keys add|revoke`` edit. A
  TOML file is edited as a ``tomlkit`` document, so the operator's comments, key order and layout
  survive: only the lines of the new key (or the revoked key's two fields) change. A YAML file is
  edited as plain data and dumped again (PyYAML keeps no comments; YAML support is a convenience).

Whoever edits checks that the new text reads back through :func:`parse_text` to the intended
file before writing it (``store``), so a layout-preserving edit can never write a file the server
would read differently.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Protocol

import tomlkit
from tomlkit.items import AoT, Array, Comment, InlineTable, Item, Key, Table, Whitespace

from chunkline.server.core.tenants.errors import TenantsFileError
from chunkline.server.core.tenants.schema import KeyEntry, TenantsFile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

__all__ = ["TenantsDocument", "is_yaml", "parse_text", "open_document", "render"]

_HEADER_LINES = (
    "chunkline tenants file; `chunkline keys add|list|revoke` edit it in place (comments and layout are kept).",
    "API keys are stored only as SHA-256 digests.",
)
_YAML_HEADER = (
    "# chunkline tenants file, managed by `chunkline keys add|list|revoke`.\n"
    "# API keys are stored only as SHA-256 digests. Rewrites of a YAML file drop comments (TOML files keep them).\n"
)


def is_yaml(path: Path) -> bool:
    """Whether ``path`` names a YAML tenants file (by its suffix); anything else is TOML."""
    return path.suffix.lower() in (".yaml", ".yml")


def _import_yaml() -> Any:
    try:
        return importlib.import_module("yaml")
    except ImportError:  # YAML support is optional: PyYAML is not a dependency
        return None


def _yaml_module(path: Path) -> Any:
    yaml = _import_yaml()
    if yaml is None:
        raise TenantsFileError(path, "YAML tenants files need PyYAML (pip install pyyaml); or use TOML")
    return yaml


def parse_text(path: Path, text: str) -> Any:
    """The plain data in ``text`` (the contents of ``path``), for validation.

    Raises:
        TenantsFileError: ``text`` does not parse (or is YAML and PyYAML is missing).
    """
    if is_yaml(path):
        yaml = _yaml_module(path)
        try:
            return yaml.safe_load(text) or {}
        except Exception as exc:  # yaml.YAMLError and its many subclasses
            raise TenantsFileError(path, f"cannot parse: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(path, f"cannot parse: {exc}") from None


class TenantsDocument(Protocol):
    """A tenants file being edited. The caller has validated the file and checks the result."""

    def add_tenant(self, name: str) -> None:
        """Add tenant ``name`` with default settings (it is not in the file)."""

    def add_key(self, tenant: str, entry: KeyEntry) -> None:
        """Append ``entry`` to the keys of ``tenant`` (which is in the file)."""

    def mark_revoked(self, tenant: str, key_id: str, when: _dt.datetime) -> None:
        """Set ``revoked = true`` and ``revoked_at = when`` on key ``key_id`` of ``tenant``."""

    def dumps(self) -> str:
        """The edited file's text."""


def _key_fields(entry: KeyEntry) -> dict[str, Any]:
    # id, hash, created, revoked (and revoked_at once set): the order the file shows them in.
    return entry.model_dump(mode="python", exclude_none=True)


def open_document(path: Path, text: str | None) -> TenantsDocument:
    """An editable view of ``text`` (the contents of ``path``; ``None``: a new, empty file).

    Raises:
        TenantsFileError: YAML without PyYAML, or ``text`` does not parse.
    """
    if is_yaml(path):
        return _YamlDocument(path, text)
    try:
        return _TomlDocument(text)
    except tomlkit.exceptions.ParseError as exc:
        raise TenantsFileError(path, f"cannot parse: {exc}") from None


def render(path: Path, data: TenantsFile) -> str:
    """The text of a whole new file holding ``data`` (no layout to keep: the file is written anew)."""
    fields = data.model_dump(mode="python", exclude_none=True)
    if is_yaml(path):
        return _YAML_HEADER + str(_yaml_module(path).safe_dump(fields, sort_keys=False))
    doc = _new_toml_document()
    for name, value in fields.items():
        doc[name] = value
    return tomlkit.dumps(doc)


# ----------------------------------------------------------------------------- TOML, layout kept


def _new_toml_document() -> tomlkit.TOMLDocument:
    doc = tomlkit.document()
    for line in _HEADER_LINES:
        doc.add(tomlkit.comment(line))
    doc.add(tomlkit.nl())
    doc.add("version", 1)
    return doc


# In tomlkit, comments and blank lines between two tables belong to the body of the first one (the
# parser cannot know better). Appending a table after it would push a comment written above the
# next tenant ("# the lab's keys") to below the new table, away from what it describes. So before
# appending, the comments after the last table's final blank line are taken out and put back after
# the new table; comments directly under a table's last line (a commented-out setting) stay there.


def _last_table(table: Table) -> Table:
    """The table whose header comes last in the text of ``table`` (``table`` itself if it has no sub-tables)."""
    while True:
        last = next((item for key, item in reversed(table.value.body) if key is not None), None)
        if isinstance(last, Table):
            table = last
        elif isinstance(last, AoT) and last.body:
            table = last.body[-1]
        else:
            return table


def _take_trivia(table: Table) -> list[tuple[Key | None, Item]]:
    """Remove and return the comments and blank lines at the end of ``table``'s body."""
    body = table.value.body
    n = 0
    while n < len(body) and body[-1 - n][0] is None and isinstance(body[-1 - n][1], (Comment, Whitespace)):
        n += 1
    # Keyless trailing entries are not in the container's key index, so cutting them off the end of
    # the body list leaves the container consistent.
    taken = body[len(body) - n:]
    del body[len(body) - n:]
    return taken


def _put_trivia(table: Table, trivia: list[tuple[Key | None, Item]]) -> None:
    table.value.body.extend(trivia)


def _detach_leading_comments_of_next(table: Table) -> list[tuple[Key | None, Item]]:
    """Take out the comments after the final blank line of ``table`` and end it with a blank line."""
    trivia = _take_trivia(table)
    blank = next((i for i, (_, item) in enumerate(trivia) if isinstance(item, Whitespace) and "\n" in item.as_string()), None)
    if blank is None:
        _put_trivia(table, trivia)
        if table.value.body:  # an empty table (a tenant just added) shows no lines to separate
            table.add(tomlkit.nl())
        return []
    _put_trivia(table, trivia[: blank + 1])
    return trivia[blank + 1:]


def _reattach(table: Table, moved: list[tuple[Key | None, Item]]) -> None:
    if moved:
        table.add(tomlkit.nl())
        _put_trivia(table, moved)


def _append_to_table(parent: Table, key: str, item: Table | AoT) -> None:
    moved = _detach_leading_comments_of_next(_last_table(parent))
    parent.append(key, item)
    _reattach(_last_table(parent), moved)


def _append_to_aot(aot: AoT, table: Table) -> None:
    moved = _detach_leading_comments_of_next(_last_table(aot.body[-1])) if aot.body else []
    aot.append(table)
    _reattach(_last_table(table), moved)


def _set_field(entry: MutableMapping[str, Any], key: str, value: Any) -> None:
    if isinstance(entry, Table) and key not in entry:
        # A new field goes after the entry's last field, not after the comments that follow it.
        trivia = _take_trivia(entry)
        entry.add(key, value)
        _put_trivia(entry, trivia)
    else:
        entry[key] = value  # tomlkit keeps the line's own comment when a value is replaced


class _TomlDocument:
    def __init__(self, text: str | None) -> None:
        self._doc = _new_toml_document() if text is None else tomlkit.parse(text)

    def _tenants(self) -> MutableMapping[str, Any]:
        if "tenants" not in self._doc:
            self._doc.add(tomlkit.nl())
            self._doc.add("tenants", tomlkit.table(is_super_table=True))
        tenants: MutableMapping[str, Any] = self._doc["tenants"]
        return tenants

    def add_tenant(self, name: str) -> None:
        tenants = self._tenants()
        if isinstance(tenants, InlineTable):  # ``tenants = { ... }`` written inline
            tenants[name] = tomlkit.inline_table()
        elif isinstance(tenants, Table):
            _append_to_table(tenants, name, tomlkit.table())
        else:  # tables of ``tenants`` spread out of order: tomlkit's proxy places the new one
            tenants[name] = tomlkit.table()

    def add_key(self, tenant: str, entry: KeyEntry) -> None:
        config: MutableMapping[str, Any] = self._tenants()[tenant]
        keys = config.get("keys")
        if isinstance(keys, AoT):
            _append_to_aot(keys, _table(_key_fields(entry)))
        elif isinstance(keys, Array):  # ``keys = [{ ... }]`` written inline
            keys.append(_inline_table(_key_fields(entry)))
        elif isinstance(config, InlineTable):
            array = tomlkit.array()
            array.append(_inline_table(_key_fields(entry)))
            config["keys"] = array
        else:
            aot = tomlkit.aot()
            aot.append(_table(_key_fields(entry)))
            if isinstance(config, Table):
                _append_to_table(config, "keys", aot)
            else:  # tables of this tenant spread out of order: tomlkit's proxy places it
                config["keys"] = aot

    def mark_revoked(self, tenant: str, key_id: str, when: _dt.datetime) -> None:
        entry = next(k for k in self._tenants()[tenant]["keys"] if k["id"] == key_id)
        _set_field(entry, "revoked", True)
        _set_field(entry, "revoked_at", when)

    def dumps(self) -> str:
        return tomlkit.dumps(self._doc)


def _table(fields: dict[str, Any]) -> Table:
    table = tomlkit.table()
    table.update(fields)
    return table


def _inline_table(fields: dict[str, Any]) -> InlineTable:
    table = tomlkit.inline_table()
    table.update(fields)
    return table


# ----------------------------------------------------------------------------- YAML, data only


class _YamlDocument:
    def __init__(self, path: Path, text: str | None) -> None:
        self._yaml = _yaml_module(path)
        self._data: dict[str, Any] = {"version": 1} if text is None else (self._yaml.safe_load(text) or {})

    def add_tenant(self, name: str) -> None:
        self._data.setdefault("tenants", {})[name] = {}

    def add_key(self, tenant: str, entry: KeyEntry) -> None:
        self._data["tenants"][tenant].setdefault("keys", []).append(_key_fields(entry))

    def mark_revoked(self, tenant: str, key_id: str, when: _dt.datetime) -> None:
        entry = next(k for k in self._data["tenants"][tenant]["keys"] if k["id"] == key_id)
        entry["revoked"] = True
        entry["revoked_at"] = when

    def dumps(self) -> str:
        return _YAML_HEADER + str(self._yaml.safe_dump(self._data, sort_keys=False))
