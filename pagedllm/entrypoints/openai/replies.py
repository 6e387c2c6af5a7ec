"""A reply's text as the client sees it: the reasoning (a reasoning model's `<think>` block), the content, and the
tool calls found in the content; whole, or released piece by piece for a stream so that the pieces add up to the
whole reading. Chat and the Responses API read replies the same way."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai import reasoning_parsers, tool_parsers


@dataclass(frozen=True, slots=True)
class Reading:
    reasoning: str | None
    content: str | None
    calls: tuple[tool_parsers.ParsedCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Released:
    """What a stream may send now of one reply: new reasoning text, then new content."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True, slots=True)
class ReplyReader:
    """How one request's replies are read: `reasoning` splits off the thinking, `tools` finds calls in what follows
    it (either may be None)."""

    reasoning: reasoning_parsers.ReasoningParser | None = None
    tools: tool_parsers.ToolParser | None = None

    def read(self, text: str) -> Reading:
        reasoning, content = self._split(text)
        if self.tools is None or content is None:
            return Reading(reasoning, content)
        parsed = self.tools.parse(content)
        return Reading(reasoning, parsed.content, parsed.calls)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    def _split(self, text: str) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text)
        return split.reasoning, split.content


@dataclass(slots=True)
class ReplyStream:
    """One reply streamed: its text so far, and how much of its reasoning and content went out. While it runs,
    only what no later text can change is released (a tag or a tool call may still begin); when it finishes, the
    rest of the whole reading."""

    reader: ReplyReader
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def advance(self, new_text: str) -> Released:
        """What `new_text`, the unfinished reply's next piece, settles."""
        self.text += new_text
        reasoning, content = self._settled(self.text)
        return self._release(reasoning, content)

    def finish(self, new_text: str) -> tuple[Released, Reading]:
        """The rest of the reply, `new_text` its last piece, and its whole reading (whose calls go out whole)."""
        self.text += new_text
        reading = self.reader.read(self.text)
        return self._release(reading.reasoning or "", reading.content or ""), reading

    def _settled(self, text: str) -> tuple[str, str]:
        reasoning, content = "", text
        if self.reader.reasoning is not None:
            settled = self.reader.reasoning.settled(text)
            reasoning, content = settled.reasoning, settled.content
        if self.reader.tools is not None:
            content = content[: self.reader.tools.settled(content)]
        return reasoning, content

    def _release(self, reasoning: str, content: str) -> Released:
        released = Released(reasoning[self.reasoning_sent :], content[self.content_sent :])
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        return released
