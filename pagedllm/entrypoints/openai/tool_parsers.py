"""Tool calling on chat: how tools and earlier calls reach the prompt, the schema that enforces a named or
required choice, and the parsers that find tool calls in a reply.

A chat template that knows tools gets them (and the messages) as transformers expects. One that ignores them
(SmolLM2's, say) would drop them silently, so the conversation is rewritten in the Hermes format instead,
as Qwen's and Hermes' templates render it: the tools in the system prompt, the assistant's calls as
`<tool_call>` JSON in its content, and tool results as `<tool_response>` in a user turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.entrypoints.openai import protocol

_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


# ---- the prompt -------------------------------------------------------------------------------


def knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def conversation(
    messages: Sequence[protocol.ChatMessage], tools: list[dict] | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The messages and tools to hand the chat template."""
    if knows_tools(template):
        return [message.for_template() for message in messages], tools
    return _hermes_messages(messages, tools), None


def _hermes_messages(messages: Sequence[protocol.ChatMessage], tools: list[dict] | None) -> list[dict[str, Any]]:
    rendered: list[dict[str, Any]] = []
    for previous, message in zip([None, *messages], messages, strict=False):
        if message.role == "tool":
            response = f"<tool_response>\n{message.text}\n</tool_response>"
            if previous is not None and previous.role == "tool":  # results of parallel calls share one turn
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
        elif message.tool_calls:
            calls = [
                _hermes_call(call.function.name, arguments)
                for call, arguments in zip(message.tool_calls, message.call_arguments(), strict=True)
            ]
            rendered.append({"role": "assistant", "content": "\n".join(filter(None, [message.text, *calls]))})
        else:
            rendered.append(message.for_template())
    if tools:
        _add_tools_prompt(rendered, tools)
    return rendered


def _hermes_call(name: str, arguments: dict | str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def _add_tools_prompt(messages: list[dict[str, Any]], tools: list[dict]) -> None:
    prompt = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0]["content"] = f"{prompt}\n\n{messages[0]['content']}"
    else:
        messages.insert(0, {"role": "system", "content": prompt})


# ---- constraints of a named or required choice -----------------------------------------------


def arguments_schema(tool: protocol.Tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def required_schema(tools: list[protocol.Tool], parallel: bool) -> dict:
    """A JSON array of calls, each `{"name": <a tool>, "parameters": <its arguments>}` (vLLM's shape)."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": arguments_schema(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    schema = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- parsing the reply ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    calls: tuple[ParsedCall, ...] = ()


class ToolParser(Protocol):
    def parse(self, text: str) -> Parsed:
        """The calls in a finished reply; a reply that does not parse as calls is all content."""

    def settled(self, text: str) -> int:
        """How much of an unfinished reply is content whatever follows: a stream may send that much."""


class _NotACall(ValueError):
    pass


def _call(value: object) -> ParsedCall:
    """`{"name": ..., "arguments" (or "parameters"): {...}}`: both names are in use."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise _NotACall(value)
    arguments = value.get("arguments", value.get("parameters"))
    if not isinstance(arguments, dict):
        raise _NotACall(value)
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly several; the text before the
    first is content. A last call the length limit cut before its closing tag still counts, as in vLLM."""

    _START = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        start = text.find(self._START)
        if start < 0:
            return Parsed(text)
        try:
            calls = tuple(_call(json.loads(body)) for body in self._CALL.findall(text, start))
        except ValueError:  # JSONDecodeError or _NotACall
            return Parsed(text)
        return Parsed(text[:start] or None, calls)

    def settled(self, text: str) -> int:
        start = text.find(self._START)
        return start if start >= 0 else len(text) - _partial_marker(text, self._START)


class Llama3JsonParser:
    """Llama 3's JSON calls: the whole reply is `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`."""

    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self._TAG).lstrip()
        if not body.startswith("{"):
            return Parsed(text)
        try:
            return Parsed(None, tuple(_call(value) for value in _json_values(body)))
        except ValueError:
            return Parsed(text)

    def settled(self, text: str) -> int:
        start = text.lstrip()
        if not start or start.startswith(("{", self._TAG)) or self._TAG.startswith(start):
            return 0
        return len(text)


def _json_values(body: str) -> list[object]:
    """The JSON values of `a; b; c`; ValueError if anything else is there."""
    decoder = json.JSONDecoder()
    values, position = [], 0
    while True:
        value, position = decoder.raw_decode(body, position)
        values.append(value)
        rest = body[position:].lstrip()
        if not rest:
            return values
        if not rest.startswith(";"):
            raise ValueError(f"expected ';' between calls, got {rest[:10]!r}")
        position = len(body) - len(rest[1:].lstrip())


class NamedCallParser:
    """A named tool choice: the constrained reply is the arguments of that one call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> Parsed:
        try:
            json.loads(text)
        except ValueError:  # cut by the length limit
            return Parsed(text)
        return Parsed(None, (ParsedCall(self.name, text),))

    def settled(self, text: str) -> int:
        return 0


class RequiredCallsParser:
    """tool_choice "required": the constrained reply is a JSON array of calls (`required_schema`). An array
    the length limit cut still gives the calls completed before the cut: a model that repeats a call and
    never closes the array would otherwise leave a client that required a call with none."""

    def parse(self, text: str) -> Parsed:
        try:
            calls = tuple(_call(value) for value in _whole_items(text))
        except _NotACall:
            return Parsed(text)
        return Parsed(None, calls) if calls else Parsed(text)

    def settled(self, text: str) -> int:
        return 0


_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's


def _whole_items(text: str) -> list[object]:
    """The items of the JSON array `text` that are whole, though the array may be cut anywhere (none if `text`
    is no array). The reply is constrained to the array, so the first item that does not decode is the one
    the cut fell in; the calls are objects, which cannot decode before their closing brace."""
    decoder = json.JSONDecoder()
    position = _WHITESPACE.match(text).end()
    items: list[object] = []
    separator = "["
    while text.startswith(separator, position):
        position = _WHITESPACE.match(text, position + 1).end()
        try:
            item, position = decoder.raw_decode(text, position)
        except ValueError:  # the cut, or the "]" of an empty array
            return items
        items.append(item)
        position = _WHITESPACE.match(text, position).end()
        separator = ","
    return items


def auto_parser(name: str, template: str | None) -> ToolParser:
    """The parser `name` ("auto" picks by the template: Llama 3's mentions ipython or its python tag)."""
    if name == "auto":
        llama3 = template is not None and ("<|python_tag|>" in template or "ipython" in template)
        name = "llama3_json" if llama3 else "hermes"
    return Llama3JsonParser() if name == "llama3_json" else HermesParser()


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`: it may grow into the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
