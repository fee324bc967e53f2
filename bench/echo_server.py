"""Baseline for the robot-path overhead benchmark: a bare ``websockets`` server that answers every
message with the same reply bytes, on the same event loop (uvloop where installed) and the same
transport settings as ``chunkline serve``."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from websockets.asyncio.server import ServerConnection, serve

__all__ = ["main"]


async def _serve(host: str, port_file: Path, reply: bytes) -> None:
    async def echo(ws: ServerConnection) -> None:
        async for _ in ws:
            await ws.send(reply)

    async with serve(echo, host, 0, max_size=64 * 1024 * 1024, compression=None) as server:
        port_file.write_text(str(next(iter(server.sockets)).getsockname()[1]))
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--reply-file", type=Path, required=True)
    args = parser.parse_args()
    reply = args.reply_file.read_bytes()
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args.host, args.port_file, reply))
    else:
        uvloop.run(_serve(args.host, args.port_file, reply))


if __name__ == "__main__":
    main()
