"""The ``[pd]`` table: prefill/decode disaggregation settings (README, "Prefill/decode disaggregation").

A module of its own, free of router imports beyond the policy names, so that :mod:`router.config` can
embed it without an import cycle.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from router.decision.policy import PolicyName

ConnectorName = Literal["nixl"]


class PDConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a model served by prefill- and decode-role engines is routed (defaults: docs/benchmarks/pd.md)."""

    connector: ConnectorName = "nixl"
    """The engines' KV connector protocol: vLLM's NixlConnector (pull: prefill leg, then decode leg)."""
    min_uncached_tokens: int = 128
    """Run the prefill leg only when the decode target would have at least this many prompt tokens
    it does not cache; below that it prefills the remainder itself (conditional disaggregation). 0:
    always disaggregate. 128 (measured on the mock P/D fleet): about where computing the remainder on the
    decode engine costs what a prefill leg adds (a prefill step, a hop, a transfer, the wait for the
    decode step), and the decode engine's step grows by at most ~13 ms (0.1 ms per token)."""
    max_prefill_queue_tokens: int = 0
    """The prefill pool counts as saturated when every prefill engine has at least this many
    uncached prompt tokens of prefill legs in flight: requests then prefill on their decode target
    instead of queueing. 0: never (always wait for the prefill pool)."""
    prefill_policy: PolicyName = "kv"
    """How the prefill engine is chosen (kv | round_robin | least_loaded | random), with the
    ``[policy]`` weights; the decode engine is chosen by ``[policy]``."""
    prefill_timeout_s: float = 60.0
    """A prefill leg without an answer by then is abandoned (its connection closed, which the engine
    treats as an abort) and the decode engine computes the prefill itself."""


__all__ = ["ConnectorName", "PDConfig"]
