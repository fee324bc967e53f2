"""Reading and writing the tenants file, and the key operations behind ``chunkline keys``.

Every change is a read-modify-write under an advisory lock (two ``keys add`` at once must not lose
one of the edits) that ends in an atomic replace (temp file in the same folder, fsync, rename), so
a server reloading at the same moment reads either the old file or the new one, never half of one.
The file holds key digests: it is written readable by its owner only (mode 0600) and keeps its
owner where the process may set it.

``add_key`` and ``revoke_key`` edit the file's text in place (see ``documents``): an operator's
comments and layout survive, and the new text must read back to exactly the intended contents
before it replaces the old.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from chunkline.server.core.tenants.documents import TenantsDocument, open_document, parse_text, render
from chunkline.server.core.tenants.errors import TenantsFileError, UnknownKey, UnknownTenant
from chunkline.server.core.tenants.keys import generate_key, hash_key, key_id
from chunkline.server.core.tenants.registry import TenantRegistry
from chunkline.server.core.tenants.schema import TENANT_NAME_PATTERN, KeyEntry, TenantConfig, TenantsFile

__all__ = [
    "KeyListing",
    "read_tenants_file",
    "write_tenants_file",
    "load_registry",
    "add_key",
    "list_keys",
    "revoke_key",
]

#: Owner read/write only: the file holds key digests and each tenant's grants.
_FILE_MODE = 0o600


@dataclasses.dataclass(frozen=True)
class KeyListing:
    """One row of ``chunkline keys list`` (no digest, no key)."""

    tenant: str
    id: str
    created: _dt.datetime
    revoked: bool
    revoked_at: _dt.datetime | None


# ----------------------------------------------------------------------------- reading


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TenantsFileError(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TenantsFileError(path, f"cannot parse: {exc}") from None


def _validate(path: Path, text: str) -> TenantsFile:
    try:
        return TenantsFile.model_validate(parse_text(path, text))
    except ValidationError as exc:
        errs = exc.errors(include_url=False, include_input=False)
        where = ".".join(str(x) for x in errs[0]["loc"]) or "file"
        raise TenantsFileError(path, f"{where}: {errs[0]['msg']}" + (f" (+{len(errs) - 1} more)" if len(errs) > 1 else "")) from None


def read_tenants_file(path: str | os.PathLike[str]) -> TenantsFile:
    """Read and validate a tenants file.

    Args:
        path: a ``.toml`` file, or ``.yaml``/``.yml`` when PyYAML is installed.

    Raises:
        TenantsFileError: unreadable, unparsable or invalid (the message names the field).
    """
    p = Path(path)
    return _validate(p, _read_text(p))


def load_registry(path: str | os.PathLike[str]) -> TenantRegistry:
    """Read a tenants file into a :class:`TenantRegistry` (call again on SIGHUP and swap).

    Raises:
        TenantsFileError: see :func:`read_tenants_file`; the shell keeps the old registry then.
    """
    return TenantRegistry.from_file(read_tenants_file(path), source=str(path))


# ----------------------------------------------------------------------------- writing


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # Two `keys add` at once must not lose one of the edits: serialise read-modify-write with
    # an advisory lock on a sidecar file (the tenants file itself is replaced, so cannot be locked).
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: atomic rename still prevents torn files
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, _FILE_MODE)
    except OSError as exc:
        raise TenantsFileError(path, f"cannot lock: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, mode 0600, keeping the old file's owner where allowed."""
    tmp_name = None
    try:
        try:
            owner: os.stat_result | None = path.stat()
        except FileNotFoundError:
            owner = None
        # mkstemp creates the file 0600 from the start: the text is never readable by others, not
        # even between creation and rename.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if owner is not None:
                # An administrator (root) editing a file the server's user owns must not take it
                # away from that user: with 0600, only the owner can read it.
                with contextlib.suppress(OSError):
                    os.fchown(f.fileno(), owner.st_uid, owner.st_gid)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        raise TenantsFileError(path, f"cannot write: {exc.strerror or exc}") from None
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def write_tenants_file(path: str | os.PathLike[str], data: TenantsFile) -> None:
    """Write ``data`` as the whole file ``path`` (atomically, mode 0600); any old text is not kept.

    Raises:
        TenantsFileError: the folder is not writable, or the disk is full.
    """
    p = Path(path)
    _replace_file(p, render(p, data))


def _save(path: Path, doc: TenantsDocument, expected: TenantsFile) -> None:
    # The edited text must mean exactly what was intended before it replaces the file: this is
    # where a layout-preserving edit that went astray (or a duplicate id) is caught.
    text = doc.dumps()
    if _validate(path, text) != expected:
        raise TenantsFileError(path, "the edited file does not read back as intended; left unchanged")
    _replace_file(path, text)


def _open(path: Path) -> tuple[TenantsFile, TenantsDocument]:
    text = _read_text(path)
    return _validate(path, text), open_document(path, text)


def _utc(when: _dt.datetime | None) -> _dt.datetime:
    if when is None:
        return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    return when if when.tzinfo is not None else when.replace(tzinfo=_dt.timezone.utc)


# ----------------------------------------------------------------------------- key operations


def add_key(
    path: str | os.PathLike[str],
    tenant: str,
    *,
    create_tenant: bool = False,
    now: _dt.datetime | None = None,
) -> tuple[str, KeyEntry]:
    """Issue a new key for ``tenant`` and store its digest in the tenants file.

    Args:
        path: the tenants file (created when ``create_tenant`` is set and it does not exist).
        tenant: the tenant's name.
        create_tenant: add the tenant, with default settings, if the file lacks it.
        now: the creation time to record (defaults to the current UTC time).

    Returns:
        ``(key, entry)``: the key itself (show it once; it is not stored) and what was stored.

    Raises:
        UnknownTenant: no such tenant and ``create_tenant`` is false.
        TenantsFileError: the file cannot be read, validated or written.
    """
    p = Path(path)
    with _file_lock(p):
        if p.exists():
            data, doc = _open(p)
        elif create_tenant:
            data, doc = TenantsFile(), open_document(p, None)
        else:
            raise TenantsFileError(p, "no such file (use --create to start one)")
        if tenant not in data.tenants:
            if not create_tenant:
                raise UnknownTenant(tenant)
            if not re.match(TENANT_NAME_PATTERN, tenant):
                raise TenantsFileError(p, f"invalid tenant name {tenant!r}")
            data.tenants[tenant] = TenantConfig()
            doc.add_tenant(tenant)
        existing = {k.id for t in data.tenants.values() for k in t.keys}
        while True:  # an id collision (48 bits) is astronomically rare, but cheap to rule out
            key = generate_key()
            if key_id(key) not in existing:
                break
        entry = KeyEntry(id=key_id(key), hash=hash_key(key), created=_utc(now))
        data.tenants[tenant].keys.append(entry)
        doc.add_key(tenant, entry)
        _save(p, doc, data)
    return key, entry


def list_keys(path: str | os.PathLike[str], tenant: str | None = None) -> list[KeyListing]:
    """The keys in the tenants file (ids and dates only).

    Args:
        path: the tenants file.
        tenant: only this tenant's keys.

    Raises:
        UnknownTenant: ``tenant`` is not in the file.
        TenantsFileError: the file cannot be read or validated.
    """
    data = read_tenants_file(path)
    if tenant is not None and tenant not in data.tenants:
        raise UnknownTenant(tenant)
    return [
        KeyListing(tenant=name, id=k.id, created=k.created, revoked=k.revoked, revoked_at=k.revoked_at)
        for name, cfg in data.tenants.items()
        if tenant is None or name == tenant
        for k in cfg.keys
    ]


def revoke_key(
    path: str | os.PathLike[str],
    key_id_: str,
    *,
    tenant: str | None = None,
    now: _dt.datetime | None = None,
) -> KeyListing:
    """Mark a key revoked (it stays in the file, for the record). Revoking twice is harmless.

    Args:
        path: the tenants file.
        key_id_: the key's id (``ck_...`` as listed).
        tenant: only look in this tenant.
        now: the revocation time to record.

    Raises:
        UnknownKey: no key with that id (in that tenant).
        TenantsFileError: the file cannot be read, validated or written.
    """
    p = Path(path)
    with _file_lock(p):
        data, doc = _open(p)
        for name, cfg in data.tenants.items():
            if tenant is not None and name != tenant:
                continue
            for i, k in enumerate(cfg.keys):
                if k.id == key_id_:
                    if not k.revoked:
                        when = _utc(now)
                        cfg.keys[i] = k.model_copy(update={"revoked": True, "revoked_at": when})
                        doc.mark_revoked(name, k.id, when)
                        _save(p, doc, data)
                    k2 = cfg.keys[i]
                    return KeyListing(tenant=name, id=k2.id, created=k2.created, revoked=True, revoked_at=k2.revoked_at)
    raise UnknownKey(key_id_)
