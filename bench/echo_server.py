"""Baselines for the robot-path overhead benchmark: a bare WebSocket server that answers every
message with the same reply bytes, on the same event loop (uvloop where installed) and transport
settings as ``chunkline serve``: ``websockets`` (the library the server builds on) or ``picows``
(a Cython WebSocket library, the fastest Python echo measured)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

__all__ = ["main"]

_MAX_BYTES = 64 * 1024 * 1024


async def _serve_websockets(host: str, port_file: Path, reply: bytes) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    async def echo(ws: ServerConnection) -> None:
        async for _ in ws:
            await ws.send(reply)

    async with serve(echo, host, 0, max_size=_MAX_BYTES, compression=None) as server:
        port_file.write_text(str(next(iter(server.sockets)).getsockname()[1]))
        await server.serve_forever()


async def _serve_picows(host: str, port_file: Path, reply: bytes) -> None:
    from picows import WSFrame, WSListener, WSMsgType, WSTransport, WSUpgradeRequest, ws_create_server

    class Echo(WSListener):
        """One reply per complete data message (fragments are answered at their last frame)."""

        def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
            if frame.msg_type is WSMsgType.CLOSE:
                transport.send_close(frame.get_close_code(), frame.get_close_message())
                transport.disconnect()
            elif frame.fin and frame.msg_type in (WSMsgType.BINARY, WSMsgType.TEXT, WSMsgType.CONTINUATION):
                transport.send(WSMsgType.BINARY, reply)

    def listener(request: WSUpgradeRequest) -> Echo:
        return Echo()

    server = await ws_create_server(listener, host, 0, max_frame_size=_MAX_BYTES)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--reply-file", type=Path, required=True)
    parser.add_argument("--impl", choices=["websockets", "picows"], default="websockets")
    args = parser.parse_args()
    reply = args.reply_file.read_bytes()
    serve = _serve_picows if args.impl == "picows" else _serve_websockets
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.port_file, reply))
    else:
        uvloop.run(serve(args.host, args.port_file, reply))


if __name__ == "__main__":
    main()
