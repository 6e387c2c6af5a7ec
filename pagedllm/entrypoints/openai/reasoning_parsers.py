"""Reasoning models' thinking split from their answer (vLLM's `--reasoning-parser`): what a reply writes inside
`<think>…</think>` goes to `reasoning_content` (chat) and reasoning items (the Responses API), the rest is content.

- `qwen3`: the model opens the block itself; with thinking off (the template put an empty block in the prompt)
  there is no tag and everything is content; a block the length limit cut is all reasoning.
- `deepseek_r1`: the generation prompt may already have opened the block, so the reply starts inside it (an
  opening tag, if written, is dropped); everything before `</think>` is reasoning, and with no `</think>` at all
  everything is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Split:
    """A reply's reasoning and content (None where it has none)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True, slots=True)
class Settled:
    """What an unfinished reply has settled: the reasoning and the content that no later text can change."""

    reasoning: str
    content: str


class ReasoningParser(Protocol):
    # How a constraint waits for the answer (StructuredOutputsParams.reasoning): "optional" or "open".
    grammar_block: str

    def split(self, text: str) -> Split:
        """A finished reply's reasoning and content."""

    def settled(self, text: str) -> Settled:
        """Of an unfinished reply, the prefixes of its final reasoning and content that are known already."""


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may still grow into `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class Qwen3Parser:
    """The block counts only where the reply opens with it (after any blank space): a tag quoted later in an
    answer is the answer's."""

    grammar_block = "optional"

    def split(self, text: str) -> Split:
        opened = text.lstrip()
        if not opened.startswith(START):
            return Split(None, text)
        body = opened[len(START) :]
        end = body.find(END)
        if end < 0:
            return Split(body, None)  # cut inside the block
        return Split(body[:end], _answer(body[end + len(END) :]))

    def settled(self, text: str) -> Settled:
        opened = text.lstrip()
        if START.startswith(opened):
            return Settled("", "")  # nothing yet, or the opening tag on its way
        if not opened.startswith(START):
            return Settled("", text)
        return _inside(opened[len(START) :])


def _inside(body: str) -> Settled:
    """Settled text of a reply whose block is open: the reasoning up to a tag that may be on its way."""
    end = body.find(END)
    if end < 0:
        return Settled(body[: len(body) - _held(body, END)], "")
    return Settled(body[:end], _answer(body[end + len(END) :]) or "")


def _answer(after: str) -> str | None:
    """The content after the block, without the blank lines templates put between the two (Qwen3's and R1's
    write `</think>` then two newlines)."""
    return after.lstrip("\n") or None


class DeepSeekR1Parser:
    grammar_block = "open"

    def split(self, text: str) -> Split:
        body = text.removeprefix(START)
        end = body.find(END)
        if end < 0:
            return Split(body, None)
        return Split(body[:end], _answer(body[end + len(END) :]))

    def settled(self, text: str) -> Settled:
        if START.startswith(text):
            return Settled("", "")  # the opening tag, or part of it
        return _inside(text.removeprefix(START))


def closed_in_prompt(prompt: str) -> bool:
    """Whether the generation prompt itself ends with a closed block (Qwen3's `enable_thinking: false`), as vLLM
    reads the prompt's tokens: the reply then has no thinking to split off or to wait for."""
    return prompt.rstrip().endswith(END)


_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3Parser, "deepseek_r1": DeepSeekR1Parser}


def get_reasoning_parser(name: str, template: str | None) -> ReasoningParser | None:
    """The parser `name` names; "none": none; "auto": chosen from the chat template where it says clearly: one that
    opens the block in its generation prompt is R1's way (DeepSeek-R1, QwQ), one that knows `enable_thinking` and
    the tags is Qwen3's; any other template, none."""
    if name == "none":
        return None
    if name != "auto":
        return _PARSERS[name]()
    if template is None or END not in template:
        return None
    if "<|Assistant|><think>" in template or "<|im_start|>assistant\\n<think>\\n" in template:
        return DeepSeekR1Parser()
    if "enable_thinking" in template:
        return Qwen3Parser()
    return None
