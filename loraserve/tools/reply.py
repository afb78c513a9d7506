"""A reply's text read as content and tool calls, whole or as far as it has been generated.

The formats (formats.py) write each call as a JSON object naming the function and holding its arguments; this module
reads such objects out of text, also while they are still being written: a call's name once its string is closed,
its arguments as far as they go. What is read from a longer text only ever extends what was read from its prefix,
so a stream can send the difference (stream.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class CallSoFar:
    name: str | None  # None until the name's string is closed
    arguments: str  # the arguments' JSON text as far as it goes
    complete: bool  # the arguments' value is closed


@dataclass
class ReplySoFar:
    content: str
    calls: list[CallSoFar] = field(default_factory=list)

    def complete_calls(self) -> list[CallSoFar]:
        return [call for call in self.calls if call.complete and call.name is not None]


def value_end(text: str) -> int | None:
    """Where the JSON value at the start of `text` (leading whitespace skipped) ends, or None while it is open.
    Strings and nesting are followed; the value's own validity is the grammar's business."""
    depth, in_string, escaped, started = 0, False, False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return i + 1
            continue
        if char.isspace() and not started:
            continue
        started = True
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and char in ",;\n":  # a bare number or literal ends at what follows it
            return i
    return None


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,?\s*')


def call_so_far(text: str, arguments_key: str) -> CallSoFar:
    """A call object `{"name": ..., "<arguments_key>": {...}}` as far as `text` goes (anything after it ignored).
    Read as written while the name comes first (what the grammar makes: a stream sees the text grow); a whole
    object in another order is read as JSON."""
    matched = _NAME.match(text)
    key = None if matched is None else re.compile(rf'"{re.escape(arguments_key)}"\s*:\s*').match(text, matched.end())
    if matched is None or key is None:
        whole = _whole_object(text)
        if whole is not None and isinstance(whole.get("name"), str):
            arguments = json.dumps(whole.get(arguments_key, {}), ensure_ascii=False)
            return CallSoFar(str(whole["name"]), arguments, True)
        return CallSoFar(None if matched is None else json.loads(f'"{matched.group(1)}"'), "", False)
    name = json.loads(f'"{matched.group(1)}"')
    rest = text[key.end() :]
    end = value_end(rest)
    return CallSoFar(name, rest if end is None else rest[:end], end is not None)


def _whole_object(text: str) -> dict[str, object] | None:
    end = value_end(text)
    if end is None:
        return None
    try:
        value = json.loads(text[:end])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def objects_so_far(text: str, arguments_key: str, separators: str) -> list[CallSoFar]:
    """Call objects one after another, `separators` (and whitespace) between them, as far as `text` goes."""
    calls: list[CallSoFar] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position >= len(text) or text[position] != "{":
            return calls
        end = value_end(text[position:])
        calls.append(call_so_far(text[position:] if end is None else text[position : position + end], arguments_key))
        if end is None:
            return calls
        position += end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (not yet content)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
