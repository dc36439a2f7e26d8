"""Admin input is validated like the config file, and neither lets a control character through.

A backend's fields end up in request lines, headers, logs and socket addresses: a CR/LF in an admin
``PUT``'s ``api_key`` was accepted, and the engine then received an injected header with every probe
and request. Here the real router (`kvrouter serve`'s server, and uvicorn) takes admin bodies; a fake
engine on a raw socket records the request heads it gets, byte for byte. Every decode error of a
body (bad JSON, a body 100k deep, a wrong type, an unknown key) is an OpenAI-shaped 400 naming the
field. The same checks hold for the config file and for Kubernetes pods (one ``validate_backend``).
"""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import TIMEOUT, RouterRunner, wait_for
from test_discovery_k8s import kcfg, pod

from router.config import ConfigError, parse_config
from router.fleet.sources.kubernetes import SkipPod, pod_backend

ADMIN = "admin-key"


class RawEngine(socketserver.ThreadingTCPServer):
    """An OpenAI-shaped engine on a raw socket that keeps every request head it receives as bytes
    (nothing between the wire and the record could tidy an injected header away)."""

    daemon_threads = True
    block_on_close = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.heads: list[bytes] = []
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(TIMEOUT)


class _Answer(socketserver.StreamRequestHandler):
    """One request (the answer closes the connection): its head recorded, a small JSON answered."""

    server: RawEngine

    def handle(self) -> None:
        self.request.settimeout(TIMEOUT)
        lines = []
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            lines.append(line)
        head = b"".join(lines).rstrip(b"\r\n")
        self.server.heads.append(head)
        for line in lines:
            if line.lower().startswith(b"content-length:"):
                self.rfile.read(int(line.split(b":", 1)[1]))
        path = head.split(b" ")[1] if b" " in head else b""
        if path == b"/v1/models":
            answer: dict[str, Any] = {"object": "list", "data": [{"id": "toy", "object": "model"}]}
        elif path.startswith(b"/v1/"):
            answer = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}]}
        else:
            answer = {}
        out = json.dumps(answer).encode()
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(out), out)
        )


@pytest.fixture
def engine() -> Iterator[RawEngine]:
    e = RawEngine()
    yield e
    e.close()


@pytest.fixture(params=["native", "asgi"])
def router(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RouterRunner]:
    """A router with only the admin API to fill its fleet, on `kvrouter serve`'s server and under uvicorn."""
    toml = f'admin_keys = ["{ADMIN}"]\nremote_tokenize = false\n[health]\ninterval_s = 0.2\n'
    r = RouterRunner(toml, tmp_path, asgi=request.param == "asgi")
    yield r
    r.stop()


def put(router: RouterRunner, name: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.put(
        f"{router.url}/admin/backends/{name}",
        content=content,
        headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        timeout=TIMEOUT,
    )


def members(router: RouterRunner) -> list[str]:
    r = httpx.get(
        f"{router.url}/admin/backends", headers={"authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT
    )
    return sorted(b["name"] for b in r.json()["backends"])


def ready(router: RouterRunner) -> list[str]:
    r = httpx.get(
        f"{router.url}/admin/backends", headers={"authorization": f"Bearer {ADMIN}"}, timeout=TIMEOUT
    )
    return sorted(b["name"] for b in r.json()["backends"] if b["state"] == "ready" and b["healthy"])


def assert_400(r: httpx.Response, param: str | None) -> None:
    """An OpenAI-shaped 400 naming ``param``."""
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_a_crlf_api_key_is_refused_and_nothing_reaches_the_engine(
    router: RouterRunner, engine: RawEngine
) -> None:
    evil = put(router, "evil", {"url": engine.url, "api_key": "k\r\nX-Injected: 1", "models": ["toy"]})
    good = put(router, "good", {"url": engine.url, "api_key": "good-key", "models": ["toy"]})
    assert good.status_code == 201, good.text
    wait_for(lambda: "good" in ready(router), "the good backend probed and ready")
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": "hello"}, timeout=TIMEOUT)
    heads = list(engine.heads)
    assert any(h.startswith(b"POST /v1/completions ") for h in heads)
    assert not [h for h in heads if b"x-injected" in h.lower()], heads
    for head in heads:  # each header exactly once, the backend's key exactly as configured
        auth = [line for line in head.split(b"\r\n") if line.lower().startswith(b"authorization:")]
        assert auth == [b"authorization: Bearer good-key"], head
    assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == "good"
    assert_400(evil, "api_key")
    assert "k\r\n" not in evil.text and "X-Injected" not in evil.text  # (a key is not echoed)
    assert members(router) == ["good"]


DEEP = 100_000


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[" * DEEP + b"]" * DEEP, None),  # (no field to name: the body is not an object)
        (b'{"url": "http://h:1", "models": ' + b"[" * DEEP + b"]" * DEEP + b"}", "models"),
        (b'{"url": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", "url"),
        (b'{"colour": ' + b"[" * DEEP + b"]" * DEEP + b"}", "colour"),
        (b"{nope", None),
        (b'{"url": "http://h:1", "dp_size": "2"}', "dp_size"),
        (b"\xff\xfe", None),
    ],
    ids=["deep_array", "deep_models", "deep_url", "deep_unknown", "bad_json", "wrong_type", "not_utf8"],
)
def test_every_decode_error_is_a_400_naming_the_field(
    router: RouterRunner, body: bytes, param: str | None
) -> None:
    assert_400(put(router, "b", body), param)
    assert members(router) == []


@pytest.mark.parametrize(
    ("name", "body", "param"),
    [
        ("b", {"url": "http://h:1\r\nX-Injected: 1"}, "url"),
        ("b", {"url": "http://h:1/v1 x"}, "url"),  # a space would split the request line
        ("b", {"url": "http://h:99999"}, "url"),  # (was accepted, then a 500 when the backend was built)
        ("b", {"url": "http://h:1", "kv_events": "tcp://h:1\n"}, "kv_events"),
        ("b", {"url": "http://h:1", "kv_topic": "kv\x00"}, "kv_topic"),
        ("b", {"url": "http://h:1", "models": ["toy", "a\nb"]}, "models"),
        ("b", {"url": "http://h:1", "api_key": "cl\u00e9"}, "api_key"),  # not latin-1 safe in a header
        ("b", {"url": "http://h:1", "api_key": "two words"}, "api_key"),
        ("b%0A", {"url": "http://h:1"}, "name"),  # a trailing LF passed the name's pattern
        ("b%7F", {"url": "http://h:1"}, "name"),
    ],
)
def test_control_characters_and_unusable_values_are_refused(
    router: RouterRunner, name: str, body: dict[str, Any], param: str
) -> None:
    assert_400(put(router, name, body), param)
    assert members(router) == []


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"backends": [{"name": "a", "url": "http://h:1", "api_key": "k\r\nX: 1"}]}, "backends[0].api_key"),
        ({"backends": [{"name": "a", "url": "http://h:1", "models": ["m\n"]}]}, "backends[0].models[0]"),
        ({"backends": [{"name": "a\n", "url": "http://h:1"}]}, "backends[0].name"),
        ({"admin_keys": ["a\r\n"]}, "admin_keys[0]"),
        ({"admin_keys": ["a"], "kv_topic": "t\x7f"}, "kv_topic"),
        ({"admin_keys": ["a"], "cluster": {"replica_name": "r\n"}}, "cluster.replica_name"),
        (
            {"admin_keys": ["a"], "membership": {"kubernetes": {"api_key": "k\u00e9"}}},
            "membership.kubernetes.api_key",
        ),
    ],
)
def test_the_config_file_is_held_to_the_same_rules(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(key + ":"), str(err.value)
    assert "X: 1" not in str(err.value)


def test_a_pod_whose_annotations_hold_control_characters_is_skipped() -> None:
    for ann in ({"kvrouter.io/models": "toy,a\nb"}, {"kvrouter.io/kv-topic": "kv\r\n"}):
        with pytest.raises(SkipPod) as exc:
            pod_backend(pod(annotations=ann), kcfg())
        assert exc.value.reason == "invalid" and "control characters" in str(exc.value)
    assert pod_backend(pod(annotations={"kvrouter.io/models": "toy, other"}), kcfg()).models == [
        "toy",
        "other",
    ]
