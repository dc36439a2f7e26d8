"""Chat prompts with images for the real-vLLM tier and its capture (tests/fixtures/make_vllm_media.py).

Images are tiny PNGs written here (no imaging library: the main venv has none), as ``data:`` URLs
in ``image_url`` parts; a part's ``uuid`` is vLLM's per-part media identifier.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

from vllm_tier import text


def png(rgb: tuple[int, int, int], width: int = 64, height: int = 48) -> str:
    """A solid-colour RGB PNG as a ``data:`` URL."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    body = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(body).decode()


RED, BLUE = png((200, 30, 30)), png((30, 30, 200))


def image_chat(parts: list[Any]) -> list[dict[str, Any]]:
    """One user turn of ``parts``: a str is a text part, a (url, uuid or None) pair an image part."""
    content: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, str):
            content.append({"type": "text", "text": p})
            continue
        url, uuid = p
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
        if uuid is not None:
            part["uuid"] = uuid
        content.append(part)
    return [{"role": "user", "content": content}]


PRE, POST, OTHER = text(3, 40), text(5, 70), text(9, 70)

WORKLOAD: list[tuple[str, list[Any]]] = [
    ("uuid a", [PRE, (RED, "img-a"), POST]),
    ("uuid a again", [PRE, (RED, "img-a"), POST]),
    ("uuid a, other text after", [PRE, (RED, "img-a"), OTHER]),
    ("no uuid", [PRE, (RED, None), POST]),
    ("no uuid again", [PRE, (RED, None), POST]),
    ("uuid a with other pixels", [PRE, (BLUE, "img-a"), POST]),
    ("two images", [PRE, (RED, "img-a"), text(12, 20), (BLUE, "img-b"), POST]),
    ("two images again", [PRE, (RED, "img-a"), text(12, 20), (BLUE, "img-b"), POST]),
    ("second image without uuid", [PRE, (RED, "img-a"), text(12, 20), (BLUE, None), POST]),
]
"""(tag, parts) in order. What the engine served each from cache (captured, of 184 or 274 prompt
tokens): 0, then 160 for a resend; 96 for the same image with other text after it (its range ends
in block 3); 32 with no uuid (block 0 is text; the image is keyed by vLLM's digest of it), then
160 for its resend (of which the router knows 32); 160 for other pixels under the same uuid
(vLLM trusts the client's identifier); two images 96, then 256; the second one without a uuid
128 (up to its range)."""
