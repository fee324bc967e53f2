"""The flags of ``chunkline serve`` and the server configuration they make (also the replica
template of ``chunkline cluster up``)."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any

from chunkline.server.entrypoints.cli_errors import UsageError, one_line_validation_error, port_in_use_error

__all__ = ["add_server_flags", "server_config_from_args", "check_before_start", "check_port_free"]


class _PolicyFlag(argparse.Action):
    """Keeps --policy, --policy-arg and --name in order: an argument or a name belongs to the --policy before it."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any, option: str | None = None) -> None:
        ns.policy_flags = [*(getattr(ns, "policy_flags", None) or []), (self.dest, value)]
        setattr(ns, self.dest, [*(getattr(ns, self.dest) or []), value])


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``chunkline serve`` (also the replica template of ``chunkline cluster up``)."""
    p.add_argument(
        "--policy",
        action=_PolicyFlag,
        default=None,
        metavar="REF",
        help="embedded name (noop, loadtest, loadtest-compute, ...), .npz path or module:factory;"
        " repeat to serve several (the first is the default)",
    )
    p.add_argument("--policy-arg", action=_PolicyFlag, metavar="KEY=VALUE", help="argument of the --policy before it (fps=30)")
    p.add_argument("--name", action=_PolicyFlag, metavar="NAME", help="model name clients ask for, for the --policy before it")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... for every --policy")
    p.add_argument("--backend", default=None, choices=["torch", "jax", "numpy"], help="implementation of embedded policies")
    p.add_argument("--config", type=Path, default=None, help="TOML server config; flags override it")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here once listening")
    p.add_argument("--max-message-bytes", type=int, default=None, help="largest message accepted (larger: close 1009)")
    p.add_argument("--max-receive-buffer-bytes", type=int, default=None,
                   help="most bytes all sessions may hold in messages not taken yet (past it: the largest holder closed 1013)")
    p.add_argument("--tenant-receive-buffer-share", type=float, default=None,
                   help="the share of --max-receive-buffer-bytes one tenant's sessions may hold (default 0.5)")
    p.add_argument("--max-queued-messages", type=int, default=None,
                   help="complete messages a connection may queue before the server stops reading it (default 16)")
    p.add_argument(
        "--shutdown-grace", type=float, default=None, dest="shutdown_grace_s", help="seconds SIGTERM waits for in-flight requests"
    )
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--tenants", type=Path, default=None, help="tenants file (keys, grants, limits); reloaded on SIGHUP")
    auth.add_argument("--no-auth", action="store_true", default=None, help="no authentication: local use only")
    ledger = p.add_mutually_exclusive_group()
    ledger.add_argument("--ledger", type=Path, default=None, help="usage ledger, SQLite (default ./chunkline-ledger.db)")
    ledger.add_argument("--no-ledger", action="store_true", help="keep no usage ledger")
    p.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port of 127.0.0.1 (0: any free)")
    p.add_argument("--max-batch-size", type=int, default=None, help="most robots per forward pass (1: one at a time)")
    p.add_argument("--max-batch-wait-ms", type=float, default=None, help="longest wait on an idle lane for a batch to fill")
    p.add_argument("--lanes", type=int, default=None, help="execution threads per policy")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads per lane of a CPU policy (default: OMP_NUM_THREADS, else the usable "
                        "cores less one, shared by the CPU policies' lanes)")
    p.add_argument(
        "--background-timing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="once serving, time the larger batch sizes in quiet spells (default on); "
             "--no-background-timing learns them from first use only",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        dest="hang_timeout_s",
        help="seconds after which a running batch is declared hung and its lane replaced",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve wss:// and https://")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    p.add_argument("--max-connections-per-address", type=int, default=None, help="most open connections from one client address")
    p.add_argument(
        "--send-timeout",
        type=float,
        default=None,
        dest="send_timeout_s",
        help="seconds a reply may wait for a client that does not read before it is disconnected",
    )
    p.add_argument(
        "--text-model",
        action="append",
        default=None,
        metavar="NAME",
        help="serve the embedded load-test text model under NAME (repeatable)",
    )
    p.add_argument(
        "--text-upstream",
        action="append",
        default=None,
        metavar="NAME=URL",
        help="forward text model NAME to an OpenAI-compatible engine at URL (e.g. http://host:8000/v1)",
    )
    p.add_argument(
        "--planner",
        action="append",
        default=None,
        metavar="NAME[=BACKEND]",
        help="serve a planner to native `plan` messages (repeatable): NAME is the embedded nearest-target planner "
             "under NAME, NAME=BACKEND picks the backend (embedded, constrained)",
    )
    p.add_argument("--http-port", type=int, default=None, help="port of the OpenAI-compatible HTTP API (0: any free)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one object per line (time, level, logger, message, fields)")


def _read_config_file(path: Path) -> dict[str, Any]:
    """``--config``'s file as a TOML document (validated later, with the flags over it), or a
    :class:`UsageError` naming what is wrong."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read the config file {str(path)!r}: {exc.strerror or exc}", "check the --config path") from exc
    except ValueError as exc:  # TOML syntax (tomllib.TOMLDecodeError is a ValueError)
        raise UsageError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc


#: flags whose value replaces the file's key of the same name
_TOP_LEVEL = ("host", "port", "port_file", "max_message_bytes", "max_receive_buffer_bytes", "tenant_receive_buffer_share",
              "shutdown_grace_s", "tenants", "ledger", "metrics_port", "tls_cert", "tls_key", "max_connections_per_address",
              "send_timeout_s", "http_port", "max_queued_messages")
#: flags that apply to every policy (``[[policies]]`` keys)
_PER_POLICY = ("device", "backend", "max_batch_size", "max_batch_wait_ms", "lanes", "background_timing",
               "hang_timeout_s", "torch_threads")


def _flag_updates(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, Any]:
    """The settings the flags give, each replacing the file's (``doc``) key."""
    from chunkline.server.robot.config import policies_from_flags

    updates: dict[str, Any] = {k: getattr(args, k) for k in _TOP_LEVEL if getattr(args, k, None) is not None}
    if args.no_auth:
        updates["no_auth"] = True
    if args.no_ledger:
        updates["ledger"] = None
    try:
        flagged = policies_from_flags(getattr(args, "policy_flags", None) or [])
    except ValueError as exc:
        raise UsageError(one_line_validation_error(exc) if hasattr(exc, "errors") else str(exc),
                         "write --policy-arg KEY=VALUE after the --policy it is for") from exc
    per_policy = {k: getattr(args, k) for k in _PER_POLICY if getattr(args, k, None) is not None}
    if flagged:
        policies: list[Any] = [pc.model_dump(exclude_unset=True) for pc in flagged]
    else:
        policies = doc.get("policies") or [{"ref": "loadtest"}]
    if flagged or per_policy or "policies" not in doc:
        updates["policies"] = [{**p, **per_policy} if isinstance(p, dict) else p for p in policies]
    text = [{"name": n} for n in args.text_model or []]
    for spec in args.text_upstream or []:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise UsageError(f"--text-upstream wants NAME=URL, got {spec!r}", "e.g. --text-upstream llama=http://127.0.0.1:8001/v1")
        text.append({"name": name, "backend": "upstream", "upstream_url": url})
    if text:
        updates["text"] = text
    if getattr(args, "planner", None):
        updates["planners"] = [planner_from_flag(v) for v in args.planner]
    return updates


#: planner backends a ``--planner`` flag may name (``upstream`` needs a URL: the config file's ``[[planners]]``)
PLANNER_FLAG_BACKENDS = ("embedded", "constrained")


def planner_from_flag(value: str) -> dict[str, str]:
    """``--planner NAME`` (the embedded planner under NAME; a backend's own name selects it) or
    ``--planner NAME=BACKEND``. A name one typo away from a backend, or an unknown backend, is a
    :class:`UsageError` rather than a silently embedded planner."""
    import difflib

    name, sep, backend = value.partition("=")
    if not name:
        raise UsageError(f"--planner wants NAME or NAME=BACKEND, got {value!r}")
    known = ", ".join(PLANNER_FLAG_BACKENDS)
    if sep:
        if backend not in PLANNER_FLAG_BACKENDS:
            guess = difflib.get_close_matches(backend, PLANNER_FLAG_BACKENDS, n=1)
            hint = f"did you mean {name}={guess[0]}? " if guess else ""
            raise UsageError(f"--planner {value!r}: no planner backend {backend!r}",
                             f"{hint}known: {known} (upstream planners go in the config file's [[planners]])")
        return {"name": name, "backend": backend}
    if name in PLANNER_FLAG_BACKENDS:
        return {"name": name, "backend": name}
    guess = difflib.get_close_matches(name, [*PLANNER_FLAG_BACKENDS, "upstream"], n=1, cutoff=0.75)
    if guess:
        raise UsageError(f"--planner {name!r} is one typo from the backend {guess[0]!r}",
                         f"write --planner {guess[0]} for that backend, or --planner {name}=embedded for a planner named so")
    return {"name": name}


def server_config_from_args(args: argparse.Namespace) -> Any:
    """A ``ServerConfig`` from :func:`add_server_flags`' flags over ``--config``'s file: a flag
    replaces the file's key (``--no-auth`` and ``--tenants`` replace the file's choice of either).

    Raises:
        UsageError: no tenants file and no ``--no-auth``, an unreadable or invalid ``--config``,
            a malformed ``--text-upstream``, or settings that do not validate.
    """
    from pydantic import ValidationError

    from chunkline.server.config import ServerConfig

    if args.config is None and not args.tenants and not args.no_auth:
        raise UsageError("no tenants file", "give one with --tenants FILE or, for local use only, --no-auth")
    doc = _read_config_file(args.config) if args.config else {}
    updates = _flag_updates(args, doc)
    if args.no_auth or args.tenants is not None:  # either flag settles authentication, whatever the file said
        doc = {k: v for k, v in doc.items() if k not in ("tenants", "no_auth")}
    try:
        return ServerConfig.model_validate({**doc, **updates})
    except ValidationError as exc:
        problem = one_line_validation_error(exc, ServerConfig.model_fields, model=ServerConfig)
        if args.config is None:
            raise UsageError(problem) from exc
        raise UsageError(f"config file {str(args.config)!r} with the flags: {problem}",
                         "see docs/configuration.md for every setting") from exc


def check_port_free(host: str, port: int | None, what: str, flag: str) -> None:
    """Raise a :class:`UsageError` when ``host:port`` cannot be bound because something listens
    there (checked before a server starts, so the user gets one line instead of a start-up that
    fails half-way; a port taken between this check and the real bind still fails, at start)."""
    if not port:
        return
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        probe.bind((host, port))
    except OSError as exc:
        error = port_in_use_error(exc, f"{what} port {port}", flag)
        if error is not None:
            raise error from exc
        raise UsageError(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}", f"check {flag} and --host") from exc
    finally:
        probe.close()


def check_before_start(config: Any) -> None:
    """What a server would only find out half-way through starting, checked first: the tenants
    file reads and validates, every ``--policy`` names something loadable, the ports are free.

    Raises:
        UsageError: the first of those that fails.
    """
    from chunkline.policies.exceptions import PolicyError
    from chunkline.policies.registry import check_reference
    from chunkline.server.core.tenants import TenantsFileError, load_registry

    if config.tenants is not None and not config.no_auth:
        try:
            load_registry(config.tenants)
        except TenantsFileError as exc:
            fix = "fix it, or create one with `chunkline keys add --tenants FILE --create TENANT`"
            raise UsageError(f"tenants file {exc}", fix) from exc
    for policy in config.policies:
        try:
            check_reference(policy.ref, policy.backend)
        except PolicyError as exc:
            raise UsageError(str(exc).rstrip("."), "fix --policy (or the config file's [[policies]])") from exc
    check_port_free(config.host, config.port, "the WebSocket", "--port")
    if config.metrics_port is not None:
        check_port_free(config.metrics_host, config.metrics_port, "the metrics", "--metrics-port")
    if config.http_port is not None:
        check_port_free(config.host, config.http_port, "the HTTP API", "--http-port")
