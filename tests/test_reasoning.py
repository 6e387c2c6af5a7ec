"""Reasoning models through the server: a tiny random Qwen3 with a Qwen3-style chat template (tests/qwen3_chat.py),
driven by logit bias and a constraint so that the think tags
really appear; chat's `reasoning_content` (whole and streamed), the Responses API's reasoning items, constraints that
hold the answer after the thinking, and `chat_template_kwargs` reaching the template."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedllm.entrypoints.openai import reasoning_parsers
from tests.conftest import CHAT_TEMPLATE
from tests.qwen3_chat import MARKERS, QWEN3_CHAT_TEMPLATE, save_tiny_qwen3
from tests.test_server import ServerProcess, start_server, stop_server

QWEN = "qwen"


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def qwen_server(qwen_folder) -> Iterator[ServerProcess]:
    process = start_server(qwen_folder, qwen_folder / "server.log", "--served-model-name", QWEN)
    yield process
    assert stop_server(process) == 0, process.log.read_text()


@pytest.fixture(scope="module")
def qwen(qwen_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tag_ids(qwen_folder) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_folder)
    return {tag: tokenizer.convert_tokens_to_ids(tag) for tag in MARKERS}


def test_auto_picks_the_parser_from_the_template():
    assert isinstance(
        reasoning_parsers.get_reasoning_parser("auto", QWEN3_CHAT_TEMPLATE), reasoning_parsers.Qwen3Parser
    )
    r1 = "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
    assert isinstance(reasoning_parsers.get_reasoning_parser("auto", r1), reasoning_parsers.DeepSeekR1Parser)
    assert reasoning_parsers.get_reasoning_parser("auto", CHAT_TEMPLATE) is None
    assert reasoning_parsers.get_reasoning_parser("none", QWEN3_CHAT_TEMPLATE) is None


def thinking_request(tag_ids: dict[str, int], **more) -> dict:
    """The block forced open (its tag is the only first token the bias favours) and closed when the bias on
    `</think>` outweighs the model's own choice; the answer held to a word after it."""
    bias = {str(tag_ids["<think>"]): 100, str(tag_ids["</think>"]): 6}
    extra = {"structured_outputs": {"regex": "[a-z]{3,8}"}, "logit_bias": bias}
    return dict(
        model=QWEN,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=60,
        temperature=0,
        extra_body=extra | more.pop("extra_body", {}),
        **more,
    )


def test_the_thinking_goes_to_reasoning_content_and_the_constraint_holds_the_answer(qwen, tag_ids):
    message = qwen.chat.completions.create(**thinking_request(tag_ids)).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert re.fullmatch("[a-z]{3,8}", message.content), message.content

    streamed = {"reasoning": "", "content": ""}
    for chunk in qwen.chat.completions.create(stream=True, **thinking_request(tag_ids)):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            streamed["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed["content"] += delta.content or ""
    assert streamed == {"reasoning": reasoning, "content": message.content}


def test_thinking_off_leaves_no_reasoning_and_reaches_the_template(qwen, tag_ids):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    request = thinking_request(tag_ids, extra_body=off)
    request["extra_body"]["logit_bias"] = {str(tag_ids["<think>"]): -100}
    reply = qwen.chat.completions.create(**request)
    assert reply.choices[0].message.model_extra["reasoning_content"] is None
    assert re.fullmatch("[a-z]{3,8}", reply.choices[0].message.content)
    on = qwen.chat.completions.create(**thinking_request(tag_ids))
    # The template closed an empty block in the prompt: `<think>`, `</think>` and the blank lines around them.
    assert reply.usage.prompt_tokens > on.usage.prompt_tokens


def test_a_response_carries_a_reasoning_item_before_its_message(qwen, tag_ids):
    request = thinking_request(tag_ids)
    kwargs = dict(
        model=QWEN,
        input="Think, then answer.",
        max_output_tokens=60,
        temperature=0,
        extra_body={"logit_bias": request["extra_body"]["logit_bias"]},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "string", "pattern": "^[a-z]{3,8}$"}}},
    )
    whole = qwen.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    chat = qwen.chat.completions.create(**request).choices[0].message
    assert whole.output[0].content[0].text == chat.model_extra["reasoning_content"]
    with qwen.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == whole.output[0].content[0].text
    assert final.output_text == whole.output_text
    assert "response.reasoning_text.delta" in kinds


def test_a_required_call_follows_the_thinking(qwen, tag_ids):
    # A bounded name: the bias that opens the block would fill an unbounded string with `<think>`.
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    tool = {"type": "function", "name": "get_time", "parameters": city}
    response = qwen.responses.create(
        model=QWEN,
        input="What time is it in Oslo?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
        extra_body={"logit_bias": {str(tag_ids["<think>"]): 100, str(tag_ids["</think>"]): 6}},
    )
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and "function_call" in kinds, kinds
    call = next(item for item in response.output if item.type == "function_call")
    assert call.name == "get_time" and "city" in json.loads(call.arguments)


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (reasoning_parsers.Qwen3Parser(), "<think>\nweigh it\n</think>\n\nIt is 4.", "\nweigh it\n", "It is 4."),
        (reasoning_parsers.Qwen3Parser(), "Just 4.", None, "Just 4."),
        (reasoning_parsers.Qwen3Parser(), "<think>cut short", "cut short", None),
        (reasoning_parsers.Qwen3Parser(), "4, not <think>x</think>", None, "4, not <think>x</think>"),
        (reasoning_parsers.DeepSeekR1Parser(), "weigh it</think>\n\nIt is 4.", "weigh it", "It is 4."),
        (reasoning_parsers.DeepSeekR1Parser(), "<think>weigh</think>4", "weigh", "4"),
        (reasoning_parsers.DeepSeekR1Parser(), "never closed", "never closed", None),
    ],
)
def test_a_reply_splits_whole_and_every_prefix_settles_into_it(parser, text, reasoning, content):
    assert parser.split(text) == reasoning_parsers.Split(reasoning, content)
    for end in range(len(text) + 1):
        settled = parser.settled(text[:end])
        assert (reasoning or "").startswith(settled.reasoning), (end, settled)
        assert (content or "").startswith(settled.content), (end, settled)
    # Once the reply is whole but unfinished, nothing that can still change is held back beyond a tag's length.
    last = parser.settled(text)
    assert len(reasoning or "") - len(last.reasoning) <= len("</think>")


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-on", "thinking-off"])
def test_instructor_and_langchain_get_their_objects_from_a_thinking_model(qwen_server, tag_ids, thinking):
    import instructor
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=6)

    # On: the block opened and closed by the bias; off: the template closed it in the prompt, and the bias keeps
    # the model from opening another.
    bias = {str(tag_ids["<think>"]): 100, str(tag_ids["</think>"]): 6} if thinking else {str(tag_ids["<think>"]): -100}
    extra = {"logit_bias": bias, "chat_template_kwargs": {"enable_thinking": thinking}}
    question = [{"role": "user", "content": "Name a city."}]
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key="none", max_retries=0), mode=instructor.Mode.JSON_SCHEMA
    )
    city = client.chat.completions.create(
        model=QWEN,
        response_model=City,
        messages=question,
        max_tokens=80,
        temperature=0,
        max_retries=0,
        extra_body=extra,
    )
    assert isinstance(city, City)
    llm = ChatOpenAI(
        model=QWEN, base_url=f"{qwen_server.url}/v1", api_key="none", temperature=0, max_tokens=200, extra_body=extra
    )
    assert isinstance(llm.with_structured_output(City).invoke("Name a city."), City)


def test_llm_chat_passes_chat_template_kwargs_to_the_template(qwen_folder):
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=qwen_folder, dtype="float32", num_kv_blocks=64)
    question = [{"role": "user", "content": "Hi"}]
    off, on = (
        llm.chat(question, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"enable_thinking": t})[0]
        for t in (False, True)
    )
    text = llm.engine.tokenizer.decode(off.prompt_token_ids)
    assert text.endswith("<think>\n\n</think>\n\n") and not llm.engine.tokenizer.decode(on.prompt_token_ids).endswith(
        "</think>\n\n"
    )
