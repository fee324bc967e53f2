"""Tenants: who may call the server, with which keys, on which models, within which limits.

The tenants file (TOML, or YAML when PyYAML is importable) is validated by pydantic
(:class:`TenantsFile`, in ``schema``) and turned into an immutable :class:`TenantRegistry`
(``registry``). The registry is a value: the asyncio shell loads a new one on SIGHUP
(:func:`load_registry`) and swaps the reference it hands to the authenticator and the quota
manager; sessions already open keep their tenant name and their counters, so a reload never drops
them.

API keys are ``ck_<43 url-safe characters>`` (256 random bits, ``keys``). The file stores only
``sha256:<hex>`` digests and a short id for listing. ``chunkline keys add/list/revoke``
(:mod:`chunkline.server.entrypoints.keys_cli`) edits the file through :func:`add_key`,
:func:`list_keys` and :func:`revoke_key` (``store``), which edit the text in place, keeping the
operator's comments and layout (``documents``), and replace the file atomically, mode 0600, under a
lock file.

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

from chunkline.server.core.tenants.errors import TenantsFileError, UnknownKey, UnknownTenant
from chunkline.server.core.tenants.keys import KEY_PREFIX, generate_key, hash_key, key_id
from chunkline.server.core.tenants.registry import ANONYMOUS_TENANT, KeyRecord, TenantInfo, TenantLimits, TenantRegistry
from chunkline.server.core.tenants.schema import REQUEST_CLASSES, KeyEntry, LimitsConfig, RequestClass, TenantConfig, TenantsFile
from chunkline.server.core.tenants.store import (
    KeyListing,
    add_key,
    list_keys,
    load_registry,
    read_tenants_file,
    revoke_key,
    write_tenants_file,
)

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
    "TenantLimits",
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
    "load_registry",
    "add_key",
    "list_keys",
    "revoke_key",
]
