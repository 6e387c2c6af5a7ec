"""Tool calling on chat: how tools and earlier calls reach the prompt, the schema that enforces a named or
required choice, and the parsers that find tool calls in a reply.

A chat template that knows tools gets them (and the messages) as transformers expects. One that ignores them
(SmolLM2's, say) would drop them silently, so the conversation is rewritten in the Hermes format instead,
as Qwen's and Hermes' templates render it: the tools in the system prompt, the assistant's calls as
`<tool_call>` JSON in its content, and tool results as `<tool_response>` in a user turn.

The reply parsers, by vLLM's `--tool-call-parser` names (`TOOL_CALL_PARSERS`; "auto" picks by the chat template):
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several.
- `llama3_json` (alias `llama4_json`): the whole reply is `{"name": ..., "parameters": {...}}`, several joined by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of calls (tokenizers before v11) or `name[ARGS]{...}` per call.
- `pythonic` (alias `llama4_pythonic`; Llama 3.2, Llama 4, Gemma 3): a Python list of calls as the whole reply, or
  inside `<|python_start|>`…`<|python_end|>` or a ```` ```tool_code ```` block after some text.
- `phi4_mini_json` (Phi-4-mini): `functools[{"name": ..., "arguments": {...}}, ...]`.
- `functiongemma` (FunctionGemma): `<start_function_call>call:name{key:<escape>text<escape>,n:1}<end_function_call>`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Sequence
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
        return start if start >= 0 else len(text) - partial_marker(text, self._START)


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


# What the parsers below share. The text after the last call (a closing remark) is content too, after the text
# before the first; a stream holds back everything from the first marker on (`_settled`), so the content it sent
# before the marker always begins the final content, whichever way the calls then parse.

_UNPARSED = (SyntaxError, ValueError, TypeError, RecursionError)  # what a malformed call may raise (_NotACall too)


def _arguments_json(arguments: dict[str, Any]) -> str:
    """Arguments as JSON text; a value JSON cannot hold (a set, bytes, NaN or inf) makes no call."""
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise _NotACall(arguments) from error


def _content(before: str, after: str = "") -> str | None:
    """The content around the calls: blank space alone is none (and `_settled` never sends it)."""
    text = before + (after if after.strip() else "")
    return text if text.strip() else None


def _settled(text: str, markers: Sequence[str]) -> int:
    """The content an unfinished reply has settled: up to the first marker, or all but an end that may grow into
    one; none while that is blank space, which `_content` drops when a call follows."""
    starts = [start for marker in markers if (start := text.find(marker)) >= 0]
    end = min(starts) if starts else len(text) - max(partial_marker(text, marker) for marker in markers)
    return end if text[:end].strip() else 0


CallsAt = Callable[[str, int], tuple[tuple[ParsedCall, ...], int]]  # (text, marker's position) -> calls, their end


def _parse_at(text: str, marker: str, calls_at: CallsAt, dropped: str = "") -> Parsed:
    """A reply whose calls start at the first `marker`: the text around them is content (`dropped` taken out of
    what follows), and a reply whose calls do not read is all content."""
    start = text.find(marker)
    if start < 0:
        return Parsed(text)
    try:
        calls, end = calls_at(text, start)
    except _UNPARSED:
        return Parsed(text)
    after = text[end:].replace(dropped, "") if dropped else text[end:]
    return Parsed(_content(text[:start], after), calls)


def _until(text: str, end: str) -> tuple[str, str]:
    """`text` split at `end` (dropped); all of it if `end` is missing, as when the length limit cut the reply."""
    body, _, rest = text.partition(end)
    return body, rest


class MistralParser:
    """Mistral's `[TOOL_CALLS]`: then a JSON array of `{"name": ..., "arguments": {...}}` (tokenizers before v11),
    or, from v11 on, `name[ARGS]{...}` (`[ARGS]` is missing where the tokenizer drops it), the marker again before
    each further call. The text before the first marker is content."""

    _MARKER = "[TOOL_CALLS]"
    _NAME = re.compile(r"([\w.\-]+)[ \t]*(?:\[ARGS\])?[ \t]*")

    def parse(self, text: str) -> Parsed:
        return _parse_at(text, self._MARKER, self._calls)

    def settled(self, text: str) -> int:
        return _settled(text, (self._MARKER,))

    def _calls(self, text: str, position: int) -> tuple[tuple[ParsedCall, ...], int]:
        """The calls from the marker at `position`, and where the text after them begins."""
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        end = position
        while text.startswith(self._MARKER, position):
            position = _WHITESPACE.match(text, position + len(self._MARKER)).end()
            if text.startswith("[", position):
                items, position = decoder.raw_decode(text, position)
                if not isinstance(items, list) or not items:
                    raise _NotACall(items)
                calls.extend(_call(item) for item in items)
            else:
                name = self._NAME.match(text, position)
                if name is None:
                    raise _NotACall(text[position : position + 20])
                arguments, position = decoder.raw_decode(text, name.end())
                if not isinstance(arguments, dict):
                    raise _NotACall(arguments)
                calls.append(ParsedCall(name[1], _arguments_json(arguments)))
            end = position
            position = _WHITESPACE.match(text, position).end()
        return tuple(calls), end


class PythonicParser:
    """Calls as a Python list, `[get_weather(city="Paris"), get_time(city="Rome")]`, read with `ast`: keyword
    arguments whose values are literals (strings, numbers, booleans, None, lists, dicts), nothing is evaluated.
    As in vLLM the list is the whole reply (Llama 3.2's and Gemma 3's format: a bare `[` later in a reply is text's).
    Llama 4 may wrap it in `<|python_start|>`…`<|python_end|>`, and Gemma 3 prompted Google's other way writes a
    ```` ```tool_code ```` block (calls one per line, `print(...)` around one allowed); the text before either is
    content."""

    _START, _END = "<|python_start|>", "<|python_end|>"
    _FENCE, _FENCE_END = "```tool_code", "```"

    def parse(self, text: str) -> Parsed:
        whole = text.strip()
        try:
            if whole.startswith("["):
                return Parsed(None, _python_calls(whole, lines=False))
            start = min((s for s in (text.find(self._START), text.find(self._FENCE)) if s >= 0), default=-1)
            if start < 0:
                return Parsed(text)
            calls, rest = self._wrapped(text[start:])
        except _UNPARSED:
            return Parsed(text)
        return Parsed(_content(text[:start], rest), calls)

    def settled(self, text: str) -> int:
        if text.lstrip().startswith("["):  # the reply may be a call list: nothing is sure until it ends
            return 0
        return _settled(text, (self._START, self._FENCE))

    def _wrapped(self, text: str) -> tuple[tuple[ParsedCall, ...], str]:
        if text.startswith(self._START):
            body, rest = _until(text[len(self._START) :], self._END)
            return _python_calls(body, lines=False), rest
        body, rest = _until(text[len(self._FENCE) :], self._FENCE_END)
        return _python_calls(body, lines=True), rest


def _python_calls(source: str, lines: bool) -> tuple[ParsedCall, ...]:
    """The calls of one list expression, or with `lines` of any number of statements, each a call list or a call
    (`print(call)` as the call)."""
    statements = ast.parse(source.strip()).body
    if not statements or (not lines and len(statements) > 1):
        raise _NotACall(source)
    calls: list[ParsedCall] = []
    for statement in statements:
        if not isinstance(statement, ast.Expr):
            raise _NotACall(source)
        value = statement.value
        if isinstance(value, ast.List) and value.elts:
            calls.extend(_python_call(element) for element in value.elts)
        elif lines and isinstance(value, ast.Call):
            calls.append(_python_call(_unprinted(value)))
        else:
            raise _NotACall(source)
    return tuple(calls)


def _unprinted(call: ast.Call) -> ast.expr:
    printed = isinstance(call.func, ast.Name) and call.func.id == "print" and len(call.args) == 1
    return call.args[0] if printed and not call.keywords else call


def _python_call(node: ast.expr) -> ParsedCall:
    """`name(key=literal, ...)`: a positional argument has no name to go by, so it makes no call."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall(ast.dump(node))
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **spread
            raise _NotACall(ast.dump(node))
        arguments[keyword.arg] = ast.literal_eval(keyword.value)  # ValueError where it is no literal
    return ParsedCall(node.func.id, _arguments_json(arguments))


class Phi4MiniJsonParser:
    """Phi-4-mini's `functools[{"name": ..., "arguments": {...}}, ...]` (no closing marker). vLLM drops the text
    around it; here it is content, as with the other parsers."""

    _MARKER = "functools["

    def parse(self, text: str) -> Parsed:
        return _parse_at(text, self._MARKER, self._calls)

    def settled(self, text: str) -> int:
        return _settled(text, (self._MARKER,))

    def _calls(self, text: str, position: int) -> tuple[tuple[ParsedCall, ...], int]:
        # The marker's own "[" opens the array.
        items, end = json.JSONDecoder().raw_decode(text, position + len(self._MARKER) - 1)
        if not isinstance(items, list) or not items:
            raise _NotACall(items)
        return tuple(_call(item) for item in items), end


class FunctionGemmaParser:
    """FunctionGemma's `<start_function_call>call:name{key:value,...}<end_function_call>`, possibly several. Its
    chat template writes strings between `<escape>` tags and everything else bare (numbers, true/false/null, and
    `{k:v}` / `[a,b]` nested), so an escaped value stays a string. The end tag of a last call the length limit cut
    may be missing; the text before the first call is content."""

    _START, _END = "<start_function_call>", "<end_function_call>"
    _NAME = re.compile(r"call:([\w.\-]+)(?=\{)")
    _RESPONSE = "<start_function_response>"  # where the model stops for the result, when it is in the text

    def parse(self, text: str) -> Parsed:
        return _parse_at(text, self._START, self._calls, dropped=self._RESPONSE)

    def settled(self, text: str) -> int:
        return _settled(text, (self._START,))

    def _calls(self, text: str, position: int) -> tuple[tuple[ParsedCall, ...], int]:
        calls: list[ParsedCall] = []
        end = position
        while text.startswith(self._START, position):
            name = self._NAME.match(text, position + len(self._START))
            if name is None:
                raise _NotACall(text[position : position + 40])
            arguments, position = _gemma_value(text, name.end())
            if text.startswith(self._END, position):
                position += len(self._END)
            elif text[position:].strip():  # only a cut may leave the end tag out
                raise _NotACall(text[position : position + 20])
            calls.append(ParsedCall(name[1], _arguments_json(arguments)))
            end = position
            position = _WHITESPACE.match(text, position).end()
        return tuple(calls), end


_ESCAPE = "<escape>"
_GEMMA_KEY = re.compile(r"([^:,{}\[\]<\s]+)[ \t]*:")
_GEMMA_BARE = re.compile(r"[^,}\]]*")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _gemma_value(text: str, position: int) -> tuple[Any, int]:
    """The FunctionGemma value at `position`, and where it ends."""
    position = _WHITESPACE.match(text, position).end()
    if text.startswith(_ESCAPE, position):
        return _gemma_escaped(text, position)
    if text.startswith("{", position):
        return _gemma_object(text, position)
    if text.startswith("[", position):
        return _gemma_list(text, position)
    bare = _GEMMA_BARE.match(text, position)
    return _gemma_scalar(bare[0].strip()), bare.end()


def _gemma_escaped(text: str, position: int) -> tuple[str, int]:
    start = position + len(_ESCAPE)
    end = text.find(_ESCAPE, start)
    if end < 0:
        raise _NotACall(text[position : position + 20])
    return text[start:end], end + len(_ESCAPE)


def _gemma_object(text: str, position: int) -> tuple[dict[str, Any], int]:
    value: dict[str, Any] = {}
    position = _WHITESPACE.match(text, position + 1).end()
    if text.startswith("}", position):
        return value, position + 1
    while True:
        if text.startswith(_ESCAPE, position):  # a key the template escaped
            key, position = _gemma_escaped(text, position)
            if not text.startswith(":", position):
                raise _NotACall(text[position : position + 20])
            position += 1
        else:
            match = _GEMMA_KEY.match(text, position)
            if match is None:
                raise _NotACall(text[position : position + 20])
            key, position = match[1], match.end()
        value[key], position = _gemma_value(text, position)
        position, closed = _next_item(text, position, "}")
        if closed:
            return value, position


def _gemma_list(text: str, position: int) -> tuple[list[Any], int]:
    value: list[Any] = []
    position = _WHITESPACE.match(text, position + 1).end()
    if text.startswith("]", position):
        return value, position + 1
    while True:
        item, position = _gemma_value(text, position)
        value.append(item)
        position, closed = _next_item(text, position, "]")
        if closed:
            return value, position


def _next_item(text: str, position: int, close: str) -> tuple[int, bool]:
    """Past the `,` before the next item, or past `close` (True); _NotACall at anything else or the text's end."""
    position = _WHITESPACE.match(text, position).end()
    if text.startswith(close, position):
        return position + 1, True
    if not text.startswith(",", position):
        raise _NotACall(text[position : position + 20])
    return _WHITESPACE.match(text, position + 1).end(), False


def _gemma_scalar(token: str) -> Any:
    if not token:
        raise _NotACall(token)
    if token in ("true", "false", "null"):
        return json.loads(token)
    return json.loads(token) if _JSON_NUMBER.fullmatch(token) else token


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


# --tool-call-parser's names (vLLM's); the aliases are vLLM's names of the same formats.
_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,  # Qwen2.5's and Qwen3's too: vLLM has no other name for them
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "llama4_pythonic": PythonicParser,  # pythonic takes its <|python_start|> wrapper too
    "phi4_mini_json": Phi4MiniJsonParser,
    "functiongemma": FunctionGemmaParser,
}
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", *_PARSERS)

# What "auto" looks for in a chat template, first match wins: the specific markers before the loose words, and
# pythonic's instruction before "ipython", which Llama's pythonic templates mention too.
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<start_function_call>", "functiongemma"),
    ("functools[", "phi4_mini_json"),
    ("<|python_start|>", "pythonic"),  # Llama 4
    ("[func_name1(", "pythonic"),  # "respond in the format [func_name1(params_name1=params_value1, ...)]"
    ("<tool_call>", "hermes"),
    ("tool_code", "pythonic"),  # Gemma 3's ```tool_code``` block
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)


def auto_parser(name: str, template: str | None) -> ToolParser:
    """The parser `name`; "auto" picks by the chat template's markers (`_TEMPLATE_MARKERS`), hermes when none."""
    if name == "auto":
        name = next((parser for marker, parser in _TEMPLATE_MARKERS if template and marker in template), "hermes")
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return _PARSERS[name]()


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`: it may grow into the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def call_markers(parser: ToolParser) -> tuple[str, ...]:
    """The tags that open a call in `parser`'s format: where they are special tokens (Mistral's `[TOOL_CALLS]`,
    Llama 4's `<|python_start|>`), the reply's text must keep special tokens for the parser to see them."""
    tags = (getattr(parser, name, None) for name in ("_MARKER", "_START"))
    return tuple(tag for tag in tags if isinstance(tag, str))
