"""Text request classes behind Ray Serve's HTTP ingress.

Text has a latency budget of hundreds of milliseconds to first token, so, unlike the robot path,
it can afford Ray Serve's HTTP proxy: a Serve deployment forwards the OpenAI-compatible API
(``/v1/...``, streaming included) to chunkline text servers, least-loaded first. Authentication,
quotas, admission, metrics and the ledger stay in the chunkline servers behind it (the
``Authorization`` header is passed through untouched). ``chunkline bench cluster`` measures what
the proxy adds to time to first token.

Needs ``ray[serve]`` (imported only inside :func:`text_ingress`).
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["text_ingress", "serve_text_ingress", "PASSED_REQUEST_HEADERS", "PASSED_RESPONSE_HEADERS"]

#: Request headers forwarded upstream (nothing else: no hop-by-hop headers, no cookies).
PASSED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "openai-organization", "x-request-id")
#: Response headers returned to the caller.
PASSED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id", "cache-control")


def text_ingress(upstreams: list[str]) -> Any:
    """A bound Serve application forwarding ``/v1/...`` to ``upstreams`` (``http://host:port``).

    Args:
        upstreams: base URLs of chunkline servers' OpenAI-compatible APIs (without ``/v1``).
    """
    import httpx
    from ray import serve
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import StreamingResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    class TextIngress:
        def __init__(self, urls: list[str]) -> None:
            # One pooled client per upstream; no timeout of our own: the upstream enforces the
            # request's deadline, and a second timer here would be a second retry owner.
            self.clients = [httpx.AsyncClient(base_url=u, timeout=None) for u in urls]
            self.in_flight = [0] * len(urls)

        async def __call__(self, request: Request) -> StreamingResponse:
            i = min(range(len(self.clients)), key=lambda k: (self.in_flight[k], k))
            self.in_flight[i] += 1
            try:
                body = await request.body()
                headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_REQUEST_HEADERS}
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                upstream = await self.clients[i].send(
                    self.clients[i].build_request(request.method, target, content=body, headers=headers), stream=True)
            except BaseException:
                self.in_flight[i] -= 1
                raise

            async def done() -> None:
                await upstream.aclose()
                self.in_flight[i] -= 1

            passed = {k: v for k, v in upstream.headers.items() if k.lower() in PASSED_RESPONSE_HEADERS}
            return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=passed,
                                     background=BackgroundTask(done))

    ingress: Any = TextIngress  # serve.deployment's types do not show bind()
    return ingress.bind(upstreams)


def serve_text_ingress(upstreams: list[str], host: str = "127.0.0.1", port: int | None = 8001) -> str:
    """Start Ray Serve's HTTP proxy on ``host:port`` with the ingress; returns its ``/v1`` URL
    (call after ``ray.init``). ``port=None`` picks a free one."""
    from ray import serve

    if port is None:
        with socket.socket() as sock:  # Serve's proxy takes a fixed port, not 0
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])

    serve.start(http_options={"host": host, "port": port})
    serve.run(text_ingress(upstreams), name="chunkline-text", route_prefix="/")
    return f"http://{host}:{port}/v1"
