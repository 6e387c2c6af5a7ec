"""Structured output, tool calling, prompt logprobs, logit_bias and beam search through the official `openai`
client against real server subprocesses: the tiny random model where any model will do, the default model
(SmolLM2-135M) where the model's own replies matter."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.entrypoints.openai import protocol, tool_parsers
from tests.conftest import build_tokenizer
from tests.test_server import NUM_KV_BLOCKS, ServerProcess, _wait_healthy, free_port, start_server, stop_server

TINY = "tiny"
SMOL = "smol"

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "verified": {"type": "boolean"}},
            "required": ["id", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city"}},
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- servers ------------------------------------------------------------------------------------


def start_default_server(log: Path) -> ServerProcess:
    """`pagedllm serve` without --model: the embedded SmolLM2-135M."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--dtype", "float32"]
    command += ["--served-model-name", SMOL]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    _wait_healthy(server)
    return server


@pytest.fixture(scope="module")
def tiny_server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tiny_server") / "server.log"
    process = start_server(tiny_llama, log, "--served-model-name", TINY)
    yield process
    assert stop_server(process) == 0, log.read_text()


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("smol_server") / "server.log"
    process = start_default_server(log)
    yield process
    assert stop_server(process) == 0, log.read_text()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny(tiny_server) -> openai.OpenAI:
    return _client(tiny_server)


@pytest.fixture(scope="module")
def smol(smol_server) -> openai.OpenAI:
    return _client(smol_server)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=int(NUM_KV_BLOCKS))


def chat_streamed(client: openai.OpenAI, **kwargs) -> dict:
    """The stream's deltas added up per choice: content, tool calls (by index) and finish reason."""
    choices: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reply = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            reply["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = reply["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                assert (call.id is not None) == (entry["name"] == ""), "the first delta of a call carries its id"
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            reply["finish_reason"] = choice.finish_reason or reply["finish_reason"]
    return choices


def chat_whole(client: openai.OpenAI, **kwargs) -> dict:
    choices = {}
    for choice in client.chat.completions.create(**kwargs).choices:
        calls = choice.message.tool_calls or []
        assert all(call.id.startswith("call_") and call.type == "function" for call in calls)
        choices[choice.index] = {
            "content": choice.message.content or "",
            "calls": {i: {"name": c.function.name, "arguments": c.function.arguments} for i, c in enumerate(calls)},
            "finish_reason": choice.finish_reason,
        }
    return choices


# ---- constrained decoding -----------------------------------------------------------------------


def test_parse_with_a_pydantic_model(smol):
    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    result = smol.chat.completions.parse(
        model=SMOL,
        messages=[{"role": "user", "content": "Make up a person."}],
        response_format=Person,
        temperature=0,
        max_tokens=50,
    )
    assert isinstance(result.choices[0].message.parsed, Person)
    assert result.choices[0].finish_reason == "stop"


def test_json_object_is_parseable_json(smol):
    result = smol.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": 'Give a JSON object with the key "color" and a color as its value.'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(result.choices[0].message.content), dict)


def test_eight_samples_all_match_a_nested_schema(tiny):
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}
    result = tiny.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "A pet, please."}],
        response_format=response_format,
        n=8,
        temperature=1.0,
        seed=3,
        max_tokens=300,
    )
    assert len(result.choices) == 8
    for choice in result.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


def test_regex_choice_grammar_and_json_through_every_field_name(tiny):
    def complete(**extra) -> list[str]:
        result = tiny.completions.create(
            model=TINY, prompt="Hello", n=3, temperature=1.0, seed=5, max_tokens=40, **extra
        )
        assert all(choice.finish_reason == "stop" for choice in result.choices)
        return [choice.text for choice in result.choices]

    regex = r"[a-z]{2,5}-\d{1,3}"
    for extra_body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        assert all(re.fullmatch(regex, text) for text in complete(extra_body=extra_body))
    labels = ["red", "green", "blue"]
    for extra_body in ({"guided_choice": labels}, {"structured_outputs": {"choice": labels}}):
        assert set(complete(extra_body=extra_body)) <= set(labels)
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for extra_body in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        assert all(re.fullmatch(r"yes|no|maybe \d", text) for text in complete(extra_body=extra_body))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    for extra_body in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        for text in complete(extra_body=extra_body):
            jsonschema.validate(json.loads(text), schema)
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for text in complete(extra_body={"response_format": response_format}):
        jsonschema.validate(json.loads(text), schema)


# ---- tool calling -------------------------------------------------------------------------------


def test_named_tool_choice_gives_valid_arguments(smol):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    result = smol.chat.completions.create(
        model=SMOL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60
    )
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_required_tool_choice_gives_valid_calls_streamed_as_whole(smol):
    args = dict(
        model=SMOL,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    whole = chat_whole(smol, **args)
    (call,) = whole[0]["calls"].values()
    assert whole[0]["finish_reason"] == "tool_calls"
    assert call["name"] in ("get_weather", "get_time")
    parameters = WEATHER_PARAMETERS if call["name"] == "get_weather" else {"type": "object"}
    jsonschema.validate(json.loads(call["arguments"]), parameters)
    assert chat_streamed(smol, **args) == whole


# At temperature 0.7 SmolLM2 often repeats the call and never closes the array: of seeds 0..9, four run
# into max_tokens, and two more close it after two calls.
REQUIRED_WEATHER = dict(
    model=SMOL, messages=WEATHER_QUESTION, tools=TOOLS[:1], tool_choice="required", temperature=0.7, max_tokens=200
)
SEEDS = range(10)


def whole_and_streamed(client: openai.OpenAI, **kwargs) -> list[tuple[dict, dict]]:
    """Each seed's first choice, whole and streamed. All go at once, for the server to batch them: a seeded
    request draws the same tokens whatever else is in its batch."""
    with ThreadPoolExecutor(2 * len(SEEDS)) as pool:
        wholes = [pool.submit(chat_whole, client, seed=seed, **kwargs) for seed in SEEDS]
        streams = [pool.submit(chat_streamed, client, seed=seed, **kwargs) for seed in SEEDS]
        return [(whole.result()[0], streamed.result()[0]) for whole, streamed in zip(wholes, streams, strict=True)]


def test_required_tool_choice_cut_by_the_length_limit_gives_the_calls_before_the_cut(smol):
    replies = whole_and_streamed(smol, **REQUIRED_WEATHER)
    for seed, (whole, streamed) in zip(SEEDS, replies, strict=True):
        assert whole["calls"] and whole["content"] == "", (seed, whole)
        for call in whole["calls"].values():
            assert call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)
        assert whole["finish_reason"] in ("tool_calls", "length")
        assert streamed == whole, seed
    assert "length" in {whole["finish_reason"] for whole, _ in replies}, "the seeds cut by max_tokens say so"


def test_parallel_tool_calls_false_gives_exactly_one_call(smol):
    replies = whole_and_streamed(smol, **REQUIRED_WEATHER, parallel_tool_calls=False)
    for seed, (whole, streamed) in zip(SEEDS, replies, strict=True):
        assert len(whole["calls"]) == 1 and whole["finish_reason"] == "tool_calls", (seed, whole)
        assert streamed == whole, seed


def test_auto_tool_choice_on_a_conversation_with_a_tool_result(smol):
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    args = dict(model=SMOL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    whole = chat_whole(smol, **args)
    reply = whole[0]
    # SmolLM2 answers by echoing the result: it can only know it if the tool's turn reached the prompt.
    assert '"temperature": 21' in reply["content"], reply
    assert reply["calls"] == {} and reply["finish_reason"] == "stop"
    assert chat_streamed(smol, **args) == whole


def test_an_agent_loop_sends_the_clients_reply_message_back_as_is(smol):
    """The openai client's reply message carries refusal/annotations/audio/function_call fields: an agent
    appends it to the conversation unchanged, with the tool's result after it."""
    first = smol.chat.completions.create(
        model=SMOL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}
    messages = [*WEATHER_QUESTION, message.model_dump(), result]
    second = smol.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS, temperature=0, max_tokens=20)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_hermes_tool_calls_after_content_stream_as_openai_does(smol):
    """SmolLM2's template ignores tools, so they reach it Hermes-style; a regex makes it answer with
    content and two calls, which the auto parser finds, streamed or not."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}"\}\}\n</tool_call>'
    args = dict(
        model=SMOL,
        messages=WEATHER_QUESTION,
        tools=tools,
        temperature=0,
        max_tokens=100,
        extra_body={"guided_regex": rf"Let me check\.\n{call}\n{call}"},
    )
    whole = chat_whole(smol, **args)
    reply = whole[0]
    assert reply["content"] == "Let me check.\n" and reply["finish_reason"] == "tool_calls"
    assert [c["name"] for c in reply["calls"].values()] == ["get_weather", "get_weather"]
    for c in reply["calls"].values():
        jsonschema.validate(json.loads(c["arguments"]), CITY)
    assert chat_streamed(smol, **args) == whole


def test_tools_reach_a_template_that_ignores_them_in_hermes_form():
    arguments = json.dumps({"city": "Paris"})
    messages = [
        protocol.ChatMessage(role="system", content="Be brief."),
        protocol.ChatMessage(role="user", content="Weather?"),
        protocol.ChatMessage(
            role="assistant",
            tool_calls=[
                protocol.ToolCall(id="c1", function=protocol.FunctionCall(name="get_weather", arguments=arguments))
            ],
        ),
        protocol.ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
        protocol.ChatMessage(role="tool", tool_call_id="c2", content="windy"),
    ]
    rendered, tools = tool_parsers.conversation(messages, TOOLS, "{{ messages }}")
    assert tools is None
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in rendered[0]["content"] and rendered[0]["content"].endswith("Be brief.")
    assert (
        rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert (
        rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    )
    as_is, tools = tool_parsers.conversation(messages, TOOLS, "{% if tools %}{{ tools }}{% endif %}")
    assert tools == TOOLS and as_is[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_parsers_find_calls_and_hold_back_only_what_may_start_one():
    hermes = tool_parsers.HermesParser()
    assert hermes.settled("Sure <tool") == len("Sure ")
    assert hermes.settled("Sure <tool_call>\n{") == len("Sure ")
    assert hermes.settled("a < b") == len("a < b")
    assert hermes.parse("Just text").content == "Just text" and not hermes.parse("Just text").calls
    assert hermes.parse("<tool_call>\nnot json\n</tool_call>").content == "<tool_call>\nnot json\n</tool_call>"
    llama = tool_parsers.Llama3JsonParser()
    parsed = llama.parse('<|python_tag|>{"name": "a", "parameters": {"x": "1;2"}}; {"name": "b", "arguments": {}}')
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("a", {"x": "1;2"}), ("b", {})]
    assert llama.settled(' {"na') == 0 and llama.settled("<|pyt") == 0 and llama.settled("Hi {") == 4
    assert llama.parse("Hi there").calls == ()
    required = tool_parsers.RequiredCallsParser()
    call = '{"name": "a", "parameters": {"x": "[1, 2]"}}'
    assert required.parse(f"[{call}, {call}]").calls == required.parse(f"[{call},\n {call}, {call[:20]}").calls
    assert len(required.parse(f"[{call}, {call}]").calls) == 2 and required.parse(f"[{call}, ").content is None
    assert required.parse(call[:20]) == tool_parsers.Parsed(call[:20])
    assert required.parse(f"[{call[:20]}") == tool_parsers.Parsed(f"[{call[:20]}")
    picked = tool_parsers.auto_parser("auto", "{{ '<|python_tag|>' }}")
    assert isinstance(picked, tool_parsers.Llama3JsonParser)


# ---- prompt logprobs, logit_bias, beam search ---------------------------------------------------


ECHO_PROMPT = "Paged attention stores the key value cache"


def test_echo_with_logprobs_gives_the_prompt_logprobs_of_offline_generate(tiny, offline):
    k = 3
    (expected,) = offline.generate(
        ECHO_PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k), use_tqdm=False
    )
    args = dict(model=TINY, prompt=ECHO_PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=k)
    result = tiny.completions.create(**args)
    choice = result.choices[0]
    logprobs = choice.logprobs
    num_prompt = len(expected.prompt_token_ids)
    assert choice.text == ECHO_PROMPT + expected.outputs[0].text
    assert len(logprobs.tokens) == num_prompt + result.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offline_prompt = [
        entry[token] for token, entry in zip(expected.prompt_token_ids[1:], expected.prompt_logprobs[1:], strict=True)
    ]
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx([lp.logprob for lp in offline_prompt], abs=1e-5)
    assert "".join(logprobs.tokens[:num_prompt]) == ECHO_PROMPT
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(1 <= len(top) <= k for top in logprobs.top_logprobs[1:])

    streamed = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in tiny.completions.create(stream=True, **args):
        for piece in chunk.choices:
            streamed["text"] += piece.text
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                streamed[name] += getattr(piece.logprobs, name) if piece.logprobs else []
    assert streamed == {"text": choice.text} | {name: getattr(logprobs, name) for name in streamed if name != "text"}


def test_prompt_logprobs_extra_on_completions_and_chat(tiny):
    result = tiny.completions.create(
        model=TINY, prompt=ECHO_PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = result.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == result.usage.prompt_tokens
    assert all(2 <= len(entry) <= 3 and all(v["logprob"] <= 0 for v in entry.values()) for entry in entries[1:])
    chat = tiny.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_logit_bias_of_100_makes_greedy_pick_that_token_on_both_endpoints(tiny):
    token = 100
    expected = build_tokenizer().decode([token] * 5)
    bias = {str(token): 100}
    args = dict(model=TINY, max_tokens=5, temperature=0, logit_bias=bias, extra_body={"ignore_eos": True})
    assert tiny.completions.create(prompt="Hello world", **args).choices[0].text == expected
    chat = tiny.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **args)
    assert chat.choices[0].message.content == expected


def test_beam_search_equals_offline_beam_search(tiny, offline):
    (expected,) = offline.beam_search("Hello world", BeamSearchParams(beam_width=3, max_tokens=8))
    args = dict(model=TINY, prompt="Hello world", n=3, max_tokens=8, extra_body={"use_beam_search": True})
    result = tiny.completions.create(**args)
    beams = [(c.text, c.finish_reason) for c in expected.outputs]
    assert [(c.text, c.finish_reason) for c in result.choices] == beams
    streamed = {}
    for chunk in tiny.completions.create(stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [text for text, _ in beams]


# ---- bad input ----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (COMPLETIONS, {"response_format": {"type": "xml"}}, "response_format", "unknown type"),
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format",
            "does not compile",
        ),
        (COMPLETIONS, {"guided_regex": "(["}, "guided_regex", "does not compile"),
        (COMPLETIONS, {"structured_outputs": {"regex": "(["}}, "structured_outputs", "does not compile"),
        (COMPLETIONS, {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
        (
            CHAT,
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        (CHAT, {"tool_choice": "required"}, "tool_choice", "needs tools"),
        (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        (CHAT, {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        (COMPLETIONS, {"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        (COMPLETIONS, {"use_beam_search": True, "logprobs": 2}, "logprobs", "use_beam_search"),
        (COMPLETIONS, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(tiny_server, path, body, param, words):
    body = body | ({"messages": HI} if path == CHAT else {"prompt": "hi"})
    response = httpx.post(f"{tiny_server.url}{path}", json=body | {"max_tokens": 3}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
