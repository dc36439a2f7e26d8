"""Tokenization must match the engine token for token: chat rendering, BOS handling, the async service.

Everything is built in the tests: the toy tokenizer (sim.toy_tokenizer), hand-written tokenizer
configs with other templates, and a real HTTP /tokenize server on an ephemeral 127.0.0.1 port for
the remote fallback.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from router.decision.chat import ChatTokenizer
from router.decision.tokenizer import (
    RequestTokenizer,
    RequestTokenizerConfig,
    TokenizerError,
    TokenizerUnavailable,
)
from router.net.upstream import UpstreamPool
from sim.toy_tokenizer import SPECIAL_TOKENS, build_toy_tokenizer, toy_corpus

BOS, EOS, USER, ASSISTANT, SYSTEM = range(5)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a block?"},
    {"role": "assistant", "content": "Sixteen tokens."},
    {"role": "user", "content": "And a prefix?"},
]
EXPECTED_TOY = (
    "<s>"
    "<|system|>\nYou are terse.</s>\n"
    "<|user|>\nWhat is a block?</s>\n"
    "<|assistant|>\nSixteen tokens.</s>\n"
    "<|user|>\nAnd a prefix?</s>\n"
)

# A template in another style: iterates over content parts (so it gets OpenAI-format content),
# rejects unknown roles with raise_exception, renders tools and tool-call arguments with tojson.
PARTS_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message.role) }}"
    "{% endif %}"
    "[{{ message.role | upper }}]"
    "{% for part in message.content %}{% if part.type == 'text' %} {{ part.text }}{% endif %}{% endfor %}"
    "{% if message.tool_calls is defined %}"
    "{% for call in message.tool_calls %} CALL {{ call.function.name }}"
    " {{ call.function.arguments | tojson }}{% endfor %}"
    "{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
TOOL_TEMPLATE = (
    "TOOLS {{ tools | tojson }}\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_tokenizer(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy(toy_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_path(toy_dir)


def _model_dir(base: Path, toy_dir: Path, name: str, config: dict[str, Any] | None) -> Path:
    d = base / name
    d.mkdir()
    shutil.copy(toy_dir / "tokenizer.json", d / "tokenizer.json")
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def parts_dir(tmp_path_factory: pytest.TempPathFactory, toy_dir: Path) -> Path:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": {"content": "</s>"},
        "add_bos_token": False,
        "chat_template": [
            {"name": "default", "template": PARTS_TEMPLATE},
            {"name": "tool_use", "template": TOOL_TEMPLATE},
        ],
    }
    return _model_dir(tmp_path_factory.mktemp("parts"), toy_dir, "parts", config)


@pytest.fixture(scope="module")
def parts(parts_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_path(parts_dir)


# --------------------------------------------------------------------------------------------------
# toy tokenizer
# --------------------------------------------------------------------------------------------------


def test_toy_tokenizer_is_byte_identical_and_fast(tmp_path: Path) -> None:
    digests = []
    for name in ("a", "b"):
        start = time.perf_counter()
        d = build_toy_tokenizer(tmp_path / name)
        elapsed = time.perf_counter() - start
        assert elapsed < 5.0, f"build took {elapsed:.2f}s"  # ~0.1 s normally; generous for loaded CI
        digests.append(
            {
                f: hashlib.sha256((d / f).read_bytes()).hexdigest()
                for f in ("tokenizer.json", "tokenizer_config.json")
            }
        )
    assert digests[0] == digests[1]


def test_toy_tokenizer_vocab_special_tokens_and_round_trip(toy: ChatTokenizer) -> None:
    assert toy.vocab_size == 2048
    assert [toy.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(5))
    assert (toy.bos_token, toy.eos_token, toy.bos_token_id, toy.eos_token_id) == ("<s>", "</s>", BOS, EOS)
    for text in ["plain words", "naïve café 🚀 \t tabs\n\nnewlines  ", "".join(toy_corpus()[:3]), ""]:
        assert toy.decode(toy.encode_prompt(text, add_special_tokens=False)) == text
    # common corpus words are single tokens, like a real English tokenizer
    assert len(toy.encode_prompt(" the cache request", add_special_tokens=False)) == 3


def test_encode_prompt_adds_bos_only_with_special_tokens(toy: ChatTokenizer) -> None:
    with_special = toy.encode_prompt("Hello world")
    without = toy.encode_prompt("Hello world", add_special_tokens=False)
    assert with_special == [BOS, *without]
    assert BOS not in without
    # role tokens written in the text are recognised as single special tokens
    assert toy.encode_prompt("<|user|>", add_special_tokens=False) == [USER]


# --------------------------------------------------------------------------------------------------
# chat rendering
# --------------------------------------------------------------------------------------------------


def test_render_known_conversation(toy: ChatTokenizer) -> None:
    assert toy.render_chat(CONVERSATION, add_generation_prompt=False) == EXPECTED_TOY
    assert toy.render_chat(CONVERSATION) == EXPECTED_TOY + "<|assistant|>\n"


def test_encode_chat_has_exactly_one_bos(toy: ChatTokenizer) -> None:
    ids = toy.encode_chat(CONVERSATION)
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert ids[-2:] == toy.encode_prompt("<|assistant|>\n", add_special_tokens=False)
    assert ids == toy.encode_prompt(toy.render_chat(CONVERSATION), add_special_tokens=False)
    # what the completions default would do to the rendered text: a double BOS (the classic mismatch)
    assert toy.encode_prompt(toy.render_chat(CONVERSATION))[:2] == [BOS, BOS]
    no_gen = toy.encode_chat(CONVERSATION, add_generation_prompt=False)
    assert ids[: len(no_gen)] == no_gen and len(ids) > len(no_gen)


def test_list_content_joined_with_newlines_for_string_templates(toy: ChatTokenizer) -> None:
    assert toy.content_format() == "string"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert toy.render_chat(msgs, add_generation_prompt=False) == "<s><|user|>\none\ntwo</s>\n"


def test_unsupported_role_and_bad_messages(toy: ChatTokenizer) -> None:
    with pytest.raises(TokenizerError, match="Unsupported role: critic"):
        toy.render_chat([{"role": "critic", "content": "x"}])
    for bad in ([], [{"content": "no role"}], ["text"], [{"role": "user", "content": 5}]):
        with pytest.raises(TokenizerError):
            toy.encode_chat(bad)  # type: ignore[arg-type]


def test_media_parts_give_the_prompt_up_to_the_first_one(toy: ChatTokenizer) -> None:
    """vLLM expands an image into placeholder tokens hashed with the image's identifier: the router
    cannot key those blocks, so a prompt with media is its tokens before the first media part (a
    couple dropped at the boundary), never more; the text after it never counts."""
    from router.decision.tokenizer import PrefixTokens

    system = {"role": "system", "content": "You describe pictures. " * 20}
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    text_only = toy.encode_chat([system, {"role": "user", "content": "what is it?"}])
    ids = toy.encode_chat(
        [system, {"role": "user", "content": [image, {"type": "text", "text": "what is in it?"}]}]
    )
    assert type(ids) is PrefixTokens
    assert 0 < len(ids) < len(text_only) and text_only[: len(ids)] == ids
    rendered = toy.render_chat([system, {"role": "user", "content": "x"}])
    before = toy.encode_prompt(rendered.split("x")[0], add_special_tokens=False)
    assert len(ids) == len(before) - 2  # (up to the user turn's start, less the boundary's tokens)
    assert type(toy.encode_chat([system, {"role": "user", "content": "what is in it?"}])) is list
    only_image = toy.encode_chat([{"role": "user", "content": [image]}])
    assert type(only_image) is PrefixTokens and len(only_image) < 8


def test_continue_final_message(toy: ChatTokenizer) -> None:
    msgs = [*CONVERSATION, {"role": "assistant", "content": "A prefix is"}]
    text = toy.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text == EXPECTED_TOY + "<|assistant|>\nA prefix is"
    with pytest.raises(TokenizerError, match="cannot both"):
        toy.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)


def test_parts_template_gets_openai_content_and_raise_exception(parts: ChatTokenizer) -> None:
    assert parts.content_format() == "openai"
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Rules"},  # a plain string becomes one text part
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert parts.render_chat(msgs) == "[SYSTEM] Rules</s>\n[USER] a b</s>\n[ASSISTANT]"
    with pytest.raises(TokenizerError, match="Unknown role: narrator"):
        parts.render_chat([{"role": "narrator", "content": "x"}])


def test_parts_config_bos_object_and_add_bos_false(parts: ChatTokenizer) -> None:
    assert parts.bos_token == "<s>" and parts.eos_token == "</s>"
    # add_bos_token: false replaces the tokenizer.json post-processor, as transformers does
    assert parts.encode_prompt("Hello")[0] != BOS
    assert parts.encode_prompt("Hello") == parts.encode_prompt("Hello", add_special_tokens=False)


def test_tool_calls_arguments_become_dicts_and_body_is_not_mutated(parts: ChatTokenizer) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "<Oslo>"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "bad", "arguments": "{not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    before = copy.deepcopy(msgs)
    text = parts.render_chat(msgs, add_generation_prompt=False)
    # tojson does not HTML-escape (Jinja's built-in would write \u003c), malformed args become {}
    assert (
        text
        == '[USER] weather?</s>\n[ASSISTANT] CALL get {"city": "<Oslo>"} CALL bad {}</s>\n[TOOL] sunny</s>\n'
    )
    assert msgs == before


def test_tool_use_template_selected_when_tools_given(parts: ChatTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get", "description": "a < b & c"}}]
    text = parts.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert text.startswith(
        'TOOLS [{"type": "function", "function": {"name": "get", "description": "a < b & c", '
        '"parameters": null}}]\n'
    )
    assert text.endswith("user: hi\n")


def test_tools_reach_the_template_as_vllm_dumps_them(parts: ChatTokenizer) -> None:
    """vLLM renders [tool.model_dump() for tool in request.tools]: every declared field (None when
    absent) in declaration order, extra ones after. The raw tools rendered other text with a
    `tojson` template: no cache match from the tools on."""
    tools = [
        {"function": {"strict": True, "parameters": {"type": "object"}, "name": "now"}, "x-extra": 1},
        "not a tool",
    ]
    text = parts.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert text.startswith(
        'TOOLS [{"type": "function", "function": {"name": "now", "description": null, '
        '"parameters": {"type": "object"}, "strict": true}, "x-extra": 1}, "not a tool"]\n'
    )
    assert tools[0] == {
        "function": {"strict": True, "parameters": {"type": "object"}, "name": "now"},
        "x-extra": 1,
    }


def test_chat_template_kwargs_only_reach_referenced_variables(tmp_path: Path, toy_dir: Path) -> None:
    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    ct = ChatTokenizer.from_path(_model_dir(tmp_path, toy_dir, "kw", {"chat_template": template}))
    msgs = [{"role": "user", "content": "q"}]
    assert ct.render_chat(msgs) == "q>"
    assert ct.render_chat(msgs, chat_template_kwargs={"enable_thinking": False}) == "q<nothink>>"
    # unreferenced keys are ignored; explicit arguments win over kwargs of the same name
    kwargs = {"unused": 1, "add_generation_prompt": False}
    assert ct.render_chat(msgs, chat_template_kwargs=kwargs) == "q>"
    with pytest.raises(TokenizerError, match="chat_template"):
        ct.render_chat(msgs, chat_template_kwargs={"chat_template": "x"})


def test_chat_template_jinja_file_wins_and_extensions_parse(tmp_path: Path, toy_dir: Path) -> None:
    d = _model_dir(tmp_path, toy_dir, "jinja", {"chat_template": "CONFIG", "bos_token": "<s>"})
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }};{% endgeneration %}{% endfor %}",
        encoding="utf-8",
    )
    ct = ChatTokenizer.from_path(d)
    msgs = [{"role": "user", "content": c} for c in ("a", "b", "c")]
    assert ct.render_chat(msgs) == "<s>a;b;"


def test_model_without_chat_template(tmp_path: Path, toy_dir: Path) -> None:
    for ct in (
        ChatTokenizer.from_path(toy_dir / "tokenizer.json"),  # a lone file has no template
        ChatTokenizer.from_path(_model_dir(tmp_path, toy_dir, "nochat", {"bos_token": "<s>"})),
    ):
        assert not ct.has_chat_template
        assert ct.encode_prompt("hi")  # completions still work
        # not the request's fault: routed on load only (the engine may have its template from
        # --chat-template), where a 400 refused every chat request
        with pytest.raises(TokenizerUnavailable, match="no chat template"):
            ct.encode_chat([{"role": "user", "content": "hi"}])


def test_from_path_errors(tmp_path: Path, toy_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        ChatTokenizer.from_path(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        ChatTokenizer.from_path(empty)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="invalid tokenizer file"):
        ChatTokenizer.from_path(garbage)
    bad_cfg = _model_dir(tmp_path, toy_dir, "badcfg", None)
    (bad_cfg / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        ChatTokenizer.from_path(bad_cfg)
    bad_template = _model_dir(tmp_path, toy_dir, "badtpl", {"chat_template": "{% for m in messages %}"})
    with pytest.raises(TokenizerError, match="not valid Jinja2"):
        ChatTokenizer.from_path(bad_template)
    bad_list = _model_dir(tmp_path, toy_dir, "badlist", {"chat_template": [{"name": "default"}]})
    with pytest.raises(TokenizerError, match="name' and 'template"):
        ChatTokenizer.from_path(bad_list)


# --------------------------------------------------------------------------------------------------
# RequestTokenizer, local
# --------------------------------------------------------------------------------------------------


def test_service_local_completions_and_chat(toy: ChatTokenizer) -> None:
    async def main() -> None:
        svc = RequestTokenizer({"toy": toy})

        async def completions(body: dict[str, Any]) -> list[int]:
            return await svc.tokenize("completions", body, "toy")

        async def chat(body: dict[str, Any]) -> list[int]:
            return await svc.tokenize("chat", body, "toy")

        try:
            big = " ".join(toy_corpus()[:200])  # above inline_max_chars: goes through the pool
            assert await completions({"prompt": "Hi there"}) == toy.encode_prompt("Hi there")
            assert await completions({"prompt": big}) == toy.encode_prompt(big)
            no_bos = toy.encode_prompt("Hi", add_special_tokens=False)
            assert await completions({"prompt": "Hi", "add_special_tokens": False}) == no_bos
            assert await chat({"messages": CONVERSATION}) == toy.encode_chat(CONVERSATION)
            expect = toy.encode_chat(CONVERSATION, add_generation_prompt=False)
            assert await chat({"messages": CONVERSATION, "add_generation_prompt": False}) == expect
            long_chat = [{"role": "user", "content": big}]
            assert await chat({"messages": long_chat}) == toy.encode_chat(long_chat)
            # batches: only the first prompt decides the route
            assert await completions({"prompt": ["first prompt", "second"]}) == toy.encode_prompt(
                "first prompt"
            )
            assert await completions({"prompt": [[5, 6, 7], [8]]}) == [5, 6, 7]
            assert svc.local_requests == 7
        finally:
            svc.close()

    asyncio.run(main())


def test_service_prompt_ids_passthrough_and_validation(toy: ChatTokenizer) -> None:
    async def main() -> None:
        svc = RequestTokenizer({"toy": toy})
        try:
            ids = [BOS, 10, 11, 2047]
            assert await svc.tokenize("completions", {"prompt": ids}, "toy") == ids
            bad: Any
            for bad in ([], [1, "2"], [1, -1], [1, 2.0], [True, 1], [1, 2048], [[]], [{"a": 1}], 7, None):
                with pytest.raises(TokenizerError):
                    await svc.tokenize("completions", {"prompt": bad}, "toy")
            # unknown vocabulary (remote-only model): range is left to the engine, types still checked
            assert await svc.tokenize("completions", {"prompt": [1, 99999]}, "other") == [1, 99999]
            with pytest.raises(TokenizerError):
                await svc.tokenize("completions", {"prompt": [1, None]}, "other")
            with pytest.raises(TokenizerError):
                await svc.tokenize("chat", {"messages": "hi"}, "toy")
            with pytest.raises(TokenizerError):
                await svc.tokenize("chat", {"messages": CONVERSATION, "add_generation_prompt": "yes"}, "toy")
            with pytest.raises(TokenizerUnavailable, match="no remote fallback"):
                await svc.tokenize("completions", {"prompt": "x"}, "other")
            # a chat_template in the body is only rendered when trusted (vLLM's default is to refuse it)
            custom = {
                "messages": CONVERSATION,
                "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
            }
            with pytest.raises(TokenizerUnavailable, match="not trusted"):
                await svc.tokenize("chat", custom, "toy")
            trusting = RequestTokenizer(
                {"toy": toy}, config=RequestTokenizerConfig(trust_request_chat_template=True)
            )
            try:
                expect = toy.encode_prompt(
                    "".join(m["content"] for m in CONVERSATION), add_special_tokens=False
                )
                assert await trusting.tokenize("chat", custom, "toy") == expect
            finally:
                trusting.close()
        finally:
            svc.close()

    asyncio.run(main())


def test_event_loop_stays_responsive_during_large_prompt(toy: ChatTokenizer) -> None:
    text = " ".join(toy_corpus()) * 10  # ~1.6 MB: hundreds of milliseconds of BPE work

    async def main() -> tuple[float, float, int]:
        svc = RequestTokenizer({"toy": toy})
        done = asyncio.Event()
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        try:
            ids = await svc.tokenize("completions", {"prompt": text}, "toy")
        finally:
            elapsed = time.perf_counter() - start
            done.set()
            await task
            svc.close()
        assert len(ids) > 100_000
        return elapsed, max(gaps), len(gaps)

    elapsed, max_gap, ticks = asyncio.run(main())
    # A GIL-holding encode would stall the loop for the whole call (max_gap ~ elapsed).
    assert ticks >= 10, (elapsed, max_gap, ticks)
    assert max_gap < max(0.05, elapsed / 3), (elapsed, max_gap, ticks)


# --------------------------------------------------------------------------------------------------
# RequestTokenizer, remote fallback against a real HTTP server
# --------------------------------------------------------------------------------------------------


def _tokenize_app(ct: ChatTokenizer, calls: list[dict[str, Any]], fail: list[int]) -> FastAPI:
    """A stand-in for vLLM's /tokenize endpoint, backed by the same tokenizer files."""
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        calls.append(body)
        if fail:
            return JSONResponse({"error": "boom"}, status_code=fail[0])
        if "messages" in body:
            tokens = ct.encode_chat(
                body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                add_special_tokens=body.get("add_special_tokens", False),
            )
        else:
            tokens = ct.encode_prompt(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return JSONResponse(
            {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}
        )

    return app


@asynccontextmanager
async def _serve(app: FastAPI) -> AsyncIterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if task.done() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


@asynccontextmanager
async def _pool() -> AsyncIterator[UpstreamPool]:
    """The client the router's remote fallback uses (its upstream pool), closed afterwards."""
    pool = UpstreamPool(connect_timeout=10.0, read_timeout=30.0)
    try:
        yield pool
    finally:
        pool.close()


def test_remote_fallback_one_call_per_request(toy: ChatTokenizer) -> None:
    calls: list[dict[str, Any]] = []

    async def main() -> None:
        async with _serve(_tokenize_app(toy, calls, [])) as base, _pool() as client:
            svc = RequestTokenizer(
                {}, client=client, backend_for=lambda model: base if model == "m" else None
            )
            try:
                got = await svc.tokenize("completions", {"prompt": "Hello remote"}, "m")
                assert got == toy.encode_prompt("Hello remote")
                assert calls == [{"model": "m", "prompt": "Hello remote"}]

                got = await svc.tokenize("chat", {"messages": CONVERSATION}, "m")
                assert got == toy.encode_chat(CONVERSATION)
                assert len(calls) == 2
                assert calls[1] == {"model": "m", "messages": CONVERSATION, "add_generation_prompt": True}

                body = {
                    "messages": CONVERSATION,
                    "add_generation_prompt": False,
                    "chat_template_kwargs": {"x": 1},
                }
                got = await svc.tokenize("chat", body, "m")
                assert got == toy.encode_chat(CONVERSATION, add_generation_prompt=False)
                assert len(calls) == 3 and calls[2]["chat_template_kwargs"] == {"x": 1}

                got = await svc.tokenize("completions", {"prompt": ["batch one", "batch two"]}, "m")
                assert got == toy.encode_prompt("batch one")
                assert len(calls) == 4 and calls[3]["prompt"] == "batch one"

                # token-id prompts need no remote call at all
                assert await svc.tokenize("completions", {"prompt": [1, 2, 3]}, "m") == [1, 2, 3]
                assert len(calls) == 4
                assert (svc.remote_requests, svc.remote_failures) == (4, 0)

                with pytest.raises(TokenizerUnavailable, match="no backend"):
                    await svc.tokenize("completions", {"prompt": "x"}, "unknown-model")
                assert len(calls) == 4
            finally:
                svc.close()

    asyncio.run(main())


def test_remote_failures_are_typed_and_not_retried(toy: ChatTokenizer) -> None:
    calls: list[dict[str, Any]] = []
    fail = [503]

    async def main() -> None:
        async with _serve(_tokenize_app(toy, calls, fail)) as base, _pool() as client:
            svc = RequestTokenizer({}, client=client, backend_for=lambda _m: base)
            try:
                with pytest.raises(TokenizerUnavailable) as info:
                    await svc.tokenize("completions", {"prompt": "x"}, "m")
                assert info.value.status_code == 503
                assert len(calls) == 1  # exactly one attempt
                assert svc.remote_failures == 1
            finally:
                svc.close()

        # connection refused: a port that was free a moment ago
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        async with _pool() as client:
            svc = RequestTokenizer({}, client=client, backend_for=lambda _m: dead)
            try:
                with pytest.raises(TokenizerUnavailable, match="failed"):
                    await svc.tokenize("chat", {"messages": CONVERSATION}, "m")
            finally:
                svc.close()

    asyncio.run(main())


def test_remote_malformed_reply(toy: ChatTokenizer) -> None:
    app = FastAPI()
    replies: list[Callable[[], JSONResponse]] = [
        lambda: JSONResponse({"count": 1}),
        lambda: JSONResponse({"tokens": [1, "2"]}),
        lambda: JSONResponse([1, 2]),
    ]

    @app.post("/tokenize")
    async def tokenize() -> JSONResponse:
        return replies.pop(0)()

    async def main() -> None:
        async with _serve(app) as base, _pool() as client:
            svc = RequestTokenizer(
                {},
                client=client,
                backend_for=lambda _m: base,
                config=RequestTokenizerConfig(remote_timeout_s=10.0),
            )
            try:
                for _ in range(3):
                    with pytest.raises(TokenizerUnavailable, match="tokens"):
                        await svc.tokenize("completions", {"prompt": "x"}, "m")
            finally:
                svc.close()

    asyncio.run(main())


def test_chat_machinery_is_imported_only_with_a_tokenizer(tokdir: Path) -> None:
    """A router with no tokenizer configured (token-id prompts, a lookup service) never imports
    Jinja2 or HF tokenizers (~5 MB of RSS, tens of ms of start-up); one with a tokenizer loads
    them and tokenizes chat requests locally. Each case in a fresh interpreter."""
    script = """
import sys
from router.app import KVRouter
from router.config import parse_config
import tomllib
router = KVRouter(parse_config(tomllib.loads(sys.argv[1])))
print("jinja2" in sys.modules, "tokenizers" in sys.modules, bool(router.tokenizer.local_tokenizer("m")))
"""
    backend = '[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9"\nmodels = ["m"]\n'
    for toml, want in (
        (backend, "False False False"),
        (f'tokenizer = "{tokdir}"\n{backend}', "True True True"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", script, toml],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[3],
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split("\n")[-2] == want, proc.stdout
