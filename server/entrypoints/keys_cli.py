"""``chunkline keys add|list|revoke`` and ``chunkline ledger summary``: the admin subcommands.

``server/cli.py`` registers them with :func:`add_keys_parser` and :func:`add_ledger_parser`; each
subcommand sets ``func`` (``args.func(args) -> int``), like the other commands. A running server
picks up key changes on SIGHUP (``kill -HUP <pid>``); nothing here talks to it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
import time
from pathlib import Path

from chunkline.server.config import ServerConfig
from chunkline.server.core.ledger import LedgerError, TenantSummary, summarize
from chunkline.server.core.tenants import TenantsFileError, UnknownKey, UnknownTenant, add_key, list_keys, revoke_key
from chunkline.server.entrypoints.cli_errors import UsageError
from chunkline.server.entrypoints.console import aligned_rows

__all__ = ["add_keys_parser", "add_ledger_parser", "parse_since"]

#: where ``serve`` writes its ledger unless told otherwise, and so where ``ledger summary`` looks.
DEFAULT_LEDGER: Path = ServerConfig.model_fields["ledger"].default

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """A ``--since`` value as Unix time.

    Args:
        text: a duration back from now (``90s``, ``30m``, ``24h``, ``7d``, ``2w``), an ISO date
            (``2026-01-05``, midnight UTC) or an ISO date-time (UTC unless it has an offset).
        now: the current Unix time (default: the wall clock).

    Raises:
        ValueError: none of those forms.
    """
    m = _RELATIVE.match(text)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        when = _dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since: expected a duration like 24h or 7d, or an ISO date/time, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.timestamp()


def _fmt_time(t: _dt.datetime | None) -> str:
    return "-" if t is None else t.astimezone(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


# ----------------------------------------------------------------------------- keys


def _cmd_keys_add(args: argparse.Namespace) -> int:
    try:
        key, entry = add_key(args.tenants, args.tenant, create_tenant=args.create)
    except UnknownTenant as exc:
        raise UsageError(f"no tenant {args.tenant!r} in {args.tenants}", "add --create to add it") from exc
    except TenantsFileError as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps({"tenant": args.tenant, "id": entry.id, "key": key, "created": entry.created.isoformat()}))
    else:
        print(f"tenant: {args.tenant}\nid:     {entry.id}\nkey:    {key}")
        print("Store the key now: it is not saved anywhere and cannot be shown again. "
              "Send SIGHUP to a running server to load it.", file=sys.stderr)
    return 0


def _cmd_keys_list(args: argparse.Namespace) -> int:
    try:
        rows = list_keys(args.tenants, args.tenant)
    except UnknownTenant as exc:
        raise UsageError(f"no tenant {args.tenant!r} in {args.tenants}") from exc
    except TenantsFileError as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps([
            {"tenant": r.tenant, "id": r.id, "created": r.created.isoformat(), "revoked": r.revoked,
             "revoked_at": r.revoked_at.isoformat() if r.revoked_at else None}
            for r in rows
        ]))
        return 0
    table = [("TENANT", "KEY ID", "CREATED", "STATUS")]
    table += [(r.tenant, r.id, _fmt_time(r.created), f"revoked {_fmt_time(r.revoked_at)}" if r.revoked else "active") for r in rows]
    print("\n".join(aligned_rows(table)))
    return 0


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    try:
        rec = revoke_key(args.tenants, args.key_id, tenant=args.tenant)
    except UnknownKey as exc:
        raise UsageError(f"no key {args.key_id!r} in {args.tenants}", "`chunkline keys list` shows the ids") from exc
    except TenantsFileError as exc:
        raise UsageError(str(exc)) from exc
    print(f"revoked {rec.id} of tenant {rec.tenant}; send SIGHUP to a running server to apply it")
    return 0


def add_keys_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``keys add|list|revoke``.

    Args:
        subparsers: the ``chunkline`` command's subparsers.

    Returns:
        the ``keys`` parser.
    """
    p: argparse.ArgumentParser = subparsers.add_parser(
        "keys", help="manage API keys in a tenants file", description="Issue, list and revoke API keys (the file's comments are kept)."
    )
    sub = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tenants", type=Path, required=True, metavar="FILE", help="the tenants file (TOML, or YAML with PyYAML)")

    a = sub.add_parser("add", help="issue a new key for a tenant (printed once)")
    common(a)
    a.add_argument("tenant", help="tenant name")
    a.add_argument("--create", action="store_true", help="add the tenant (default settings) and the file if missing")
    a.add_argument("--json", action="store_true", help="print machine-readable JSON")
    a.set_defaults(func=_cmd_keys_add)

    ls = sub.add_parser("list", help="list key ids (never keys)")
    common(ls)
    ls.add_argument("--tenant", default=None, help="only this tenant")
    ls.add_argument("--json", action="store_true", help="print machine-readable JSON")
    ls.set_defaults(func=_cmd_keys_list)

    rv = sub.add_parser("revoke", help="revoke a key by id")
    common(rv)
    rv.add_argument("key_id", help="the key id, as listed (ck_...)")
    rv.add_argument("--tenant", default=None, help="only look in this tenant")
    rv.set_defaults(func=_cmd_keys_revoke)
    return p


# ----------------------------------------------------------------------------- ledger


def _summary_json(rows: list[TenantSummary], since: float | None) -> str:
    return json.dumps({
        "since": since,
        "tenants": [
            {"tenant": r.tenant, "requests": r.requests, "outcomes": r.outcomes, "chunks": r.chunks,
             "tokens_in": r.tokens_in, "tokens_out": r.tokens_out, "infer_s": r.infer_s, "mean_server_ms": r.mean_server_ms}
            for r in rows
        ],
    })


def _cmd_ledger_summary(args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    try:
        rows = summarize(args.db, since)
    except LedgerError as exc:
        raise UsageError(str(exc), "give the ledger `serve` wrote with --db FILE (serve's --ledger)") from exc
    if args.json:
        print(_summary_json(rows, since))
        return 0
    header = ("TENANT", "REQUESTS", "OK", "CHUNKS", "TOKENS IN", "TOKENS OUT", "INFER S", "MEAN MS", "OTHER OUTCOMES")
    table = [header]
    for r in rows:
        other = ", ".join(f"{k}={v}" for k, v in r.outcomes.items() if k != "ok") or "-"
        table.append((
            r.tenant, str(r.requests), str(r.outcomes.get("ok", 0)), str(r.chunks), str(r.tokens_in), str(r.tokens_out),
            f"{r.infer_s:.3f}", "-" if r.mean_server_ms is None else f"{r.mean_server_ms:.1f}", other,
        ))
    if since is not None:
        print(f"since {_dt.datetime.fromtimestamp(since, _dt.timezone.utc).strftime('%Y-%m-%d %H:%M:%SZ')}")
    print("\n".join(aligned_rows(table)))
    if not rows:
        print("(no requests in that period)")
    return 0


def add_ledger_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``ledger summary``.

    Args:
        subparsers: the ``chunkline`` command's subparsers.

    Returns:
        the ``ledger`` parser.
    """
    p: argparse.ArgumentParser = subparsers.add_parser(
        "ledger", help="read the usage ledger", description="Usage per tenant from the ledger."
    )
    sub = p.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")
    s = sub.add_parser("summary", help="usage per tenant")
    s.add_argument("--db", type=Path, default=DEFAULT_LEDGER, metavar="FILE",
                   help=f"the ledger database (SQLite; default {DEFAULT_LEDGER}, where `serve` writes it when run in this directory)")
    s.add_argument("--since", default=None, help="a duration back from now (24h, 7d) or an ISO date/time (UTC)")
    s.add_argument("--json", action="store_true", help="print machine-readable JSON")
    s.set_defaults(func=_cmd_ledger_summary)
    return p
