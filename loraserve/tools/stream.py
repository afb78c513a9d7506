"""A reply streamed as OpenAI streams tool calls: content as it comes, each call's name once (with its id), then its
arguments in pieces; the format's markup is never sent as content."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from loraserve.tools.formats import ToolCallFormat
from loraserve.tools.reply import ReplySoFar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, in the call's first delta
    name: str | None = None


@dataclass
class ReplyDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ReplyStream:
    """What one choice's reply has sent so far; `update` with the whole text so far gives what is new."""

    format: ToolCallFormat
    text: str = ""
    sent_content: str = ""
    call_ids: list[str] = field(default_factory=list)
    sent_arguments: list[str] = field(default_factory=list)

    def update(self, new_text: str, final: bool) -> ReplyDelta:
        self.text += new_text
        reply = self.format.read(self.text, final)
        delta = ReplyDelta(content=self._content_delta(reply, final))
        for index, call in enumerate(reply.calls):
            if call.name is None:
                break
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.sent_arguments.append("")
                delta.calls.append(CallDelta(index, "", self.call_ids[index], call.name))
            if news := call.arguments[len(self.sent_arguments[index]) :]:
                delta.calls.append(CallDelta(index, news))
                self.sent_arguments[index] = call.arguments
        return delta

    def _content_delta(self, reply: ReplySoFar, final: bool) -> str:
        content = reply.content
        if not final or reply.calls:  # trailing whitespace waits for what follows it: before a call it is dropped
            content = content.rstrip()
        news = content[len(self.sent_content) :] if content.startswith(self.sent_content) else ""
        self.sent_content += news
        return news
