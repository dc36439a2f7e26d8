"""KV connector protocols: what the two legs of a disaggregated request carry, per connector.

The exchange (:mod:`router.pd.exchange`) runs the legs and owns every failure rule; a connector only
says how to shape the prefill leg's body, how to read the transfer parameters out of its answer and
how to build the decode leg's body from them. Only vLLM's NIXL pull protocol is implemented.

How others would fit (from their proxies; see ../shared/docs/pd-disaggregation.md):

- **Mooncake** sends both legs at once: its prefill body carries ``do_remote_decode`` and its decode
  body ``do_remote_prefill`` with the prefill engine's bootstrap address, which the adapter would
  derive from :class:`Leg` (the prefill engine's URL and rank) instead of a prefill response. The
  exchange would start the decode leg without awaiting the prefill answer (``sequential = False``),
  the one change it would need.
- **LMCache** (disaggregated mode) also sends the prefill leg first, with a ``disagg_spec`` naming
  the receiver (the decode engine, known from :class:`Leg`); the decode leg then needs no
  parameters from the prefill answer.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import msgspec


class Leg(msgspec.Struct, frozen=True):
    """Where the legs of one request go (what an adapter may need to address the other side)."""

    request_id: str
    """The one X-Request-Id both legs carry."""
    prefill_url: str
    prefill_dp_rank: int
    decode_url: str
    decode_dp_rank: int


class Connector(Protocol):
    """One KV connector's request shapes."""

    name: str
    sequential: bool
    """True: the decode leg is built from the prefill leg's answer (NIXL's pull)."""
    fields: tuple[str, ...]
    """The body fields the legs carry for the engines' connector, which only the router may set
    (:data:`ENGINE_FIELDS`)."""

    def prefill_body(self, body: dict[str, Any], leg: Leg) -> dict[str, Any]:
        """The prefill leg's body, from the client's (which is not modified)."""

    def transfer_params(self, answer: Any) -> dict[str, Any] | None:
        """The decoded JSON answer of the prefill leg -> what the decode leg needs; None when the
        answer carries nothing usable (the decode engine then computes the prefill itself)."""

    def decode_body(self, body: dict[str, Any], params: dict[str, Any], leg: Leg) -> dict[str, Any]:
        """The decode leg's body: the client's own (its stream, max_tokens, stream_options) plus
        what the prefill leg produced. (Without that, the exchange sends the client's bytes as they
        came: the decode engine computes the prefill itself.)"""


class NixlConnector:
    """vLLM's NixlConnector, driven as vLLM's own example proxy drives it.

    Prefill leg: the client's body with ``kv_transfer_params`` asking for a remote decode, not
    streamed, one token (``max_tokens`` and, when present, ``max_completion_tokens`` = 1), without
    ``stream_options``, ``min_tokens`` and ``min_completion_tokens``. Its answer's top-level
    ``kv_transfer_params`` (``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
    ``remote_port``, ``tp_size``, and whatever newer versions add) goes to the decode leg verbatim;
    nothing in it is interpreted here, so new fields pass through.
    """

    name = "nixl"
    sequential = True
    fields: tuple[str, ...] = ("kv_transfer_params",)

    REQUEST_PARAMS: ClassVar[dict[str, Any]] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")

    def prefill_body(self, body: dict[str, Any], leg: Leg) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k not in self.DROPPED}
        out["kv_transfer_params"] = dict(self.REQUEST_PARAMS)
        out["stream"] = False
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        return out

    def transfer_params(self, answer: Any) -> dict[str, Any] | None:
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) and params else None

    def decode_body(self, body: dict[str, Any], params: dict[str, Any], leg: Leg) -> dict[str, Any]:
        return {**body, "kv_transfer_params": params}


CONNECTORS: dict[str, type[NixlConnector]] = {"nixl": NixlConnector}
"""Connector name (``pd.connector``) -> implementation."""

ENGINE_FIELDS: tuple[str, ...] = tuple(sorted({f for c in CONNECTORS.values() for f in c.fields}))
"""Request body fields only the router sets, for the engines' KV connectors (every connector's,
whichever is configured: an engine outside a P/D pool may run one too). The proxy removes a
client's own from every request it forwards (``trusted_api_keys`` says why and exempts a key)."""


def connector(name: str) -> Connector:
    """The connector of that name."""
    return CONNECTORS[name]()


__all__ = ["CONNECTORS", "ENGINE_FIELDS", "Connector", "Leg", "NixlConnector", "connector"]
