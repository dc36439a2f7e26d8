"""Token ids for OpenAI request bodies (``RequestTokenizer``): computed locally with the model's
:class:`router.decision.chat.ChatTokenizer` (chat template and HF tokenizer, exactly as the vLLM
engine tokenizes), passed through when the prompt is token ids, or asked of one backend's
``/tokenize``; the errors a decision distinguishes (the client's fault: 400; not computable: route
on load only).

``ChatTokenizer`` lives in :mod:`router.decision.chat`, which builds on this module: here it is
only a :class:`ChatTokenizer` protocol, and chat.py is imported only where a tokenizer is
loaded: Jinja2 and HF tokenizers cost ~5 MB of RSS and ~25-60 ms of start-up that a router serving
token-id prompts only does not pay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from index.keys import TokenBuffer, check_token_ids
from router.decision.segments import SegmentCache
from router.net.body import LARGE_BODY_BYTES, decode_json, decodes_at_once
from router.net.upstream import UpstreamError, UpstreamPool

__all__ = [
    "ContentFormat",
    "PrefixTokens",
    "RequestTokenizer",
    "RequestTokenizerConfig",
    "TokenizerError",
    "TokenizerUnavailable",
]

ContentFormat = Literal["auto", "string", "openai"]
Endpoint = Literal["completions", "chat"]
T = TypeVar("T")
log = logging.getLogger("kvrouter.tokenizer")


class ChatTokenizer(Protocol):
    """What a request's tokenization asks of a local tokenizer
    (:class:`router.decision.chat.ChatTokenizer`)."""

    @property
    def max_token_id(self) -> int: ...

    segments: SegmentCache

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
        large: bool = False,
        max_chars: int | None = None,
        media_uuids: bool = True,
    ) -> list[int]: ...


class TokenizerError(ValueError):
    """The request (or a tokenizer file) is invalid; the router answers 400 with this message."""


class PrefixTokens(list[int]):
    """A chat prompt's tokens up to its first media part (image, audio, video, file) that the
    router cannot place: vLLM expands media into model-specific placeholder tokens keyed by the
    media's identifier, so it matches the prompt before that part only. Every block from there on
    is unknown to the router, never a false match. ``spans``: the images before it whose range and
    identifier the router knows (:class:`router.decision.media.MediaSpan`), salted into their
    blocks' keys."""

    spans: tuple[Any, ...] = ()


class TokenizerUnavailable(RuntimeError):
    """Tokens cannot be computed for this request (remote tokenizer failed, unsupported content).

    Not the client's fault: the router routes on load only. `status_code` is the backend's HTTP
    status when the remote call got an answer.
    """

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


# --------------------------------------------------------------------------------------------------
# RequestTokenizer: the async per-request service
# --------------------------------------------------------------------------------------------------


class RequestTokenizerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tuning of `RequestTokenizer`.

    - `inline_max_chars` (default 1024): prompts with at most this many characters of text are
      tokenized on the event loop, larger ones in the pool; a chat request is measured by its whole
      body's bytes when the caller knows them (``size``): the template renders tools, documents and
      template arguments too, and 10k tools in an 8 MB body, counted by their messages alone, were
      rendered on the loop for 7-9 s. Measured with the toy tokenizer on 2
      shared cores (median): 256 chars 68 us inline vs 214 us through the pool; 1 KB 259 vs 444 us;
      2 KB 500 vs 678 us; 32 KB 9.4 vs 7.7 ms. Inline is cheaper up to tens of KB, but it holds the
      loop; 1 KB caps that stall near a quarter of a millisecond.
    - `max_workers` (default 2): threads for larger prompts. Encoding releases the GIL, so more
      threads than cores only queue.
    - `remote_timeout_s` (default 2.0): deadline of the one `/tokenize` call to a backend.
    - `max_chars` (default 2 Mi, the config's ``tokenizer_max_chars``): prompt text longer than
      this is not tokenized (`TokenizerUnavailable`: routed on load only).
    - `trust_request_chat_template` (default False): render a `chat_template` sent in the request
      body. Off, like vLLM's `--trust-request-chat-template`: a hostile template can burn the
      router's CPU, and an engine with the flag off rejects such requests anyway. When off, such
      requests raise `TokenizerUnavailable` (routed on load only, the engine decides).
    """

    inline_max_chars: int = 1024
    max_chars: int = 2 << 20
    max_workers: int = 2
    remote_timeout_s: float = 2.0
    trust_request_chat_template: bool = False


def prompt_too_long(chars: int, limit: int) -> TokenizerUnavailable:
    """A prompt over ``tokenizer_max_chars``: not tokenized, routed on load only."""
    return TokenizerUnavailable(
        f"the prompt is {chars} characters, over tokenizer_max_chars ({limit}): routed on load only"
    )


def _check_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TokenizerError(f"{key} must be a boolean")
    return value


def _validate_ids(ids: list[Any], max_token_id: int | None) -> list[int]:
    if not ids:
        raise TokenizerError("prompt token list is empty")
    bad = check_token_ids(ids, max_token_id)  # the loop below, in C; it only words the error
    if bad < 0:
        return ids
    for tid in ids[bad:]:
        # bool is an int subclass; JSON true must not pass as token 1.
        if type(tid) is not int or tid < 0:
            raise TokenizerError(f"prompt token ids must be non-negative integers, got {tid!r}")
        if max_token_id is not None and tid > max_token_id:
            raise TokenizerError(f"prompt token id {tid} is out of vocabulary (max {max_token_id})")
    return ids


def _text_size(messages: Any) -> int:
    """Rough character count of a chat request's messages, to decide between inline and threaded
    work when the body's size is not known."""
    total = 0
    if isinstance(messages, list):
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        total += len(part["text"])
                    elif isinstance(part, str):
                        total += len(part)
            else:
                total += 64  # tool calls and other fields: small but not free
    return total


def _log_failure(done: Future[object]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("work in the worker threads failed", exc_info=done.exception())


class RequestTokenizer:
    """Token ids for one OpenAI request body, computed locally or by one backend `/tokenize` call.

    Local tokenizers are preferred (no network hop, no dependency on a healthy backend). Models
    without one fall back to the backend returned by `backend_for(model)`, in vLLM's `/tokenize`
    API shape. Local results are reused per text segment between added tokens
    (:mod:`router.decision.segments`): a chat turn resends earlier messages, and only new text is tokenized.
    """

    def __init__(
        self,
        local: Mapping[str, ChatTokenizer],
        *,
        default: ChatTokenizer | None = None,
        client: UpstreamPool | None = None,
        backend_for: Callable[[str], str | None] | None = None,
        config: RequestTokenizerConfig | None = None,
    ) -> None:
        """`client` and `backend_for` enable the remote fallback; both are needed. The caller owns
        the client; `close()` stops this service's thread pool."""
        if (client is None) != (backend_for is None):
            raise ValueError("the remote fallback needs both client and backend_for")
        self._local = dict(local)
        self._default = default
        self._client = client
        self._backend_for = backend_for
        self.config = config or RequestTokenizerConfig()
        self._pool = ThreadPoolExecutor(
            max_workers=self.config.max_workers, thread_name_prefix="kvr-tokenize"
        )
        self.local_requests = 0
        self.remote_requests = 0
        self.remote_failures = 0
        self.last_duration_s = 0.0

    def has_local(self, model: str) -> bool:
        """A local tokenizer serves this model (its own, or the default for every model)."""
        return model in self._local or self._default is not None

    def local_tokenizer(self, model: str) -> ChatTokenizer | None:
        return self._local.get(model, self._default)

    def close(self) -> None:
        """Stop the worker threads (pending work is cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the worker threads: a request's work that grows with its input and
        would hold the event loop (decoding a large body, validating it). Shares the tokenizing
        threads: what the router computes for a request is bounded by them, whatever comes in."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def offload_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """:meth:`offload` without waiting for the result (a failure is logged)."""
        self._pool.submit(fn, *args).add_done_callback(_log_failure)

    async def tokenize(
        self, endpoint: Endpoint, body: dict[str, Any], model: str, size: int | None = None
    ) -> Sequence[int]:
        """The prompt token ids the engine will see for `body` sent to `endpoint`; `size`: the
        request body's bytes, when known (what a chat template may render is in them).

        completions: `prompt` as a string is encoded (`add_special_tokens` from the body, default
        true); as a list of ints it is validated and returned as is; as a batch (list of strings or
        list of id lists) only the first element is tokenized: the router picks one backend per HTTP
        request, and the first prompt is as good a representative as any while tokenizing all of
        them would multiply the cost. chat: `messages` with `add_generation_prompt` (default true),
        `continue_final_message`, `tools`, `documents`, `chat_template`, `chat_template_kwargs` and
        `add_special_tokens` (default false) from the body.

        Raises `TokenizerError` for invalid input (answer 400) and `TokenizerUnavailable` when the
        tokens cannot be computed (route on load only).
        """
        if not isinstance(body, dict):
            raise TokenizerError("request body must be a JSON object")
        start = time.perf_counter()
        try:
            if endpoint == "completions":
                return await self._completions(body, model)
            if endpoint == "chat":
                return await self._chat(body, model, size)
            raise TokenizerError(f"unknown endpoint {endpoint!r}")
        finally:
            self.last_duration_s = time.perf_counter() - start

    def tokenize_now(self, endpoint: Endpoint, body: dict[str, Any], model: str) -> Sequence[int] | None:
        """:meth:`tokenize` when it needs no await: a completions ``prompt`` already parsed into token
        ids (``TokenBuffer``, ``/route``), validated the same way; None for any other body."""
        if endpoint != "completions" or type(body.get("prompt")) is not TokenBuffer:
            return None
        start = time.perf_counter()
        try:
            _check_bool(body, "add_special_tokens", True)
            return self._token_buffer(body["prompt"], model)
        finally:
            self.last_duration_s = time.perf_counter() - start

    def _token_buffer(self, prompt: TokenBuffer, model: str) -> TokenBuffer:
        local = self._local.get(model, self._default)
        max_id = local.max_token_id if local is not None else None
        bad = prompt.first_above(max_id) if max_id is not None else -1
        if bad >= 0:
            raise TokenizerError(f"prompt token id {prompt[bad]} is out of vocabulary (max {max_id})")
        return prompt

    async def _completions(self, body: dict[str, Any], model: str) -> Sequence[int]:
        prompt = body.get("prompt")
        add_special = _check_bool(body, "add_special_tokens", True)
        local = self._local.get(model, self._default)
        max_id = local.max_token_id if local is not None else None
        if type(prompt) is TokenBuffer:  # token ids parsed from JSON as uint64s (/route)
            return self._token_buffer(prompt, model)
        if isinstance(prompt, list):
            if not prompt:
                raise TokenizerError("prompt must not be an empty list")
            first = prompt[0]
            if isinstance(first, int) and not isinstance(first, bool):
                return _validate_ids(prompt, max_id)
            if isinstance(first, list):
                return _validate_ids(first, max_id)
            if isinstance(first, str):
                prompt = first
            else:
                raise TokenizerError("prompt must be a string, a list of token ids, or a batch of them")
        if not isinstance(prompt, str):
            if prompt is None and body.get("prompt_embeds") is not None:
                raise TokenizerUnavailable("prompt_embeds requests carry no tokens to route on")
            raise TokenizerError("prompt must be a string, a list of token ids, or a batch of them")
        if len(prompt) > self.config.max_chars:
            raise prompt_too_long(len(prompt), self.config.max_chars)
        if local is not None:
            self.local_requests += 1
            size = len(prompt)
            if self.config.inline_max_chars < size <= 1 << 18:
                # headed for the pool: text seen before needs no tokenizer call, so no hand-off
                # (beyond 256 KB even hashing it is worth keeping off the loop; the pool looks it
                # up). Smaller prompts are encoded inline, which looks them up itself.
                ids = local.segments.cached(prompt, add_special)
                if ids is not None:
                    return ids
            return await self._run(size, local.encode_prompt, prompt, add_special)
        payload: dict[str, Any] = {"model": model, "prompt": prompt}
        if "add_special_tokens" in body:
            payload["add_special_tokens"] = add_special
        return await self._remote(model, payload)

    async def _chat(self, body: dict[str, Any], model: str, size: int | None) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizerError("messages must be a non-empty list")
        add_generation_prompt = _check_bool(body, "add_generation_prompt", True)
        continue_final = _check_bool(body, "continue_final_message", False)
        add_special = _check_bool(body, "add_special_tokens", False)
        tools = body.get("tools")
        documents = body.get("documents")
        chat_template = body.get("chat_template")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TokenizerError("chat_template_kwargs must be an object")
        local = self._local.get(model, self._default)
        if local is not None and chat_template is not None and not self.config.trust_request_chat_template:
            raise TokenizerUnavailable("request-supplied chat_template is not trusted; routing on load only")
        if local is not None:
            self.local_requests += 1
            if size is None:  # (what else the template may render: taken as large)
                size = _text_size(messages)
                if tools or documents or kwargs:
                    size += LARGE_BODY_BYTES
            large = size > LARGE_BODY_BYTES
            # (vLLM hashes a client's image uuid with these options: the identifier is then unknown)
            media_uuids = not body.get("mm_processor_kwargs") and not body.get("media_io_kwargs")

            def work() -> list[int]:
                return local.encode_chat(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    chat_template_kwargs=kwargs,
                    continue_final_message=continue_final,
                    documents=documents,
                    chat_template=chat_template,
                    add_special_tokens=add_special,
                    large=large,
                    max_chars=self.config.max_chars,
                    media_uuids=media_uuids,
                )

            return await self._run(size, work)
        payload: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        optional = {
            "continue_final_message": continue_final if "continue_final_message" in body else None,
            "add_special_tokens": add_special if "add_special_tokens" in body else None,
            "tools": tools,
            "documents": documents,
            "chat_template": chat_template,
            "chat_template_kwargs": kwargs,
        }
        payload.update({k: v for k, v in optional.items() if v is not None})
        return await self._remote(model, payload)

    async def _run(self, size: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        if size <= self.config.inline_max_chars:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _remote(self, model: str, payload: dict[str, Any]) -> list[int]:
        """One `POST {backend}/tokenize`; any failure is `TokenizerUnavailable` (no retry: the
        router would rather route on load now than wait on a second round trip; the upstream pool
        resends only a request that a closed idle connection never delivered)."""
        if self._client is None or self._backend_for is None:
            raise TokenizerUnavailable(f"no local tokenizer for model {model!r} and no remote fallback")
        base = self._backend_for(model)
        if not base:
            raise TokenizerUnavailable(f"no local tokenizer for model {model!r} and no backend serves it")
        self.remote_requests += 1
        url = base.rstrip("/") + "/tokenize"
        try:
            status, body = await self._client.fetch(
                "POST",
                url,
                {"content-type": "application/json"},
                msgspec.json.encode(payload),
                timeout=self.config.remote_timeout_s,
            )
        except UpstreamError as exc:
            self.remote_failures += 1
            raise TokenizerUnavailable(
                f"remote tokenize at {url} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if status != 200:
            self.remote_failures += 1
            raise TokenizerUnavailable(
                f"remote tokenize at {url} answered {status}: {body[:200].decode('utf-8', 'replace')}", status
            )
        try:
            # (a long prompt's ids: decoded in pieces, off the event loop)
            at_once = decodes_at_once(body)
            data = decode_json(body) if at_once else await self.offload(decode_json, body, False)
        except ValueError as exc:
            self.remote_failures += 1
            raise TokenizerUnavailable(f"remote tokenize at {url} returned invalid JSON") from exc
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            self.remote_failures += 1
            raise TokenizerUnavailable(f"remote tokenize at {url} returned no integer 'tokens' list")
        return tokens
