"""The chat side of tokenizing: an engine's chat template rendered and its prompt encoded exactly
as the vLLM engine does, so the router's block keys match its cache (``ChatTokenizer``).

One token of difference (a doubled BOS, a different whitespace in the rendered chat template, a
tool-call argument serialised differently) shifts every block boundary and loses every prefix hit,
so this module reproduces the engine's path step by step rather than approximating it:

- completions: the prompt string is encoded with the tokenizer's post-processor
  (`add_special_tokens=True` by default, which usually prepends BOS); token-id prompts pass through.
- chat: messages are normalised the way vLLM normalises them (content parts joined with newlines
  for templates that expect strings, or wrapped as `{"type": "text", ...}` parts for templates that
  iterate over `message.content`; tool-call arguments parsed into dicts; unknown keys dropped),
  rendered with a sandboxed Jinja2 environment configured like HF transformers' (trim_blocks,
  lstrip_blocks, loop controls, `{% generation %}`, a non-HTML-escaping `tojson`, `raise_exception`,
  `strftime_now`), then encoded with `add_special_tokens=False`: the chat template already writes
  the BOS, and vLLM's chat endpoint defaults to not adding it again.

Encoding uses `tokenizers.Tokenizer.encode_batch_fast`, which releases the GIL (plain `encode`
holds it: a 1.4 MB prompt froze the event loop for 1.3 s even from a worker thread; with
`encode_batch_fast` the longest loop stall was 9 ms) and skips offset tracking (3x faster, same ids).
Text between added tokens that was tokenized before is not tokenized again: `router.decision.segments`
keeps its ids (exactly the whole-text result; why that holds is in its docstring).

Known limits: multimodal content parts are not tokenized locally (`TokenizerUnavailable`, so the
router routes on load); `strftime_now` uses the router's clock, so templates that print today's
date differ from an engine in another time zone or across midnight; `truncate_prompt_tokens` is
not applied; slow (sentencepiece-only) tokenizers are not supported. A mismatch there costs cache
hits, never correctness: the engine still gets the original request body.

Its own module because Jinja2 and HF tokenizers cost ~5 MB of RSS and ~25-60 ms of start-up: a
router with no tokenizer configured (token-id prompts only, e.g. a lookup service for an external
scheduler) never imports it (:mod:`router.decision.tokenizer` does when a tokenizer is loaded).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from tokenizers import Tokenizer, processors

from router.decision.media import IMAGE_PART_TYPES, ImagePrompt, MediaTokens, expand_images, image_prompt_of
from router.decision.segments import SegmentCache
from router.decision.tokenizer import (
    ContentFormat,
    PrefixTokens,
    TokenizerError,
    TokenizerUnavailable,
    prompt_too_long,
)

__all__ = ["ChatTokenizer"]

# --------------------------------------------------------------------------------------------------
# Jinja environment (HF transformers / vLLM compatible)
# --------------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) and render the body.

    Templates that use it fail to parse without the tag; the marker itself never changes the text.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares tags as a plain class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


_rendering = threading.local()
"""``large``: the template rendered on this thread is a large request's (``render_chat``)."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ' ; HF replaces it with plain json.dumps, and
    # tool schemas rendered either way would tokenize differently.
    if getattr(_rendering, "large", False):
        # json's pure-Python encoder, same text: json.dumps encodes in one C call, which keeps the
        # GIL from the event loop for as long as a client's giant tool schema takes (a worker
        # thread gives it back only between bytecodes)
        encoder = json.JSONEncoder(
            ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        return "".join(encoder.iterencode(value))
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# --- content-format detection: does the template loop over message content? -------------------


def _accesses(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """True if `node` reads one of `names` (or `name[key]` / `name.key`), through filters, tests, slices."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) or (
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
    ):
        inner: jinja2.nodes.Node | None = node.node
        if inner is None:
            break
        node = inner
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _accesses(node.node, names) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _accesses(node.node, names) and node.attr == key
    return False


def _aliases(root: jinja2.nodes.Template, names: set[str], key: str | None = None) -> set[str]:
    """Names bound by `{% set x = <one of names>[...] %}` (key=None) or `{% set x = n[key] %}`."""
    found = set(names) if key is None else set()
    frontier = set(names)
    while frontier:
        new: set[str] = set()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if not isinstance(target, jinja2.nodes.Name) or target.name in found:
                continue
            if _accesses(assign.node, frontier, key):
                new.add(target.name)
        found |= new
        frontier = new if key is None else set()
    return found


def _detect_content_format(root: jinja2.nodes.Template) -> Literal["string", "openai"]:
    """Return "openai" if the template iterates over a message's `content` (so it expects a list of parts).

    Same rule as vLLM's auto detection: find loops over `messages` (or aliases of it), then a loop
    over `<message>.content` (or a variable set from it). Everything else gets plain strings.
    """
    message_lists = _aliases(root, {"messages"})
    message_vars: set[str] = set()
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and _accesses(loop.iter, message_lists):
            message_vars.add(loop.target.name)
    if not message_vars:
        return "string"
    content_vars = _aliases(root, message_vars, "content")
    for loop in root.find_all(jinja2.nodes.For):
        if _accesses(loop.iter, message_vars, "content") or (
            content_vars and _accesses(loop.iter, content_vars)
        ):
            return "openai"
    return "string"


# --------------------------------------------------------------------------------------------------
# Message normalisation (vLLM's parse of OpenAI messages into template input)
# --------------------------------------------------------------------------------------------------

_TEXT_PART_TYPES = {"text": "text", "refusal": "refusal"}
MEDIA_MARK = "\u27e6kvrouter:media\u27e7"
"""Stands in for an image, audio or video part while the template renders: the prompt is matched
up to the first one only (:class:`PrefixTokens`)."""
_MEDIA_KEEP_BEFORE = 2
"""Tokens dropped before the first media part: a tokenizer may merge the text's last characters
with what follows them, and the engine's prompt has the media's placeholders there."""


_IMAGE = object()
"""An image part the template renders itself (``{"type": "image"}``, as vLLM passes it)."""


def _part_texts(content: Any, index: int, images: list[str | None] | None = None) -> list[Any]:
    """The text pieces of one message's content (string, None or list of parts). With ``images``,
    an image part becomes :data:`_IMAGE` and its identifier (the client's ``uuid``, or None) is
    appended there; every other media part is :data:`MEDIA_MARK`."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise TokenizerError(f"messages[{index}].content must be a string, a list of parts or null")
    texts: list[Any] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise TokenizerError(f"messages[{index}].content[{j}] must be an object")
        ptype = part.get("type", "text")
        field = _TEXT_PART_TYPES.get(ptype) if isinstance(ptype, str) else None
        if field is None:
            if images is not None and ptype in IMAGE_PART_TYPES:
                uuid = part.get("uuid")
                images.append(None if uuid is None else str(uuid))
                texts.append(_IMAGE)
                continue
            # other media expand into model-specific placeholder tokens inside the engine: the
            # prompt is matched up to the first one (PrefixTokens)
            texts.append(MEDIA_MARK)
            continue
        text = part.get(field)
        if not isinstance(text, str):
            raise TokenizerError(f"messages[{index}].content[{j}].{field} must be a string")
        texts.append(text)
    return texts


def _tool_calls(raw: Any, index: int) -> list[dict[str, Any]] | None:
    """Copy assistant tool calls with `function.arguments` parsed to a dict, as templates expect.

    Malformed argument strings become `{}` (vLLM does the same so a bad turn in history does not
    poison every later request). The request body is never mutated: the router forwards it as is.
    """
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise TokenizerError(f"messages[{index}].tool_calls must be a list")
    if not raw:
        return None
    calls: list[dict[str, Any]] = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise TokenizerError(f"messages[{index}].tool_calls entries must be function calls")
        args = function.get("arguments")
        parsed: Any
        if not args:
            parsed = {}
        elif isinstance(args, dict):
            parsed = args
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = {}
        else:
            parsed = args
        if not isinstance(parsed, dict):
            parsed = {}
        calls.append({**call, "function": {**function, "arguments": parsed}})
    return calls


def _normalize_messages(
    messages: Any, content_format: Literal["string", "openai"], images: list[str | None] | None = None
) -> list[dict[str, Any]]:
    """Build the conversation the template sees from OpenAI messages, keeping only the keys vLLM
    keeps. ``images`` (openai content format only): see :func:`_part_texts`."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TokenizerError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise TokenizerError(f"messages[{i}].role must be a string")
        texts = _part_texts(msg.get("content"), i, images if content_format == "openai" else None)
        content: Any
        if content_format == "openai":
            content = [{"type": "image"} if t is _IMAGE else {"type": "text", "text": t} for t in texts]
        else:
            content = "\n".join(texts)
        conv: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = _tool_calls(msg.get("tool_calls"), i)
            if calls is not None:
                conv["tool_calls"] = calls
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                conv["reasoning"] = reasoning
                conv["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in msg:
            conv["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            conv["name"] = msg["name"]
        out.append(conv)
    return out


def _final_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return str(part["text"])
    raise TokenizerError("continue_final_message is set but the final message has no text")


def _cut_after_final_message(rendered: str, final: str) -> str:
    """Drop what the template wrote after the final message (end-of-turn tokens, newlines).

    Same rule as HF `continue_final_message`: find the last occurrence of the stripped message; keep
    its trailing whitespace only if the template kept it verbatim.
    """
    stripped = final.strip()
    if stripped not in rendered:
        raise TokenizerError(
            "continue_final_message is set but the chat template dropped the final message text"
        )
    start = rendered.rindex(stripped)
    lstripped = final.lstrip()
    if rendered[start : start + len(lstripped)] == final:
        return rendered[: start + len(lstripped)]
    return rendered[: start + len(stripped)]


# --------------------------------------------------------------------------------------------------
# ChatTokenizer
# --------------------------------------------------------------------------------------------------

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})
_REQUEST_TEMPLATE_CACHE = 8


def _token_string(value: Any) -> str | None:
    """A special token from tokenizer_config: a string or an AddedToken-style {"content": ...} object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must contain a JSON object")
    return data


def _templates_from_config(config: Mapping[str, Any], source: Path) -> dict[str, str]:
    raw = config.get("chat_template")
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for item in raw:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise TokenizerError(
                    f"{source}: chat_template list entries need string 'name' and 'template'"
                )
            named[item["name"]] = item["template"]
        return named
    raise TokenizerError(f"{source}: chat_template must be a string or a list of {{name, template}}")


_FUNCTION_FIELDS = ("name", "description", "parameters")


def _as_vllm_tool(tool: Any) -> Any:
    """A request's tool as vLLM hands it to the template: its pydantic model dumped, so every
    declared field is there (``type``; ``name``, ``description``, ``parameters``, None when
    absent) in declaration order, the extra ones (``strict``, ...) after. Templates that write the
    tools with ``tojson`` (Qwen, Hermes, Llama 3.1) otherwise rendered other text from the tools on:
    no cache match past them. Anything not shaped like a tool is left as it is (vLLM refuses it)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    fn = tool["function"]
    function = {f: fn.get(f) for f in _FUNCTION_FIELDS}
    function |= {k: v for k, v in fn.items() if k not in function}
    out = {"type": tool.get("type", "function"), "function": function}
    return out | {k: v for k, v in tool.items() if k not in out}


class ChatTokenizer:
    """A HF `tokenizer.json` plus its chat template, producing the engine's token ids. Thread-safe.

    Everything mutable is set up in the constructor, except the segment cache (lock-guarded);
    afterwards the Rust tokenizer is only read (`encode_batch_fast` takes a shared borrow and
    releases the GIL) and compiled Jinja templates are reentrant, so one instance serves the
    router's worker threads and the mock engine concurrently.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, Any] | None = None,
        content_format: ContentFormat = "auto",
        name: str = "",
        cache_bytes: int = 32 << 20,
        image_prompt: ImagePrompt | None = None,
    ) -> None:
        """`chat_templates` maps template names to sources ("default" is used; "tool_use" when tools
        are given and it exists). `special_tokens` holds bos_token, eos_token, ... as template
        variables. `cache_bytes` bounds the segment cache (:mod:`router.decision.segments`; 0: off).
        `image_prompt`: what the engine puts in an image's place, when the model's files fix it
        (:func:`router.decision.media.image_prompt_of`); None: prompts match up to their first image."""
        self._tok = tokenizer
        self.image_prompt = image_prompt
        self.segments = SegmentCache(tokenizer, cache_bytes)
        self.name = name
        self._env = _make_environment()
        self._special: dict[str, Any] = dict(special_tokens or {})
        self._templates: dict[str, tuple[jinja2.Template, frozenset[str], Literal["string", "openai"]]] = {}
        for tname, source in (chat_templates or {}).items():
            self._templates[tname] = self._compile(source, content_format, f"chat template {tname!r}")
        self._sources = dict(chat_templates or {})
        self._content_format: ContentFormat = content_format
        self._request_templates: OrderedDict[
            str, tuple[jinja2.Template, frozenset[str], Literal["string", "openai"]]
        ]
        self._request_templates = OrderedDict()
        self._lock = threading.Lock()
        vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._max_token_id = max(vocab.values()) if vocab else -1
        self._special_ids = frozenset(
            int(i) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_path(
        cls, path: str | Path, *, content_format: ContentFormat = "auto", cache_bytes: int = 32 << 20
    ) -> ChatTokenizer:
        """Load a `tokenizer.json` file, or a model directory in the HF layout.

        A directory needs `tokenizer.json`; `tokenizer_config.json` adds special tokens,
        `add_bos_token` / `add_eos_token` and `chat_template`; `chat_template.jinja` (newer layout)
        overrides the config's default template and `additional_chat_templates/<name>.jinja` adds
        named ones. A lone file has no chat template. Raises `TokenizerError` on missing or bad files.
        """
        p = Path(path)
        if p.is_dir():
            tok_path, directory = p / "tokenizer.json", p
        elif p.is_file():
            tok_path, directory = p, None
        else:
            raise TokenizerError(f"tokenizer path does not exist: {p}")
        if not tok_path.is_file():
            raise TokenizerError(
                f"{p} has no tokenizer.json (only fast HF tokenizers are supported;"
                " convert sentencepiece models first)"
            )
        try:
            tok = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust loader raises plain Exception subclasses
            raise TokenizerError(f"invalid tokenizer file {tok_path}: {exc}") from exc

        config: dict[str, Any] = {}
        templates: dict[str, str] = {}
        if directory is not None:
            cfg_path = directory / "tokenizer_config.json"
            if cfg_path.is_file():
                config = _read_json(cfg_path)
                templates = _templates_from_config(config, cfg_path)
            extra_dir = directory / "additional_chat_templates"
            if extra_dir.is_dir():
                for f in sorted(extra_dir.glob("*.jinja")):
                    templates[f.stem] = f.read_text(encoding="utf-8")
            jinja_file = directory / "chat_template.jinja"
            if jinja_file.is_file():
                templates["default"] = jinja_file.read_text(encoding="utf-8")

        special: dict[str, Any] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_string(config.get(key))
            if value is not None:
                special[key] = value
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [s for s in map(_token_string, extra) if s is not None]

        _apply_bos_eos_flags(tok, config, special, tok_path)
        if config.get("split_special_tokens") is True:
            tok.encode_special_tokens = True
        return cls(
            tok,
            chat_templates=templates,
            special_tokens=special,
            content_format=content_format,
            name=str(p),
            cache_bytes=cache_bytes,
            image_prompt=image_prompt_of(directory, tok) if directory is not None else None,
        )

    def _compile(
        self, source: str, content_format: ContentFormat, what: str
    ) -> tuple[jinja2.Template, frozenset[str], Literal["string", "openai"]]:
        try:
            ast = self._env.parse(source)
            template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"{what} is not valid Jinja2 (line {exc.lineno}): {exc.message}") from exc
        variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        fmt = _detect_content_format(ast) if content_format == "auto" else content_format
        return template, variables, fmt

    # --- properties -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens (HF `len(tokenizer)`)."""
        return self._vocab_size

    @property
    def max_token_id(self) -> int:
        """Largest valid id; vLLM rejects prompt ids above it."""
        return self._max_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_templates(self) -> dict[str, str]:
        """Template sources by name ("default", and e.g. "tool_use")."""
        return dict(self._sources)

    @property
    def bos_token(self) -> str | None:
        value = self._special.get("bos_token")
        return value if isinstance(value, str) else None

    @property
    def eos_token(self) -> str | None:
        value = self._special.get("eos_token")
        return value if isinstance(value, str) else None

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token else None

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def content_format(self, tools: Sequence[Any] | None = None) -> Literal["string", "openai"]:
        """The content format the selected template gets (see module docstring)."""
        return self._select(tools)[2]

    # --- encoding -------------------------------------------------------------------------------

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for a prompt text; `add_special_tokens` runs the post-processor (usually BOS). Text
        between added tokens seen before comes from the segment cache (exact, see its module)."""
        if not isinstance(text, str):
            raise TokenizerError("prompt must be a string")
        return self.segments.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def is_special_id(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _select(
        self, tools: Sequence[Any] | None, override: str | None = None
    ) -> tuple[jinja2.Template, frozenset[str], Literal["string", "openai"]]:
        if override is not None:
            return self._request_template(override)
        if not self._templates:
            # (a lone tokenizer.json, or an engine given its template by --chat-template): the
            # engine can serve the request, the router cannot tokenize it: routed on load only
            raise TokenizerUnavailable(
                f"model tokenizer {self.name or '(unnamed)'} has no chat template (routed on load only)"
            )
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise TokenizerError(f"no 'default' chat template among {sorted(self._templates)}")

    def _request_template(
        self, source: str
    ) -> tuple[jinja2.Template, frozenset[str], Literal["string", "openai"]]:
        """Compile a per-request `chat_template` (bounded LRU: clients tend to resend the same one)."""
        if not isinstance(source, str):
            raise TokenizerError("chat_template must be a string")
        with self._lock:
            hit = self._request_templates.get(source)
            if hit is not None:
                self._request_templates.move_to_end(source)
                return hit
        compiled = self._compile(source, self._content_format, "request chat_template")
        with self._lock:
            self._request_templates[source] = compiled
            while len(self._request_templates) > _REQUEST_TEMPLATE_CACHE:
                self._request_templates.popitem(last=False)
        return compiled

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        large: bool = False,
        images: list[str | None] | None = None,
    ) -> str:
        """Render the chat template to the exact prompt text the engine will tokenize.

        `chat_template_kwargs` keys reach the template only if it references them (vLLM filters them
        the same way), the explicit arguments win over them, and special tokens are defaults they can
        override. `chat_template` is a per-request template (vLLM only accepts it when trusted).
        `large`: a large request, rendered in a worker thread: ``tojson`` then encodes in short
        steps (the same text). Raises `TokenizerError` for invalid messages, a missing template or
        a template error (such as `raise_exception` for an unsupported role). Media parts render as
        :data:`MEDIA_MARK`; with ``images`` (a list, filled in prompt order with each image's
        ``uuid`` or None) and the openai content format, image parts reach the template as
        ``{"type": "image"}`` parts, as vLLM passes them, and render as its own placeholder.
        """
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt cannot both be true")
        if tools is not None and not isinstance(tools, list):
            raise TokenizerError("tools must be a list")
        if documents is not None and not isinstance(documents, list):
            raise TokenizerError("documents must be a list")
        template, variables, fmt = self._select(tools, chat_template)
        conversation = _normalize_messages(messages, fmt, images)
        context: dict[str, Any] = dict(self._special)
        if chat_template_kwargs:
            if not isinstance(chat_template_kwargs, Mapping):
                raise TokenizerError("chat_template_kwargs must be an object")
            reserved = _RESERVED_TEMPLATE_KWARGS & chat_template_kwargs.keys()
            if reserved:
                raise TokenizerError(f"chat_template_kwargs may not set {sorted(reserved)}")
            context.update({k: v for k, v in chat_template_kwargs.items() if k in variables})
        context.update(
            messages=conversation,
            tools=[_as_vllm_tool(t) for t in tools] if tools is not None else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        _rendering.large = large
        try:
            rendered = template.render(**context)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc}") from exc
        except Exception as exc:  # templates can raise TypeError etc. on odd input; vLLM answers 400 too
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _rendering.large = False
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, _final_text(conversation[-1]))
        return rendered

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
    ) -> list[int]:
        """Render then encode. `add_special_tokens` defaults to False like vLLM's chat endpoint: the
        template already starts with BOS, and the post-processor would add a second one. `large`:
        see :meth:`render_chat`; a prompt longer than `max_chars` is not encoded
        (`TokenizerUnavailable`).

        Images, for a model whose image range is known (:attr:`image_prompt`): expanded as the
        engine expands them, and a :class:`MediaTokens` carrying each one's range and ``uuid``
        (its identifier in vLLM's block keys) when every image has one; else the prompt up to the
        first image without one (:class:`PrefixTokens`). ``media_uuids`` False (the request sets
        options vLLM hashes into the identifier): no image has a known identifier. Anything else
        (other media; a placeholder count that is not the image count) is matched up to its first
        media part, as for a model whose range is unknown."""
        images: list[str | None] | None = [] if self.image_prompt is not None else None
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
            documents=documents,
            chat_template=chat_template,
            large=large,
            images=images,
        )
        if max_chars is not None and len(text) > max_chars:
            raise prompt_too_long(len(text), max_chars)
        media = text.find(MEDIA_MARK)
        prompt = self.image_prompt
        if images and prompt is not None and media < 0:
            known: list[str | None] = images if media_uuids else [None] * len(images)
            return self._with_images(text, known, add_special_tokens)
        if media >= 0:
            ids = self.encode_prompt(text[:media], add_special_tokens=add_special_tokens)
            if images and prompt is not None and prompt.placeholder in ids:
                return PrefixTokens(ids[: ids.index(prompt.placeholder)])  # (a special token: no merge)
            return PrefixTokens(ids[: max(len(ids) - _MEDIA_KEEP_BEFORE, 0)])
        return self.encode_prompt(text, add_special_tokens=add_special_tokens)

    def _with_images(self, text: str, identifiers: list[str | None], add_special_tokens: bool) -> list[int]:
        """The engine's prompt for a rendered prompt with images (:meth:`encode_chat`)."""
        prompt = self.image_prompt
        assert prompt is not None
        ids = self.encode_prompt(text, add_special_tokens=add_special_tokens)
        if ids.count(prompt.placeholder) != len(identifiers):
            # (the template dropped or repeated an image, or a text part holds the placeholder:
            # vLLM's own count check decides; the router keeps to what precedes the first one)
            first = ids.index(prompt.placeholder) if prompt.placeholder in ids else len(ids)
            return PrefixTokens(ids[:first])
        out, spans, unknown = expand_images(ids, prompt, identifiers)
        tokens = MediaTokens(out) if unknown is None else PrefixTokens(out)
        tokens.spans = tuple(spans)
        return tokens


def _apply_bos_eos_flags(
    tok: Tokenizer, config: Mapping[str, Any], special: Mapping[str, Any], source: Path
) -> None:
    """Honour `add_bos_token` / `add_eos_token` from tokenizer_config.json as transformers does.

    When either key is present, transformers (v5 for every fast tokenizer; v4 for Llama-style
    classes) replaces the post-processor with "[BOS] $A [EOS]" per the flags (a missing flag is
    false). Without the keys, tokenizer.json's own post-processor is used unchanged.
    """
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    add_bos = bool(config.get("add_bos_token")) and isinstance(special.get("bos_token"), str)
    add_eos = bool(config.get("add_eos_token")) and isinstance(special.get("eos_token"), str)
    pieces: list[tuple[str, int]] = []
    for flag, key in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag:
            token = str(special[key])
            tid = tok.token_to_id(token)
            if tid is None:
                raise TokenizerError(f"{source}: {key} {token!r} is not in the vocabulary")
            pieces.append((token, int(tid)))
    bos = f"{special['bos_token']}:0 " if add_bos else ""
    eos = f" {special['eos_token']}:0" if add_eos else ""
    single = f"{bos}$A:0{eos}"
    pair = f"{single} {bos.replace(':0', ':1')}$B:1{eos.replace(':0', ':1')}"
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=pieces)
