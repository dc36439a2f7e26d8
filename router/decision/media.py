"""Images in chat prompts: the tokens vLLM puts in their place, and the identifiers it hashes them
with, where the router can know both.

vLLM replaces each image's placeholder token in the rendered prompt with a model-specific run of
tokens (its placeholder range) and keys every block that range touches with the image's identifier
and the range's start relative to the block. The identifier is the client's per-part ``uuid``
when the request sets one (and no per-request processor or media options change it); otherwise a
digest of the decoded image that the router does not compute (it would have to decode the image
and reproduce vLLM's media hasher). The range's tokens are known only for models whose
replacement is fixed by their files: :func:`image_prompt_of` says which.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from tokenizers import Tokenizer

IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
"""Content parts vLLM parses as one image each (its ``image_pil`` and ``image_embeds`` parts are
not sent over HTTP as data the router can place, so they keep the first-media rule)."""

MAX_IMAGE_TOKENS = 1 << 16
"""Bound on one image's range read from a model's files."""


class ImagePrompt(msgspec.Struct, frozen=True):
    """One image in the engine's prompt: the token the chat template renders for an image part,
    and the tokens the engine puts in its place (the media's placeholder range, whole)."""

    placeholder: int
    expansion: tuple[int, ...]


class MediaSpan(NamedTuple):
    """One image's placeholder range in the engine's prompt and its identifier."""

    offset: int
    length: int
    identifier: str


class MediaTokens(list[int]):
    """A chat prompt's tokens exactly as the engine has them, images expanded, with each image's
    range and identifier (:class:`MediaSpan`): the blocks they touch are salted with the extra keys
    vLLM puts there (:func:`index.keys.request_extra_keys`)."""

    spans: tuple[MediaSpan, ...] = ()


def _read(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def image_prompt_of(directory: Path, tok: Tokenizer) -> ImagePrompt | None:
    """The image range of the model in ``directory``, when its files fix it; None otherwise (the
    prompt is then matched up to its first image).

    Known: Idefics3 (``model_type`` "idefics3") with image splitting off, where every image is one
    global image: ``<fake_token_around_image><global-img>`` + ``<image>`` x ``image_seq_len`` +
    ``<fake_token_around_image>``, encoded as vLLM encodes it (the string through the tokenizer,
    no special tokens added). With splitting on, the tile grid depends on each image's size, which
    the router does not decode. ``image_seq_len`` is the processor's, else derived from the vision
    config as the processor derives it. Engine-side ``--mm-processor-kwargs`` that change either
    are not visible here: such an engine's image blocks then never match (keys differ), never
    falsely."""
    config = _read(directory / "config.json")
    if config.get("model_type") != "idefics3":
        return None
    pre = _read(directory / "preprocessor_config.json")
    if pre.get("do_image_splitting", True) is not False:
        return None
    proc = _read(directory / "processor_config.json")
    seq_len = proc.get("image_seq_len")
    if not isinstance(seq_len, int):
        vision = config.get("vision_config") or {}
        size, patch, scale = vision.get("image_size"), vision.get("patch_size"), config.get("scale_factor", 2)
        if not (isinstance(size, int) and isinstance(patch, int) and isinstance(scale, int)):
            return None
        if min(size, patch, scale) <= 0:
            return None
        seq_len = int((size // patch) ** 2 / scale**2)
    if not 0 < seq_len <= MAX_IMAGE_TOKENS:
        return None
    image = tok.token_to_id("<image>")
    if image is None:
        return None
    repl = "<fake_token_around_image><global-img>" + "<image>" * seq_len + "<fake_token_around_image>"
    ids = tuple(tok.encode(repl, add_special_tokens=False).ids)
    if ids.count(image) != seq_len:
        return None
    return ImagePrompt(placeholder=image, expansion=ids)


def expand_images(
    ids: Sequence[int], prompt: ImagePrompt, identifiers: Sequence[str | None]
) -> tuple[list[int], list[MediaSpan], int | None]:
    """The engine's prompt from the rendered prompt's ids: the k-th placeholder (in prompt order,
    as vLLM assigns images) replaced by the k-th image's range. Returns the ids, the spans of the
    images with an identifier before the first one without, and where that one starts (None when
    every image has one: the prompt is then known whole)."""
    out: list[int] = []
    spans: list[MediaSpan] = []
    k = 0
    for t in ids:
        if t != prompt.placeholder:
            out.append(t)
            continue
        ident = identifiers[k] if k < len(identifiers) else None
        k += 1
        if ident is None:
            return out, spans, len(out)
        spans.append(MediaSpan(len(out), len(prompt.expansion), ident))
        out.extend(prompt.expansion)
    return out, spans, None
