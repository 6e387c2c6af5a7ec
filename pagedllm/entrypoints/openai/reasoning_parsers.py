"""Reasoning models' thinking split from their answer (vLLM's `--reasoning-parser`): what a reply writes inside
`<think>…</think>` goes to `reasoning_content` (chat) and reasoning items (the Responses API), the rest is content.

- `qwen3`: the model opens the block itself; with thinking off (the template put an empty block in the prompt)
  there is no tag and everything is content; a block the length limit cut is all reasoning.
- `deepseek_r1`: the generation prompt may already have opened the block, so the reply starts inside it (an
  opening tag, if written, is dropped); everything before `</think>` is reasoning, and with no `</think>` at all
  everything is.

Both follow vLLM's parsers of those names, but for one thing: the newlines the model writes after `</think>` (the
templates' own layout: Qwen3's puts `</think>` then two newlines, and drops them itself when it shows an earlier turn)
are not content, where vLLM keeps them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

from pagedllm.entrypoints.openai.tool_parsers import partial_marker

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Split:
    """A reply's reasoning and content (None where it has none)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True, slots=True)
class Settled:
    """What an unfinished reply has settled: the reasoning and the content that no later text can change. For every
    reply `t` that text `p` may still grow into, `settled(p).reasoning` is a prefix of `split(t).reasoning` and
    `settled(p).content` of `split(t).content` (None read as ""): tags and partial tags are never in them, and text
    that may yet turn out to be a tag is held back. A stream that counts the characters of each it already sent
    sends `reasoning[sent:]` and `content[sent:]` of each new reading, and at the end the rest of `split`'s."""

    reasoning: str
    content: str


class ReasoningParser(Protocol):
    # How a constraint waits for the answer (StructuredOutputsParams.reasoning): "optional" or "open".
    grammar_block: str

    def split(self, text: str) -> Split:
        """A finished reply's reasoning and content."""

    def settled(self, text: str) -> Settled:
        """Of an unfinished reply, the prefixes of its final reasoning and content that are known already."""


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
        return Settled(body[: len(body) - partial_marker(body, END)], "")
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
# `--reasoning-parser`'s choices: "auto" picks by the chat template, "none" splits nothing.
REASONING_PARSERS: tuple[str, ...] = ("auto", "none", *_PARSERS)


def get_reasoning_parser(name: str | None, template: str | None) -> ReasoningParser | None:
    """The parser `name` names; None or "none": none; "auto": chosen from the chat template where it says clearly:
    one whose generation prompt opens the block is R1's way (DeepSeek-R1, QwQ, Qwen3's Thinking-2507), one that
    knows `enable_thinking` and the tags is Qwen3's; any other template, none."""
    if name is None or name == "none":
        return None
    if name == "auto":
        return _parser_for(template)
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return _PARSERS[name]()


def _parser_for(template: str | None) -> ReasoningParser | None:
    if template is None or START not in template:
        return None  # a template without the tag cannot write it into the prompt
    # Asked first: a template may both know `enable_thinking` and open the block itself when thinking is on
    # (Qwen3.5's), and then the reply starts inside the block, as R1's does.
    if _prompt_opens_block(template):
        return DeepSeekR1Parser()
    if "enable_thinking" in template:
        return Qwen3Parser()
    return None


@functools.lru_cache(maxsize=16)
def _prompt_opens_block(template: str) -> bool:
    """Whether the template's generation prompt ends by opening the block, as transformers renders it for a one-line
    chat: read from the rendering, because the templates spell the prompt many ways (DeepSeek's with full-width bars
    in `<｜Assistant｜>`, Jinja string escapes, the tag also written for earlier turns)."""
    try:
        (rendered,), _ = render_jinja_template(
            [[{"role": "user", "content": "hi"}]],
            chat_template=template,
            add_generation_prompt=True,
            # Templates add these to strings; undefined, that addition fails.
            bos_token="",
            eos_token="",
        )
    except (jinja2.TemplateError, TypeError, ValueError):
        return False  # a template that cannot render this chat names no parser
    return rendered.rstrip().endswith(START)
