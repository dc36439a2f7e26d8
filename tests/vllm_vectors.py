"""Captured vLLM 0.33 frames (compact copies in tests/fixtures/vllm) and a naive reference model.

The reference model follows vLLM's own block hashes (not our keys): a residency is (rank, medium,
engine hash) with a count, and a request's expected match is the run of its vLLM block hashes that
the rank holds. Comparing it with what our key-based index answers checks keys, parents and
reference counts against vLLM's ground truth.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
SHARED_VECTORS = Path(__file__).resolve().parents[2] / "shared" / "data" / "vllm-vectors"


def scenarios() -> list[str]:
    """Names of the captured scenarios."""
    return sorted(p.stem for p in FIXTURES.glob("*.json"))


def load(name: str) -> dict[str, Any]:
    """One compact capture."""
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def live_frames(capture: dict[str, Any], rank: str) -> list[list[bytes]]:
    """The live PUB messages of one rank, in order."""
    return [
        [bytes.fromhex(x) for x in f["frames_hex"]]
        for f in capture["ranks"][rank]["frames"]
        if f["via"] == "pub"
    ]


def shared_vectors_or_skip() -> Path | None:
    """The full captures in ../shared, or None (tests then skip, and fail under CI=true)."""
    if SHARED_VECTORS.is_dir():
        return SHARED_VECTORS
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise AssertionError(f"CI requires the shared vLLM vectors at {SHARED_VECTORS}")
    return None


@dataclass
class NaiveModel:
    """Reference counts per (rank, medium, vLLM hash), straight from untyped msgpack."""

    counts: Counter[tuple[int, str, int]] = field(default_factory=Counter)

    def apply_payload(self, rank: int, payload: bytes) -> None:
        raw = msgspec.msgpack.decode(payload)
        for ev in raw[1]:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            if kind == "BlockStored":
                if not ev["token_ids"] and ev["block_size"] == 0:
                    continue  # legacy offloading placeholder: nothing to key it by
                medium = ev.get("medium") or "GPU"
                for h in ev["block_hashes"]:
                    self.counts[rank, medium, _as_int(h)] += 1
            elif kind == "BlockRemoved":
                medium = ev.get("medium") or "GPU"
                for h in ev["block_hashes"]:
                    key = (rank, medium, _as_int(h))
                    if self.counts[key] > 0:
                        self.counts[key] -= 1
            elif kind == "AllBlocksCleared":
                for key in list(self.counts):
                    if key[0] == rank and key[1] == "GPU":
                        self.counts[key] = 0

    def media_of(self, rank: int, h: int) -> list[str]:
        return [m for (r, m, x), c in self.counts.items() if r == rank and x == h and c > 0]

    def expected(self, rank: int, hashes: list[int]) -> tuple[int, dict[str, int]]:
        """(matched blocks, blocks by best medium) for a request's vLLM hashes on one rank."""
        by: dict[str, int] = {"GPU": 0}
        n = 0
        for h in hashes:
            media = self.media_of(rank, h)
            if not media:
                break
            best = "GPU" if "GPU" in media else sorted(media)[0]
            by[best] = by.get(best, 0) + 1
            n += 1
        return n, by


def _as_int(h: int | bytes) -> int:
    return h if isinstance(h, int) else int.from_bytes(h[-8:], "big")


def shape(event: dict[str, Any]) -> tuple[Any, ...]:
    """What the router can tell of an event besides the hash values (each engine hashes its own way):
    kind, group, spec kind and window, counts of hashes and tokens, parent or not, block size, extra
    keys, medium (tests/vllm/test_mock_parity.py compares real engines' events with it too)."""
    if event["type"] == "BlockStored":
        return (
            "stored",
            event.get("group_idx"),
            event.get("kv_cache_spec_kind"),
            event.get("kv_cache_spec_sliding_window"),
            len(event["block_hashes"]),
            len(event["token_ids"]),
            event["parent_block_hash"] is not None,
            event["block_size"],
            event.get("extra_keys"),
            event.get("medium"),
        )
    if event["type"] == "BlockRemoved":
        return ("removed", event.get("group_idx"), len(event["block_hashes"]), event.get("medium"))
    return (event["type"],)
