"""A message's content given as a list of parts (both OpenAI APIs): the texts it holds. The model reads text only, so
an image, audio or file part is refused naming the part (`messages.0.content.1.type`), as is any type not listed."""

from __future__ import annotations

from typing import Any

from loraserve.errors import InvalidRequestError

MEDIA_PARTS = ("image_url", "input_audio", "file", "input_image", "input_file")


def part_texts(content: Any, field: str, text_keys: dict[str, str], strict: bool) -> list[str]:
    """The texts of `content`'s parts; `text_keys` maps each part type read to the key of its text. `strict`: a part
    holding any other key is refused naming it (else such keys, an earlier response's annotations say, are ignored)."""
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(field, "must be text or a non-empty list of content parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{field}.{j}"
        if not isinstance(part, dict):
            raise InvalidRequestError(where, f"must be a content part (an object), got {type(part).__name__}")
        kind = part.get("type")
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            raise InvalidRequestError(f"{where}.type", f"{kind!r} parts are not supported: the model reads text only")
        if not isinstance(kind, str) or kind not in text_keys:
            raise InvalidRequestError(f"{where}.type", f"must be one of {', '.join(text_keys)}, got {kind!r}")
        key = text_keys[kind]
        if not isinstance(part.get(key), str):
            raise InvalidRequestError(f"{where}.{key}", "must be a string")
        if strict and (extra := sorted(set(part) - {"type", key})):
            raise InvalidRequestError(f"{where}.{extra[0]}", "is not supported by loraserve")
        texts.append(part[key])
    return texts
