"""The upstream planner's request body in pieces: PNG data URLs that decode to the image (read by
Pillow), base64 text equal to one call's over any split of the bytes, and JSON whose data URLs
are spliced in at markers no input string can forge."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from chunkline.server.planner import request_body
from chunkline.server.planner.request_body import (
    PIECE_BYTES,
    UPLOAD_PIECE_BYTES,
    DataUrl,
    InMemoryText,
    body_length,
    body_pieces,
    json_pieces,
    png_data_url,
)


def _decoded(url: DataUrl) -> np.ndarray:
    text = url.text()
    assert text.startswith("data:image/png;base64,")
    png = base64.b64decode(text.split(",", 1)[1], validate=True)
    with Image.open(io.BytesIO(png)) as image:
        image.load()  # checks every chunk's CRC and the compressed stream
        return np.asarray(image.convert("RGB"))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.integers(1, 400), st.integers(0, 2**32 - 1))
def test_a_png_data_url_decodes_to_the_image_whatever_the_row_blocks(h: int, w: int, block: int, seed: int) -> None:
    image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_body, "_ROW_BLOCK_BYTES", block)  # blocks of one row up to the whole image
        url = png_data_url(image[:, ::-1])  # a view that is not contiguous
    np.testing.assert_array_equal(_decoded(url), image[:, ::-1])


def test_a_large_image_is_encoded_in_short_pieces() -> None:
    image = np.random.default_rng(0).integers(0, 256, (600, 800, 3), dtype=np.uint8)
    url = png_data_url(image)
    assert max(len(p) for p in url.pieces()) <= UPLOAD_PIECE_BYTES
    np.testing.assert_array_equal(_decoded(url), image)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=3 * PIECE_BYTES // 2 + 5), max_size=6))
def test_base64_in_pieces_is_one_calls_base64_over_any_split(pieces: list[bytes]) -> None:
    out = request_body.base64_pieces(pieces)
    assert b"".join(out) == base64.b64encode(b"".join(pieces))
    assert all(0 < len(p) <= PIECE_BYTES * 4 // 3 for p in out)


def test_data_urls_are_spliced_into_the_json_and_nothing_else_is() -> None:
    url = png_data_url(np.full((5, 4, 3), 7, np.uint8))
    forged = ['"0:0"', "0:0", '\\"x:0\\"', "\u0000", "é\n\"}"]
    document = {"messages": [{"content": [{"type": "text", "text": t} for t in forged]
                              + [{"type": "image_url", "image_url": {"url": url}}, {"url": url}]}], "n": 1.5}
    parts = json_pieces(document)
    body = b"".join(body_pieces(parts))
    assert body_length(parts) == len(body)
    expected = json.loads(json.dumps(document, default=lambda u: u.text()))
    assert json.loads(body) == expected
    with pytest.raises(TypeError):
        json_pieces({"x": object()})


def test_a_real_upstream_gets_the_body_with_its_length_declared_not_chunked() -> None:
    import asyncio
    import http.server
    import threading
    import time

    from chunkline.server.planner.config import PlannerConfig
    from chunkline.server.planner.planners import PlanInput
    from chunkline.server.planner.upstream import UpstreamPlanner

    seen: list[tuple[dict[str, str], bytes]] = []
    answer = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": json.dumps(
        {"steps": [{"skill": "hold", "target": None, "goal": None}], "note": ""})}, "finish_reason": "stop"}]}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    image = np.random.default_rng(1).integers(0, 256, (300, 200, 3), dtype=np.uint8)

    async def main() -> None:
        planner = UpstreamPlanner(PlannerConfig(name="vlm", backend="upstream", upstream_url=f"http://127.0.0.1:{server.server_address[1]}/v1"))
        await planner.start()
        try:
            await planner.plan(PlanInput(obs={"images/cam": image}, instruction="go"), time.perf_counter() + 30)
        finally:
            await planner.stop()

    try:
        asyncio.run(main())
    finally:
        server.shutdown()
    ((headers, body),) = seen
    assert "transfer-encoding" not in headers and int(headers["content-length"]) == len(body)
    parts = json.loads(body)["messages"][1]["content"]
    url = next(p for p in parts if p["type"] == "image_url")["image_url"]["url"]
    prefix, text = url.split(",", 1)
    assert prefix == "data:image/png;base64"
    np.testing.assert_array_equal(_decoded(DataUrl(InMemoryText(text.encode()))), image)
