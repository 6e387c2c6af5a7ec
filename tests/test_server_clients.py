"""The API as today's clients speak it, through the clients themselves against real server subprocesses: the
Responses API (`/v1/responses`) through the official `openai` client and the OpenAI Agents SDK, chat through
Instructor and LangChain, and the fields clients send that pagedllm does not act on. The default model (SmolLM2-135M)
where the model's own replies matter, the tiny random model where any model will do (stored chains, bounds, keys,
background runs, bad input)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import save_tiny_llama
from tests.test_server import ServerProcess, start_server, stop_server
from tests.test_server_structured import CITY, SMOL, WEATHER_PARAMETERS, start_default_server

TINY = "tiny"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory) -> Iterator[ServerProcess]:
    process = start_default_server(tmp_path_factory.mktemp("smol_responses") / "server.log")
    yield process
    assert stop_server(process) == 0, process.log.read_text()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("tiny_responses")
    # Room for 20 turns of a conversation, which the tiny tokenizer spells in many tokens.
    model = save_tiny_llama(folder / "model", max_position_embeddings=2048)
    log = folder / "server.log"
    # Small bounds, so that the chains below pass them many times over.
    flags = ["--served-model-name", TINY, "--max-stored-responses", "40", "--max-stored-response-bytes", "200000"]
    process = start_server(model, log, *flags)
    yield process
    assert stop_server(process) == 0, log.read_text()


def client_of(server: ServerProcess, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol(smol_server) -> openai.OpenAI:
    return client_of(smol_server)


@pytest.fixture(scope="module")
def tiny(tiny_server) -> openai.OpenAI:
    return client_of(tiny_server)


def without_ids(response: openai.types.responses.Response) -> list[dict]:
    """The output items as a client compares them: every generated id left out."""
    items = []
    for item in response.output:
        dumped = item.model_dump(exclude_none=True)
        dumped.pop("id", None)
        dumped.pop("call_id", None)
        items.append(dumped)
    return items


# ---- the default model through the openai client ------------------------------------------------


def test_a_response_is_the_chat_reply_to_the_same_conversation(smol):
    response = smol.responses.create(
        model=SMOL, input=QUESTION, instructions="Answer briefly.", max_output_tokens=24, temperature=0
    )
    chat = smol.chat.completions.create(
        model=SMOL,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_the_stream_helper_assembles_the_non_streamed_response(smol):
    kwargs = dict(model=SMOL, input=QUESTION, max_output_tokens=24, temperature=0)
    whole = smol.responses.create(**kwargs)
    events = []
    with smol.responses.stream(**kwargs) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_response()
    assert without_ids(final) == without_ids(whole)
    assert final.output_text == whole.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text


def test_a_function_tool_is_called_and_its_output_answered(smol):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = smol.responses.create(
        model=SMOL, input=question, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=64, temperature=0
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    # The call's output continues the stored conversation.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
    second = smol.responses.create(
        model=SMOL, previous_response_id=first.id, input=[result], tools=[WEATHER_TOOL], max_output_tokens=32
    )
    assert second.previous_response_id == first.id
    assert second.output_text


def test_a_streamed_function_call_equals_the_whole_one(smol):
    kwargs = dict(
        model=SMOL,
        input="What is the weather in Rome?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    whole = smol.responses.create(**kwargs)
    with smol.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert without_ids(final) == without_ids(whole)
    assert [item.type for item in whole.output] == ["function_call"]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_text_format_json_schema_constrains_the_output(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    response = smol.responses.create(
        model=SMOL,
        input="Name a city in Italy, as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=40,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def run_weather_agent(server: ServerProcess, model_class: type) -> tuple[list[str], object]:
    """An agent with one function tool, on `model_class` over `server`: the cities it called the tool for, and the
    run's result."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="agent-key", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Use the tool, then answer in one sentence.",
        model=model_class(model=SMOL, openai_client=client),
        tools=[get_weather],
        # Required at first (the small model would rarely call on its own); the SDK resets it after the call.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    return calls, asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))


def test_an_agent_on_the_responses_model_calls_its_tool_and_answers(smol_server):
    from agents import OpenAIResponsesModel

    calls, result = run_weather_agent(smol_server, OpenAIResponsesModel)
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output
    sent = [item for item in result.to_input_list() if item.get("type") == "function_call_output"]
    assert sent and "sunny" in sent[0]["output"]


def test_an_agent_on_the_chat_completions_model_calls_its_tool_and_answers(smol_server):
    from agents import OpenAIChatCompletionsModel

    calls, result = run_weather_agent(smol_server, OpenAIChatCompletionsModel)
    assert calls and isinstance(result.final_output, str) and result.final_output


def test_responses_parse_and_an_agents_output_type_get_their_objects(smol, smol_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    parsed = smol.responses.parse(model=SMOL, input="Name a city in Spain.", text_format=City, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City)
    client = openai.AsyncOpenAI(base_url=f"{smol_server.url}/v1", api_key="agent-key", max_retries=0)
    agent = Agent(
        name="city",
        instructions="Answer with a city.",
        model=OpenAIResponsesModel(model=SMOL, openai_client=client),
        output_type=City,
        model_settings=ModelSettings(max_tokens=60, temperature=0),
    )
    assert isinstance(asyncio.run(Runner.run(agent, "Name a city in Spain.", max_turns=2)).final_output, City)


def test_a_streamed_agent_run_ends_with_the_streamed_text(smol_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner

    client = openai.AsyncOpenAI(base_url=f"{smol_server.url}/v1", api_key="agent-key", max_retries=0)
    agent = Agent(
        name="brief",
        instructions="Answer briefly.",
        model=OpenAIResponsesModel(model=SMOL, openai_client=client),
        model_settings=ModelSettings(max_tokens=30, temperature=0),
    )

    async def run() -> tuple[str, str]:
        streamed = Runner.run_streamed(agent, QUESTION)
        deltas = [
            event.data.delta
            async for event in streamed.stream_events()
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
        ]
        return "".join(deltas), streamed.final_output

    text, final = asyncio.run(run())
    assert text and text == final


# ---- stored chains, keys and bounds (the tiny model) ---------------------------------------------


def test_chains_of_20_turns_from_8_clients_stay_their_own_within_the_bounds(tiny_server):
    hits_before = tiny_server.metric("pagedllm:prefix_cache_hits_total")

    def chain(number: int) -> list[str]:
        client = client_of(tiny_server, key=f"key-{number}")
        ids, previous = [], None
        for turn in range(20):
            response = client.responses.create(
                model=TINY, input=f"{number}.{turn}", previous_response_id=previous, max_output_tokens=2
            )
            # The newest turn is always readable by its own key, never by another's.
            assert client.responses.retrieve(response.id).id == response.id
            with pytest.raises(openai.NotFoundError):
                client_of(tiny_server, key=f"key-{number + 1}").responses.retrieve(response.id)
            ids.append(response.id)
            previous = response.id
            assert tiny_server.metric("pagedllm:responses_stored") <= 40
            assert tiny_server.metric("pagedllm:responses_stored_bytes") <= 200000
        return ids

    with ThreadPoolExecutor(8) as pool:
        chains = list(pool.map(chain, range(8)))
    assert len({response_id for ids in chains for response_id in ids}) == 160
    # Each turn's prompt is the last turn's prompt and answer and more: the prefix cache serves what it holds.
    assert tiny_server.metric("pagedllm:prefix_cache_hits_total") > hits_before
    # The oldest were evicted: only the newest 40 remain, and a chain cannot go on from an evicted turn.
    with pytest.raises(openai.NotFoundError):
        client_of(tiny_server, key="key-0").responses.create(
            model=TINY, input="again", previous_response_id=chains[0][0], max_output_tokens=2
        )


def test_a_continued_conversation_hits_the_prefix_cache_on_its_second_turn(tiny_server, tiny):
    first = tiny.responses.create(
        model=TINY, input="Paged attention stores the key value cache " * 4, max_output_tokens=8
    )
    hits = tiny_server.metric("pagedllm:prefix_cache_hits_total")
    second = tiny.responses.create(model=TINY, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert tiny_server.metric("pagedllm:prefix_cache_hits_total") - hits >= 16  # at least one whole block
    assert second.usage.input_tokens_details.cached_tokens >= 16 and first.usage.input_tokens_details.cached_tokens == 0


def test_chat_usage_says_how_many_prompt_tokens_the_prefix_cache_served(tiny):
    messages = [{"role": "user", "content": "Copy on write keeps shared blocks safe " * 3}]
    first, again = (tiny.chat.completions.create(model=TINY, messages=messages, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_delete_forgets_a_response_for_its_key_only(tiny_server, tiny):
    response = tiny.responses.create(model=TINY, input="to be deleted", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client_of(tiny_server, key="someone-else").responses.delete(response.id)
    tiny.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        tiny.responses.retrieve(response.id)


def test_store_false_keeps_nothing(tiny):
    response = tiny.responses.create(model=TINY, input="not kept", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        tiny.responses.retrieve(response.id)


def test_a_background_response_runs_on_and_can_be_cancelled(tiny_server, tiny):
    done = tiny.responses.create(model=TINY, input="in the background", background=True, max_output_tokens=8)
    assert done.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (polled := tiny.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status in ("completed", "incomplete") and polled.output_text

    long = tiny.responses.create(model=TINY, input="a long one", background=True, max_output_tokens=400)
    cancelled = tiny.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert tiny.responses.retrieve(long.id).status == "cancelled"
    tiny_server.wait_for("pagedllm:kv_blocks_used", lambda used: used == 0)
    tiny_server.wait_for("pagedllm:num_requests_running", lambda running: running == 0)


# ---- bad input: a 400 or 404 naming the field, nothing lost ---------------------------------------


def post(server: ServerProcess, body: dict, key: str = "key-a") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}/v1/responses", json={"model": TINY, **body}, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"input": [{"type": "telepathy", "thought": "hi"}]}, 400, "input.0.type", "unknown item type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_nobody", "output": "42"}]},
            400,
            "input.0.call_id",
            "no function_call",
        ),
        ({"input": "hi", "previous_response_id": "resp_never"}, 404, "previous_response_id", "no stored response"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type", "built-in tools"),
        ({"input": "hi", "tools": [{"type": "code_interpreter", "container": {}}]}, 400, "tools.0.type", "built-in"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            400,
            "input.0.content.0",
            "text parts only",
        ),
        ({"input": []}, 400, "input", "non-empty"),
        ({"input": "hi", "conversation": "conv_1"}, 400, "conversation", "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 4096}, 400, "max_output_tokens", "max_model_len"),
        ({"input": "hi", "background": True, "store": False}, 400, "background", "stored"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]}, 400, None, ""),
    ],
)
def test_bad_input_is_refused_naming_the_field(tiny_server, body, status, param, words):
    response = post(tiny_server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert words in error["message"], error
    # Nothing was lost: the server answers the next request, and every block is back.
    assert post(tiny_server, {"input": "still here", "max_output_tokens": 2}).status_code == 200
    tiny_server.wait_for("pagedllm:kv_blocks_used", lambda used: used == 0)


def test_another_keys_response_cannot_be_continued(tiny_server, tiny):
    mine = tiny.responses.create(model=TINY, input="mine", max_output_tokens=2)
    response = post(tiny_server, {"input": "theirs", "previous_response_id": mine.id}, key="key-b")
    assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"


def test_fields_pagedllm_does_not_act_on_are_named_in_a_header(tiny_server):
    response = post(tiny_server, {"input": "hi", "max_output_tokens": 2, "service_tier": "auto", "include": []})
    assert response.status_code == 200
    assert response.headers["pagedllm-ignored-fields"] == "include, service_tier"


def test_city_tool_schema_is_kept_in_the_response(tiny):
    tool = {"type": "function", "name": "get_time", "parameters": CITY}
    response = tiny.responses.create(model=TINY, input="hi", tools=[tool], tool_choice="none", max_output_tokens=2)
    assert response.tools[0].name == "get_time" and response.tool_choice == "none"
    assert [item.type for item in response.output] == ["message"]


# ---- chat as other clients send it --------------------------------------------------------------


def test_instructor_json_schema_mode_gets_an_object_of_its_model(smol_server):
    import instructor
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    client = instructor.from_openai(client_of(smol_server), mode=instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(
        model=SMOL,
        response_model=City,
        messages=[{"role": "user", "content": "Name a city in Spain."}],
        max_tokens=48,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City) and city.name


def test_response_format_json_object_with_a_schema_is_held_to_it(smol):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    reply = smol.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "A digit, as JSON."}],
        response_format={"type": "json_object", "schema": schema},
        max_tokens=16,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_langchain_chat_openai_invokes_streams_binds_tools_and_structures(smol_server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(
        model=SMOL, base_url=f"{smol_server.url}/v1", api_key="lc-key", temperature=0, max_tokens=16, max_retries=0
    )
    whole = llm.invoke("What is the capital of France?")
    assert "".join(chunk.content for chunk in llm.stream("What is the capital of France?")) == whole.content

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=20)

    called = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "Weather"
    structured = llm.with_structured_output(Weather).invoke("The weather in Rome, please.")
    assert isinstance(structured, Weather) and structured.city


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(smol_server, smol):
    # SmolLM2's template reads no variable of its own: any kwarg is accepted, and the prompt does not change.
    plain = smol.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    thinking = smol.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert thinking.usage.prompt_tokens == plain.usage.prompt_tokens
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tools": []}}
    refused = httpx.post(f"{smol_server.url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ messages }}"}
    untrusted = httpx.post(f"{smol_server.url}/v1/chat/completions", json=body, timeout=60)
    assert untrusted.status_code == 400 and "--trust-request-chat-template" in untrusted.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "ignored"),
    [
        ({"service_tier": "auto", "prompt_cache_key": "u1", "store": False}, "service_tier, prompt_cache_key"),
        ({"reasoning_effort": "low", "modalities": ["text"], "metadata": {"a": "b"}}, "metadata, reasoning_effort"),
    ],
)
def test_chat_fields_pagedllm_does_not_act_on_are_named_in_a_header(smol_server, extra, ignored):
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    response = httpx.post(f"{smol_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["pagedllm-ignored-fields"] == ignored


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"web_search_options": {}}, "web_search_options", "no web search"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ],
)
def test_chat_fields_that_would_change_the_answer_are_refused(smol_server, extra, param, words):
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    response = httpx.post(f"{smol_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_response_too_large_to_store_is_answered_and_says_it_was_not_kept(tiny):
    # The server keeps at most 200,000 bytes: this response's metadata alone is over that.
    metadata = {"note": "x" * 210_000}
    response = tiny.responses.create(model=TINY, input="hi", metadata=metadata, max_output_tokens=1, store=True)
    assert response.store is False and response.output_text is not None
    with pytest.raises(openai.NotFoundError):
        tiny.responses.retrieve(response.id)
