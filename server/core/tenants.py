"""Tenants: who may call the server, with which keys, on which models, within which limits.

The tenants file (TOML, or YAML when PyYAML is importable) is validated by pydantic
(:class:`TenantsFile`) and turned into an immutable :class:`TenantRegistry`. The registry is a
value: the asyncio shell loads a new one on SIGHUP (:func:`load_registry`) and swaps the
reference it hands to the authenticator and the quota manager; sessions already open keep
their tenant name and their counters, so a reload never drops them.

API keys are ``ck_<43 url-safe characters>`` (256 random bits from :mod:`secrets`). The file
stores only ``sha256:<hex>`` digests and a short id for listing. ``chunkline keys add/list/revoke``
(:mod:`chunkline.server.entrypoints.keys_cli`) edits the file through :func:`add_key`, :func:`list_keys` and
:func:`revoke_key`, which rewrite it atomically (temp file + rename, under a lock file) so that a
server reloading at the same moment reads either the old file or the new one, never half of one.
Rewriting drops comments: the file is a machine-managed record, documented by its own header.

Example::

    version = 1

    [tenants.acme]
    weight = 2.0                # fair share under contention, relative to other tenants
    priority = 0                # higher is served first
    reserved_share = 0.25       # of each model's max concurrency, held for this tenant
    models = ["*"]
    classes = ["policy"]
    default_deadline_ms = 150.0

    [tenants.acme.limits]
    max_sessions = 16
    max_in_flight = 64
    rate_per_s = 200.0
    burst = 400

    [[tenants.acme.keys]]
    id = "ck_3fQ9aZ1x"
    hash = "sha256:..."
    created = 2026-01-05T10:00:00+00:00
    revoked = false
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import importlib
import math
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

__all__ = [
    "RequestClass",
    "REQUEST_CLASSES",
    "KEY_PREFIX",
    "TenantsFileError",
    "UnknownTenant",
    "UnknownKey",
    "KeyEntry",
    "LimitsConfig",
    "TenantConfig",
    "TenantsFile",
    "Limits",
    "TenantInfo",
    "KeyRecord",
    "KeyListing",
    "TenantRegistry",
    "ANONYMOUS_TENANT",
    "generate_key",
    "hash_key",
    "key_id",
    "read_tenants_file",
    "write_tenants_file",
    "dumps_toml",
    "load_registry",
    "add_key",
    "list_keys",
    "revoke_key",
]

#: The request classes the serving core knows.
RequestClass = Literal["policy", "text"]
REQUEST_CLASSES: tuple[str, ...] = ("policy", "text")

KEY_PREFIX = "ck_"
#: Characters of the random part shown in a key id (``ck_`` + 8 = 48 of the 256 bits): enough to
#: tell keys apart in a listing, and 208 secret bits remain.
_ID_CHARS = 8
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_HEADER = (
    "# chunkline tenants file, managed by `chunkline keys add|list|revoke`.\n"
    "# API keys are stored only as SHA-256 digests. Rewrites drop comments.\n"
)


class TenantsFileError(Exception):
    """The tenants file cannot be read, parsed, validated or written.

    Args:
        path: the file.
        detail: what is wrong (never a key).
    """

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = str(path)
        self.detail = detail


class UnknownTenant(KeyError):
    """No tenant of that name in the tenants file."""


class UnknownKey(KeyError):
    """No key with that id in the tenants file."""


# ----------------------------------------------------------------------------- file models


class _Strict(BaseModel):
    # A typo in a limits table must fail loudly, not silently disable the limit.
    model_config = ConfigDict(extra="forbid")


class KeyEntry(_Strict):
    """One API key of a tenant, as stored (a digest, never the key).

    Args:
        id: short public id (``ck_`` + the key's first 8 random characters), for listing.
        hash: ``sha256:<64 hex>`` digest of the whole key.
        created: when it was issued (UTC).
        revoked: a revoked key no longer authenticates.
        revoked_at: when it was revoked.
    """

    id: Annotated[str, Field(pattern=r"^ck_[A-Za-z0-9_-]{1,32}$")]
    hash: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    created: _dt.datetime
    revoked: bool = False
    revoked_at: _dt.datetime | None = None


class LimitsConfig(_Strict):
    """A tenant's limits; ``None`` means unlimited.

    Args:
        max_sessions: concurrent sessions (WebSocket connections).
        max_in_flight: requests admitted and not finished (queued + running), all models.
        rate_per_s: sustained request rate (token bucket refill).
        burst: token bucket depth; defaults to ``max(1, ceil(rate_per_s))``.
        text_tokens_per_window: text tokens (prompt + output) per ``text_window_s``; a text request
            reserves prompt + max_tokens at admission and is reconciled with actual usage after.
        text_window_s: the budget window.
    """

    max_sessions: Annotated[int, Field(ge=0)] | None = None
    max_in_flight: Annotated[int, Field(ge=0)] | None = None
    rate_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    burst: Annotated[int, Field(ge=1)] | None = None
    text_tokens_per_window: Annotated[int, Field(ge=1)] | None = None
    text_window_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 60.0

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> LimitsConfig:
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst needs rate_per_s")
        return self


def _all_classes() -> list[RequestClass]:
    return ["policy", "text"]


class TenantConfig(_Strict):
    """One tenant.

    Args:
        weight: share of contended capacity relative to other tenants (weighted fair queueing).
        priority: higher is served first; ``class_priority`` overrides it per request class.
        reserved_share: fraction of each model's max concurrency held for this tenant.
        models: model names it may use; ``"*"`` for all.
        classes: request classes it may use (``policy``, ``text``).
        default_deadline_ms: deadline for its requests that carry none (openpi-compatible mode);
            ``None`` uses the policy's.
        limits: see :class:`LimitsConfig`.
        keys: its API keys (digests).
    """

    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    priority: int = 0
    class_priority: dict[RequestClass, int] = Field(default_factory=dict)
    reserved_share: Annotated[float, Field(ge=0, le=1)] = 0.0
    models: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(default_factory=lambda: ["*"])
    classes: list[RequestClass] = Field(default_factory=lambda: _all_classes())
    default_deadline_ms: Annotated[float, Field(gt=0, le=3_600_000)] | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    keys: list[KeyEntry] = Field(default_factory=list)


class TenantsFile(_Strict):
    """The whole tenants file.

    Args:
        version: format version (1).
        tenants: tenant name to its settings.
    """

    version: Literal[1] = 1
    tenants: dict[Annotated[str, Field(pattern=_NAME_RE)], TenantConfig] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _unique_keys(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        ids: set[str] = set()
        hashes: set[str] = set()
        for name, tenant in tenants.items():
            for key in tenant.keys:
                if key.id in ids:
                    raise ValueError(f"key id {key.id} appears twice (tenant {name})")
                if key.hash in hashes:
                    raise ValueError(f"the same key digest appears twice (tenant {name}, id {key.id})")
                ids.add(key.id)
                hashes.add(key.hash)
        total = sum(t.reserved_share for t in tenants.values())
        if total > 1.0 + 1e-9:
            raise ValueError(f"reserved_share adds up to {total:.3f} > 1")
        return tenants


# ----------------------------------------------------------------------------- runtime view


@dataclasses.dataclass(frozen=True)
class Limits:
    """A tenant's limits at runtime (``None``: unlimited). Fields as in :class:`LimitsConfig`."""

    max_sessions: int | None = None
    max_in_flight: int | None = None
    rate_per_s: float | None = None
    burst: float | None = None
    text_tokens_per_window: int | None = None
    text_window_s: float = 60.0

    @classmethod
    def from_config(cls, cfg: LimitsConfig) -> Limits:
        burst: float | None = None
        if cfg.rate_per_s is not None:
            burst = float(cfg.burst if cfg.burst is not None else max(1, math.ceil(cfg.rate_per_s)))
        return cls(
            max_sessions=cfg.max_sessions,
            max_in_flight=cfg.max_in_flight,
            rate_per_s=cfg.rate_per_s,
            burst=burst,
            text_tokens_per_window=cfg.text_tokens_per_window,
            text_window_s=cfg.text_window_s,
        )


@dataclasses.dataclass(frozen=True)
class TenantInfo:
    """What the serving core needs to know about a tenant (immutable).

    Args:
        name: tenant name (a metrics label and ledger column; never secret).
        weight: fair-share weight.
        priority: default priority (higher first).
        class_priority: per request class overrides.
        reserved_share: fraction of each model's max concurrency held for it.
        models: allowed model names; ``None`` means all.
        classes: allowed request classes.
        default_deadline_ms: default deadline budget, or ``None``.
        limits: its :class:`Limits`.
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    class_priority: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reserved_share: float = 0.0
    models: frozenset[str] | None = None
    classes: frozenset[str] = frozenset(REQUEST_CLASSES)
    default_deadline_ms: float | None = None
    limits: Limits = Limits()

    def may_use(self, model: str, cls: str) -> bool:
        """Whether this tenant may send ``cls`` requests to ``model``."""
        return cls in self.classes and (self.models is None or model in self.models)

    def priority_for(self, cls: str) -> int:
        """The priority of this tenant's requests of class ``cls``."""
        return self.class_priority.get(cls, self.priority)

    @classmethod
    def from_config(cls, name: str, cfg: TenantConfig) -> TenantInfo:
        return cls(
            name=name,
            weight=cfg.weight,
            priority=cfg.priority,
            class_priority={str(k): v for k, v in cfg.class_priority.items()},
            reserved_share=cfg.reserved_share,
            models=None if "*" in cfg.models else frozenset(cfg.models),
            classes=frozenset(cfg.classes),
            default_deadline_ms=cfg.default_deadline_ms,
            limits=Limits.from_config(cfg.limits),
        )


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """An active key as the authenticator sees it: its digest and whose it is."""

    digest: bytes
    tenant: str
    key_id: str


@dataclasses.dataclass(frozen=True)
class KeyListing:
    """One row of ``chunkline keys list`` (no digest, no key)."""

    tenant: str
    id: str
    created: _dt.datetime
    revoked: bool
    revoked_at: _dt.datetime | None


ANONYMOUS_TENANT = TenantInfo(name="anonymous")


class TenantRegistry:
    """An immutable snapshot of the tenants file: tenants by name and the active key digests.

    Build it with :func:`load_registry`, :meth:`from_file` or :meth:`anonymous`. Swapping the
    registry (on SIGHUP) is replacing a reference; nothing in it ever changes.

    Args:
        tenants: tenant name to :class:`TenantInfo`.
        keys: the active (not revoked) keys.
        source: where it was loaded from (for logs).
    """

    __slots__ = ("_tenants", "_keys", "_key_ids", "source")

    def __init__(self, tenants: Mapping[str, TenantInfo], keys: tuple[KeyRecord, ...] = (), source: str = "") -> None:
        self._tenants = dict(tenants)
        self._keys = tuple(keys)
        self._key_ids = frozenset((k.tenant, k.key_id) for k in self._keys)
        self.source = source

    @classmethod
    def from_file(cls, data: TenantsFile, source: str = "") -> TenantRegistry:
        """Build a registry from a validated tenants file."""
        tenants = {name: TenantInfo.from_config(name, cfg) for name, cfg in data.tenants.items()}
        keys = tuple(
            KeyRecord(digest=bytes.fromhex(k.hash.split(":", 1)[1]), tenant=name, key_id=k.id)
            for name, cfg in data.tenants.items()
            for k in cfg.keys
            if not k.revoked
        )
        return cls(tenants, keys, source)

    @classmethod
    def anonymous(cls) -> TenantRegistry:
        """The registry of ``--no-auth``: one tenant, ``anonymous``, without limits and without keys."""
        return cls({ANONYMOUS_TENANT.name: ANONYMOUS_TENANT}, (), "--no-auth")

    @property
    def keys(self) -> tuple[KeyRecord, ...]:
        """The active keys, in file order."""
        return self._keys

    @property
    def tenants(self) -> Mapping[str, TenantInfo]:
        """Tenant name to :class:`TenantInfo` (a copy)."""
        return dict(self._tenants)

    def get(self, name: str) -> TenantInfo | None:
        """The tenant named ``name``, or ``None`` (e.g. removed by a reload)."""
        return self._tenants.get(name)

    def key_active(self, tenant: str, key_id: str) -> bool:
        """Whether ``key_id`` of ``tenant`` still authenticates (a shell may re-check sessions after a reload)."""
        return (tenant, key_id) in self._key_ids

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    def __len__(self) -> int:
        return len(self._tenants)

    def __repr__(self) -> str:
        return f"TenantRegistry({len(self._tenants)} tenants, {len(self._keys)} active keys, source={self.source!r})"


# ----------------------------------------------------------------------------- keys


def generate_key() -> str:
    """A new API key: ``ck_`` + 43 url-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of ``key``: ``sha256:<hex>``.

    One unsalted SHA-256 is right here, unlike for passwords: keys are 256-bit random strings, so
    neither salting nor a slow hash adds anything against guessing or precomputation (2^256 is out
    of reach either way), while a fast hash keeps authentication cheap on every request.
    """
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key: str) -> str:
    """The public id of ``key``: ``ck_`` + its first 8 random characters."""
    if not key.startswith(KEY_PREFIX) or len(key) <= len(KEY_PREFIX) + _ID_CHARS:
        raise ValueError("not a chunkline key")
    return key[: len(KEY_PREFIX) + _ID_CHARS]


# ----------------------------------------------------------------------------- reading and writing


def _is_yaml(path: Path) -> bool:
    return path.suffix.lower() in (".yaml", ".yml")


def _import_yaml() -> Any:
    try:
        return importlib.import_module("yaml")
    except ImportError:  # YAML support is optional: PyYAML is not a dependency
        return None


def read_tenants_file(path: str | os.PathLike[str]) -> TenantsFile:
    """Read and validate a tenants file.

    Args:
        path: a ``.toml`` file, or ``.yaml``/``.yml`` when PyYAML is installed.

    Raises:
        TenantsFileError: unreadable, unparsable or invalid (the message names the field).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise TenantsFileError(p, f"cannot read: {exc.strerror or exc}") from None
    try:
        if _is_yaml(p):
            yaml = _import_yaml()
            if yaml is None:
                raise TenantsFileError(p, "YAML tenants files need PyYAML (pip install pyyaml); or use TOML")
            data = yaml.safe_load(raw.decode("utf-8")) or {}
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except TenantsFileError:
        raise
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError
        raise TenantsFileError(p, f"cannot parse: {exc}") from None
    try:
        return TenantsFile.model_validate(data)
    except ValidationError as exc:
        errs = exc.errors(include_url=False, include_input=False)
        where = ".".join(str(x) for x in errs[0]["loc"]) or "file"
        raise TenantsFileError(p, f"{where}: {errs[0]['msg']}" + (f" (+{len(errs) - 1} more)" if len(errs) > 1 else "")) from None


def load_registry(path: str | os.PathLike[str]) -> TenantRegistry:
    """Read a tenants file into a :class:`TenantRegistry` (call again on SIGHUP and swap).

    Raises:
        TenantsFileError: see :func:`read_tenants_file`; the shell keeps the old registry then.
    """
    return TenantRegistry.from_file(read_tenants_file(path), source=str(path))


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)  # fullmatch: "$" would accept a trailing newline


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("TOML tenants files hold finite numbers only")
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, _dt.datetime):
        when = v if v.tzinfo is not None else v.replace(tzinfo=_dt.timezone.utc)
        return when.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, dict) for x in v)


def _dump_table(lines: list[str], path: tuple[str, ...], table: Mapping[str, Any]) -> None:
    # Plain values first: in TOML they belong to the most recent header.
    for k, v in table.items():
        if v is None or isinstance(v, dict) or _is_table_list(v):
            continue
        lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    for k, v in table.items():
        if isinstance(v, dict):
            sub = path + (k,)
            plain = [x for x in v.values() if x is not None and not isinstance(x, dict) and not _is_table_list(x)]
            if plain or not v:  # a table holding only tables needs no header of its own
                lines.append("")
                lines.append("[" + ".".join(_toml_key(p) for p in sub) + "]")
            _dump_table(lines, sub, v)
    for k, v in table.items():
        if _is_table_list(v):
            sub = path + (k,)
            for item in v:
                lines.append("")
                lines.append("[[" + ".".join(_toml_key(p) for p in sub) + "]]")
                _dump_table(lines, sub, item)


def dumps_toml(data: Mapping[str, Any]) -> str:
    """Serialise a mapping of TOML-representable values (``None`` entries are left out)."""
    lines: list[str] = []
    _dump_table(lines, (), data)
    return "\n".join(lines).lstrip("\n") + "\n"


def _prune_empty(obj: dict[str, Any]) -> dict[str, Any]:
    # Empty sub-tables (e.g. no class_priority) are defaults: leave them out of the file.
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            v = _prune_empty(v)
            if not v and k != "tenants":
                continue
        elif isinstance(v, list):
            v = [_prune_empty(x) if isinstance(x, dict) else x for x in v]
        out[k] = v
    return out


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
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise TenantsFileError(path, f"cannot lock: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_tenants_file(path: str | os.PathLike[str], data: TenantsFile) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename).

    A new file gets mode 0600; an existing file keeps its mode.

    Raises:
        TenantsFileError: the folder is not writable, or the disk is full.
    """
    p = Path(path)
    obj = _prune_empty(data.model_dump(mode="python", exclude_none=True))
    if _is_yaml(p):
        yaml = _import_yaml()
        if yaml is None:
            raise TenantsFileError(p, "YAML tenants files need PyYAML (pip install pyyaml); or use TOML")
        text = _HEADER + yaml.safe_dump(obj, sort_keys=False)
    else:
        text = _HEADER + "\n" + dumps_toml(obj)
    tmp_name = None
    try:
        try:
            mode = p.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o600
        fd, tmp_name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, p)
        tmp_name = None
        with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
            dfd = os.open(p.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        raise TenantsFileError(p, f"cannot write: {exc.strerror or exc}") from None
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


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
            data = read_tenants_file(p)
        elif create_tenant:
            data = TenantsFile()
        else:
            raise TenantsFileError(p, "no such file (use --create to start one)")
        if tenant not in data.tenants:
            if not create_tenant:
                raise UnknownTenant(tenant)
            if not re.match(_NAME_RE, tenant):
                raise TenantsFileError(p, f"invalid tenant name {tenant!r}")
            data.tenants[tenant] = TenantConfig()
        existing = {k.id for t in data.tenants.values() for k in t.keys}
        while True:  # an id collision (48 bits) is astronomically rare, but cheap to rule out
            key = generate_key()
            if key_id(key) not in existing:
                break
        entry = KeyEntry(id=key_id(key), hash=hash_key(key), created=now or _utcnow())
        data.tenants[tenant].keys.append(entry)
        write_tenants_file(p, TenantsFile.model_validate(data.model_dump()))
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
        data = read_tenants_file(p)
        for name, cfg in data.tenants.items():
            if tenant is not None and name != tenant:
                continue
            for i, k in enumerate(cfg.keys):
                if k.id == key_id_:
                    if not k.revoked:
                        cfg.keys[i] = k.model_copy(update={"revoked": True, "revoked_at": now or _utcnow()})
                        write_tenants_file(p, data)
                    k2 = cfg.keys[i]
                    return KeyListing(tenant=name, id=k2.id, created=k2.created, revoked=True, revoked_at=k2.revoked_at)
    raise UnknownKey(key_id_)
