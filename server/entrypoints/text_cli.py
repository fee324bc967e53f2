"""``python -m chunkline.server.entrypoints.text_cli``: a text-only server (the OpenAI-compatible API alone).

For benchmarks, for a second server that a gateway's upstream adapter points at, and for trying
the text path before it is wired into ``chunkline serve``. It builds the same core objects the
main server shares with text (authenticator, quotas, metrics, ledger) and runs one
:class:`~chunkline.server.text.service.TextService` and its HTTP API until SIGTERM/SIGINT.

Models come as JSON objects of :class:`~chunkline.server.text.config.TextModelConfig` fields
(``--model-json '{"name": "tiny", "max_batch": 16}'``, repeatable) or, for the embedded model
with defaults, ``--model NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m chunkline.server.entrypoints.text_cli",
                                description="Serve text models on the OpenAI-compatible API.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here once listening")
    auth = p.add_mutually_exclusive_group(required=True)
    auth.add_argument("--tenants", type=Path, help="tenants file (keys, grants, limits)")
    auth.add_argument("--no-auth", action="store_true", help="no authentication: local use only")
    p.add_argument("--ledger", type=Path, default=None, help="usage ledger (SQLite); none by default")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve https://")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    p.add_argument("--model", action="append", default=[], help="an embedded model with default settings")
    p.add_argument("--model-json", action="append", default=[], help="a model's settings as a JSON object")
    p.add_argument("--log-level", default="INFO")
    return p


async def _serve(args: argparse.Namespace) -> None:
    from chunkline.server.core.auth import NO_AUTH_WARNING
    from chunkline.server.core.serving import ServingCore
    from chunkline.server.core.tenants import TenantRegistry, load_registry
    from chunkline.server.entrypoints.http import HttpLimits, HttpServer, OpenAIApi
    from chunkline.server.text.config import TextModelConfig
    from chunkline.server.text.service import TextService

    models = [TextModelConfig(name=n) for n in args.model] + [TextModelConfig.model_validate(json.loads(s)) for s in args.model_json]
    if not models:
        models = [TextModelConfig(name="tiny")]
    if args.no_auth:
        logging.getLogger("chunkline.server.text").warning(NO_AUTH_WARNING)
    registry = TenantRegistry.anonymous() if args.no_auth else load_registry(args.tenants)
    core = ServingCore(registry, authenticate=not args.no_auth, ledger_path=args.ledger)
    service = TextService(core, models=models)
    await service.start()
    http = HttpServer(OpenAIApi(service), HttpLimits(tls_cert=args.tls_cert, tls_key=args.tls_key))
    port = await http.start(args.host, args.port)
    if args.port_file is not None:
        args.port_file.write_text(str(port))
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    await stopped.wait()
    core.draining = True  # new requests get 503 at once; streams in flight finish
    await http.close()
    await service.stop()
    await loop.run_in_executor(None, core.close)


def main(argv: list[str] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
