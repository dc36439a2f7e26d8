"""The Endpoint Picker Protocol's names and the ext_proc messages the picker sends.

Envoy's generated protobuf modules come from the ``xds-protos`` package (``kvrouter[epp]``); this
module only names what the protocol fixes (header and metadata keys) and builds responses from them,
so the stream logic (:mod:`router.epp.picker`) reads as the protocol does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
"""Request header and dynamic metadata key (in ``epp.destination_namespace``): the picked endpoints."""
SERVED = "x-gateway-destination-endpoint-served"
"""Response metadata key (in ``epp.destination_namespace``): the endpoint that really served."""
SUBSET = "x-gateway-destination-endpoint-subset"
"""Filter metadata key (in ``epp.subset_namespace``): the only endpoints the picker may choose."""
MODEL_REWRITE = "x-gateway-model-name-rewrite"
"""Request header: the model name to send to the engine instead of the body's."""
DP_RANK = "x-data-parallel-rank"
"""vLLM's header choosing a data-parallel rank behind one address."""
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE)
UPSTREAM_ADDRESS = "upstream.address"
"""The Envoy attribute (``response_attributes``) naming the upstream a response came from: the
served endpoint where the gateway sets no ``x-gateway-destination-endpoint-served``."""

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
NONE = processing_mode_pb2.ProcessingMode.NONE
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

Message: TypeAlias = Any
"""A generated protobuf message (xds-protos ships no type information for them)."""
ProcessingResponse = ext_proc.ProcessingResponse


def header_values(headers: Message) -> dict[str, str]:
    """The headers of a headers message by lower-case name (Envoy sends ``raw_value``; older
    versions ``value``); a repeated name keeps its last value."""
    out = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def metadata_value(metadata: Message, namespace: str, key: str) -> Any:
    """``metadata[namespace][key]`` as builtins (None when absent)."""
    ns = metadata.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return _value(ns.fields[key])


def attribute_value(request: Message, name: str) -> Any:
    """An Envoy attribute sent with a message (``request_attributes``/``response_attributes``)."""
    for attrs in request.attributes.values():
        if name in attrs.fields:
            return _value(attrs.fields[name])
    return None


def _value(v: Message) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "list_value":
        return [_value(x) for x in v.list_value.values]
    if kind == "number_value":
        return v.number_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return {k: _value(x) for k, x in v.struct_value.fields.items()}
    return None


def _mutation(set_headers: Sequence[tuple[str, str]], remove: Iterable[str] = ()) -> Message:
    return ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")), append_action=_OVERWRITE
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def destination_metadata(namespace: str, value: str) -> Message:
    """``{namespace: {x-gateway-destination-endpoint: value}}``: the same value as the header."""
    out = struct_pb2.Struct()
    out.update({namespace: {DESTINATION: value}})
    return out


def continue_headers(request: bool = True, set_headers: Sequence[tuple[str, str]] = ()) -> Message:
    """Let a headers message through (with headers added, on a response)."""
    common = ext_proc.CommonResponse(header_mutation=_mutation(set_headers)) if set_headers else None
    hr = ext_proc.HeadersResponse(response=common)
    return ProcessingResponse(request_headers=hr) if request else ProcessingResponse(response_headers=hr)


def continue_body(request: bool = True) -> Message:
    """Let a (buffered or streamed) body chunk through unchanged."""
    br = ext_proc.BodyResponse()
    return ProcessingResponse(request_body=br) if request else ProcessingResponse(response_body=br)


def continue_trailers(request: bool = True) -> Message:
    tr = ext_proc.TrailersResponse()
    return ProcessingResponse(request_trailers=tr) if request else ProcessingResponse(response_trailers=tr)


def streamed_body(chunk: bytes, end: bool, request: bool = True) -> Message:
    """In FULL_DUPLEX_STREAMED mode the processor holds the body and sends it on itself."""
    br = ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(body=chunk, end_of_stream=end)
            )
        )
    )
    return ProcessingResponse(request_body=br) if request else ProcessingResponse(response_body=br)


def picked_headers(
    set_headers: Sequence[tuple[str, str]], remove: Iterable[str], metadata: Message
) -> Message:
    """FULL_DUPLEX_STREAMED: the request headers' answer, sent once the body is in and decided."""
    return ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(header_mutation=_mutation(set_headers, remove))
        ),
        dynamic_metadata=metadata,
    )


def picked_buffered_body(
    set_headers: Sequence[tuple[str, str]],
    remove: Iterable[str],
    metadata: Message,
    body: bytes | None,
) -> Message:
    """BUFFERED: the whole body's answer carries the picked headers (not sent upstream yet) and,
    when it changed, the new body."""
    common = ext_proc.CommonResponse(header_mutation=_mutation(set_headers, remove))
    if body is not None:
        common.body_mutation.body = body
    return ProcessingResponse(request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata)


def immediate(
    status: int,
    body: bytes,
    details: str,
    retry_after: bool | int = False,
    extra: Sequence[tuple[str, str]] = (),
) -> Message:
    """An HTTP answer from the picker itself (Envoy sends it to the client, nothing goes upstream):
    ``body`` is an OpenAI-shaped error; ``retry_after``: True for 1 s, or the seconds; ``extra``:
    more headers."""
    headers = [("content-type", "application/json"), *extra]
    if retry_after:
        headers.append(("retry-after", str(int(retry_after))))
    return ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation(headers),
            body=body,
            details=details,
        )
    )
