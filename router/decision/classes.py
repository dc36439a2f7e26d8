"""A request's class for flow control: its inference objective (a priority) and its fairness id,
from the Gateway API Inference Extension's headers. The decision carries them on the
:class:`~router.decision.service.Route` (``/route`` shows them, the metrics count decisions per
objective) for flow control to act on; the choice of endpoint itself does not read them.

The proxy, ``/route`` and the endpoint picker read the same two headers with the same bounds, so a
request is classed the same whichever front door it came through."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

OBJECTIVE = "x-gateway-inference-objective"
"""The name of the request's InferenceObjective (its priority)."""
FAIRNESS_ID = "x-gateway-inference-fairness-id"
"""Who the request is accounted to when capacity is shared fairly (a tenant, a user)."""
MAX_VALUE = 253
"""Longest value of either header: a Kubernetes object name's limit (an objective is one)."""
_NAMES = {OBJECTIVE.encode(): "objective", FAIRNESS_ID.encode(): "fairness_id"}


class RequestClass(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the two headers said (None: absent)."""

    objective: str | None = None
    fairness_id: str | None = None


def _value(header: str, raw: str) -> str | None:
    """The value, cut at :data:`MAX_VALUE` characters (as flow control cuts a fairness id: a long
    header is a client's choice, not an error of its request)."""
    value = raw.strip()[:MAX_VALUE]
    return value or None


def request_class(headers: Iterable[tuple[bytes, bytes]]) -> RequestClass | None:
    """The class of a request's headers as the HTTP front door has them (lower-case byte pairs);
    None when it has neither header."""
    found: dict[str, str | None] = {}
    for k, v in headers:
        field = _NAMES.get(k)
        if field is not None:
            found[field] = _value(k.decode(), v.decode("latin-1"))
    if not found:
        return None
    out = RequestClass(**found)
    return out if out.objective is not None or out.fairness_id is not None else None


def request_class_of(headers: Mapping[str, str]) -> RequestClass | None:
    """:func:`request_class` for headers by lower-case name (the endpoint picker's)."""
    objective, fairness = headers.get(OBJECTIVE), headers.get(FAIRNESS_ID)
    if objective is None and fairness is None:
        return None
    out = RequestClass(
        objective=_value(OBJECTIVE, objective) if objective is not None else None,
        fairness_id=_value(FAIRNESS_ID, fairness) if fairness is not None else None,
    )
    return out if out.objective is not None or out.fairness_id is not None else None
