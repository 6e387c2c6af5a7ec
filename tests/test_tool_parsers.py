"""The tool-call parsers of every model family on replies in each family's format (the snippets are the ones vLLM's
parser tests use), and the stream's rule: what `settled` lets out of an unfinished reply always begins the content
the finished reply parses to, so no marker or call text ever reaches a client as content."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from pagedllm import config
from pagedllm.entrypoints.openai import tool_parsers
from pagedllm.entrypoints.openai.tool_parsers import (
    FunctionGemmaParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Phi4MiniJsonParser,
    PythonicParser,
)


@dataclass(frozen=True, slots=True)
class Case:
    """A reply to `parser` and how it parses: `calls` as (name, arguments); no calls means all of it is content."""

    parser: str
    id: str
    text: str
    content: str | None
    calls: tuple[tuple[str, dict[str, Any]], ...] = field(default=())

    @staticmethod
    def plain(parser: str, id: str, text: str) -> Case:
        return Case(parser, id, text, text)


WEATHER_SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}

CASES = [
    # mistral, tokenizers before v11: one JSON array after the marker
    Case(
        "mistral",
        "array-one",
        '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
        None,
        (("add", {"a": 3.5, "b": 4}),),
    ),
    Case(
        "mistral",
        "array-two",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
        '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]',
        None,
        (("add", {"a": 3.5, "b": 4}), ("get_current_weather", WEATHER_SF)),
    ),
    Case(
        "mistral",
        "array-content-before",
        'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
        "Hello",
        (("add", {"a": 1, "b": 2}),),
    ),
    Case(
        "mistral",
        "array-arguments-first",
        '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
        None,
        (("get_age", {"name": "John Doe"}),),
    ),
    # mistral, v11 on: name then the arguments, the marker before each call
    Case(
        "mistral",
        "v11-one",
        '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
        None,
        (("add_this_and_that", {"a": 3.5, "b": 4}),),
    ),
    Case(
        "mistral",
        "v11-two",
        '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}',
        None,
        (("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})),
    ),
    Case(
        "mistral",
        "v11-args-token",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo"}[TOOL_CALLS]get_time[ARGS]{"city": "Rome"}',
        None,
        (("get_weather", {"city": "São Paulo"}), ("get_time", {"city": "Rome"})),
    ),
    Case(
        "mistral",
        "v11-content-before",
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}',
        "hi{hi",
        (("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"}),),
    ),
    Case.plain("mistral", "no-call", "This is a test"),
    Case.plain("mistral", "not-json", "[TOOL_CALLS] not json at all"),
    Case.plain("mistral", "cut-array", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b"'),
    Case.plain("mistral", "cut-v11", 'Sure.[TOOL_CALLS]add{"a": 3.5, '),
    Case.plain("mistral", "empty-array", "[TOOL_CALLS][]"),
    # pythonic (Llama 3.2, Llama 4, Gemma 3)
    Case(
        "pythonic",
        "one",
        "[get_weather(city='San Francisco', metric='celsius')]",
        None,
        (("get_weather", {"city": "San Francisco", "metric": "celsius"}),),
    ),
    Case(
        "pythonic",
        "two-more-types",
        "[get_weather(city='San Francisco', metric='celsius'), register_user(name='John Doe', age=37, "
        "address={'city': 'San Francisco', 'state': 'CA'}, role=None, passed_test=True, aliases=['John', 'Johnny'])]",
        None,
        (
            ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
            (
                "register_user",
                {
                    "name": "John Doe",
                    "age": 37,
                    "address": {"city": "San Francisco", "state": "CA"},
                    "role": None,
                    "passed_test": True,
                    "aliases": ["John", "Johnny"],
                },
            ),
        ),
    ),
    Case(
        "pythonic",
        "escaped-and-empty",
        r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"'), get_time(), do(steps=[], d={})]""",
        None,
        (
            ("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'}),
            ("get_time", {}),
            ("do", {"steps": [], "d": {}}),
        ),
    ),
    Case(
        "pythonic",
        "llama4-python-tags",
        "<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>",
        None,
        (("get_weather", {"city": "LA", "metric": "C"}),),
    ),
    Case(
        "pythonic",
        "llama4-content-before",
        "Let me look.\n<|python_start|>[get_weather(city='LA', metric='C'), register_user(name='Doe', age=9)]",
        "Let me look.\n",
        (("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})),
    ),
    Case(
        "pythonic",
        "gemma-tool-code",
        'I will check.\n```tool_code\nprint(get_weather(city="Paris"))\nget_time(city="Rome", offset=-1.5)\n```\n',
        "I will check.\n",
        (("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome", "offset": -1.5})),
    ),
    Case.plain("pythonic", "no-call", "How can I help you today?"),
    Case.plain("pythonic", "variable-argument", "[get_weather(city=Paris)]"),
    Case.plain("pythonic", "positional-argument", "[get_weather('Paris')]"),
    Case.plain("pythonic", "bytes-argument", "[bad(x=b'z')]"),
    Case.plain("pythonic", "not-calls", "[1, 2] are the answers"),
    Case.plain("pythonic", "cut", "[get_weather(city='San Fr"),
    Case.plain("pythonic", "list-later-is-text", "Try [get_weather(city='Paris')]"),
    Case.plain("pythonic", "broken-tool-code", "```tool_code\nget_weather(city=\n```"),
    # phi4_mini_json
    Case(
        "phi4_mini_json",
        "one",
        'functools[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]',
        None,
        (("get_weather", {"city": "Tokyo"}),),
    ),
    Case(
        "phi4_mini_json",
        "two",
        'functools[\n  {"name": "get_weather", "arguments": {"city": "Tokyo"}},\n'
        '  {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n]',
        None,
        (("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})),
    ),
    Case(
        "phi4_mini_json",
        "surrounding-text",
        'Let me check the weather for you.\nfunctools[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]\n'
        "Would you like to know more?",
        "Let me check the weather for you.\n\nWould you like to know more?",
        (("get_weather", {"city": "Tokyo"}),),
    ),
    Case(
        "phi4_mini_json",
        "nested",
        'functools[{"name": "f", "arguments": {"a": [1, [2]], "o": {"n": "v"}}}]',
        None,
        (("f", {"a": [1, [2]], "o": {"n": "v"}}),),
    ),
    Case.plain("phi4_mini_json", "no-call", "This is a regular response without any tool calls."),
    Case.plain("phi4_mini_json", "cut", 'functools[{"name": "func", "arguments": {'),
    Case.plain("phi4_mini_json", "arguments-not-dict", 'functools[{"name": "func", "arguments": "not a dict"}]'),
    Case.plain("phi4_mini_json", "no-arguments", 'functools[{"name": "func"}]'),
    Case.plain("phi4_mini_json", "empty", "functools[] This is just text"),
    # functiongemma
    Case(
        "functiongemma",
        "one",
        "<start_function_call>call:get_weather{location:<escape>London<escape>}<end_function_call>",
        None,
        (("get_weather", {"location": "London"}),),
    ),
    Case(
        "functiongemma",
        "two",
        "<start_function_call>call:get_weather{location:<escape>London<escape>}<end_function_call>"
        "<start_function_call>call:get_time{timezone:<escape>UTC<escape>}<end_function_call>",
        None,
        (("get_weather", {"location": "London"}), ("get_time", {"timezone": "UTC"})),
    ),
    Case(
        "functiongemma",
        "content-before",
        "Let me check the weather for you. "
        "<start_function_call>call:get_weather{location:<escape>Paris<escape>}<end_function_call>",
        "Let me check the weather for you. ",
        (("get_weather", {"location": "Paris"}),),
    ),
    Case(
        "functiongemma",
        "bare-and-nested",
        "<start_function_call>call:search{query:<escape>a, {b}<escape>,limit:10,exact:false,tags:[<escape>x<escape>,"
        "2],range:{from:-1.5,to:null}}<end_function_call><start_function_response>",
        None,
        (
            (
                "search",
                {"query": "a, {b}", "limit": 10, "exact": False, "tags": ["x", 2], "range": {"from": -1.5, "to": None}},
            ),
        ),
    ),
    Case("functiongemma", "cut-after-call", "<start_function_call>call:refresh{}", None, (("refresh", {}),)),
    Case.plain("functiongemma", "no-call", "Hello, how can I help you today?"),
    Case.plain("functiongemma", "cut", "<start_function_call>call:get_weather{location:<escape>Lon"),
    Case.plain("functiongemma", "no-call-prefix", "<start_function_call>get_weather{}<end_function_call>"),
    Case.plain("functiongemma", "unclosed", "<start_function_call>call:f{a:1<end_function_call>"),
    # hermes (Qwen2.5, Qwen3) and llama3_json, for the stream rule
    Case(
        "hermes",
        "content-before",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Sure.\n",
        (("get_weather", {"city": "Paris"}),),
    ),
    Case(
        "llama3_json",
        "one",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        (("get_weather", {"city": "Paris"}),),
    ),
]


def _parsed(case: Case) -> tuple[str | None, list[tuple[str, Any]]]:
    parsed = tool_parsers.auto_parser(case.parser, None).parse(case.text)
    return parsed.content, [(call.name, json.loads(call.arguments)) for call in parsed.calls]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_replies_parse_to_their_content_and_calls(case: Case):
    assert _parsed(case) == (case.content, list(case.calls))


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_a_stream_sends_only_content_that_the_whole_reply_keeps(case: Case):
    parser = tool_parsers.auto_parser(case.parser, None)
    final = parser.parse(case.text).content or ""
    for end in range(len(case.text) + 1):
        prefix = case.text[:end]
        sent = prefix[: parser.settled(prefix)]
        assert final.startswith(sent), (prefix, sent)


def test_content_before_a_call_streams_before_the_call_is_done():
    """The content before the marker need not wait for the reply to finish (`settled` is not simply 0)."""
    for case in CASES:
        if case.calls and case.content and case.text.startswith(case.content):
            parser = tool_parsers.auto_parser(case.parser, None)
            assert parser.settled(case.text) == len(case.content), case.id
    assert MistralParser().settled("Sure [TOOL") == len("Sure ")
    assert MistralParser().settled("a [1] b") == len("a [1] b")  # a bracket that cannot begin the marker goes out
    assert PythonicParser().settled("Sure <|python") == len("Sure ")
    assert PythonicParser().settled("Sure ``") == len("Sure ")
    assert PythonicParser().settled("  [get_weather(") == 0
    assert PythonicParser().settled("Hi [x]") == len("Hi [x]")
    assert Phi4MiniJsonParser().settled("Sure functo") == len("Sure ")
    assert FunctionGemmaParser().settled("Hi <start_") == len("Hi ")
    assert FunctionGemmaParser().settled("\n<start_function_call>call:f{") == 0  # blank space before a call: none


def test_arguments_are_json_text_that_keeps_non_ascii():
    parsed = MistralParser().parse('[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo"}')
    assert parsed.calls == (tool_parsers.ParsedCall("get_weather", '{"city": "São Paulo"}'),)
    parsed = PythonicParser().parse("[get_weather(city='Zürich', days=2)]")
    assert parsed.calls == (tool_parsers.ParsedCall("get_weather", '{"city": "Zürich", "days": 2}'),)
    assert PythonicParser().parse("[calc(x=1e999)]").calls == ()  # inf is no JSON


# ---- auto ------------------------------------------------------------------------------------------------------

TEMPLATES = [
    ("mistral", '{{- "[TOOL_CALLS] [" }}{%- for tool in message.tool_calls %}', MistralParser),
    ("llama3.1", 'Environment: ipython\n{{- "<|python_tag|>" + tool_call.name + ".call(" }}', Llama3JsonParser),
    (
        "llama3.2-json",
        'Environment: ipython\nRespond in the format {"name": function name, "parameters": ...}',
        Llama3JsonParser,
    ),
    (
        "llama3.2-pythonic",
        "Environment: ipython\nRespond in the format [func_name1(params_name1=params_value1, "
        "params_name2=params_value2...), func_name2(params)] ",
        PythonicParser,
    ),
    (
        "llama4-pythonic",
        "Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\nipython",
        PythonicParser,
    ),
    ("llama4-python-start", "{{- '<|python_start|>' }}{{- tool_call.name }}", PythonicParser),
    (
        "gemma3-pythonic",
        "Example Format: [func_name1(params_name1=params_value1, params_name2=params_value2...)]",
        PythonicParser,
    ),
    ("gemma3-tool-code", "If you decide to invoke a function, wrap it in ```tool_code```.", PythonicParser),
    (
        "phi4-mini",
        'formatted as functools[{"name": [function name], "arguments": [function arguments as JSON]}, ...]',
        Phi4MiniJsonParser,
    ),
    ("functiongemma", "{{- '<start_function_call>call:' + tool_call.function.name }}", FunctionGemmaParser),
    ("qwen", '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>', HermesParser),
    ("plain", "{{ messages }}", HermesParser),
    ("none", None, HermesParser),
]


@pytest.mark.parametrize(("template", "expected"), [t[1:] for t in TEMPLATES], ids=[t[0] for t in TEMPLATES])
def test_auto_picks_the_parser_by_the_templates_markers(template: str | None, expected: type):
    assert type(tool_parsers.auto_parser("auto", template)) is expected


def test_a_named_parser_wins_over_the_template_and_unknown_names_are_refused():
    assert type(tool_parsers.auto_parser("mistral", "<tool_call>")) is MistralParser
    assert type(tool_parsers.auto_parser("llama4_pythonic", None)) is PythonicParser
    assert type(tool_parsers.auto_parser("llama4_json", None)) is Llama3JsonParser
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'"):
        tool_parsers.auto_parser("qwen", None)


def test_the_flags_choices_are_the_parsers_names():
    names = tool_parsers.TOOL_CALL_PARSERS
    assert names[0] == "auto" and len(set(names)) == len(names)
    assert {"hermes", "llama3_json", "mistral", "pythonic", "phi4_mini_json", "functiongemma"} <= set(names)
    for name in names:
        tool_parsers.auto_parser(name, None)
    assert {case.parser for case in CASES} <= set(names)


def test_configs_copy_of_the_names_agrees():
    # config.py keeps its own copy for --tool-call-parser's choices: it is imported before the parsers.
    assert tool_parsers.TOOL_CALL_PARSERS == config.TOOL_CALL_PARSERS
