"""LoRA adapters over real HTTP: `--lora-modules`, a request's `model` naming an adapter, `/v1/models` listing
adapters with their parent, and `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time and under load."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.test_lora import make_adapter
from tests.test_server import API_KEY, AUTH, ServerProcess, free_port, post, start_server, stop_server

MAX_RANK = 8
PROMPTS = ["The paged cache", "Adapters share one base", "A block of sixteen tokens"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server_lora")
    return {
        "first": make_adapter(tiny_llama, root / "first", 8, ["q_proj", "v_proj", "down_proj"], seed=1),
        "second": make_adapter(tiny_llama, root / "second", 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2),
        "too_wide": make_adapter(tiny_llama, root / "too_wide", 16, ["q_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters) -> dict[str | None, list[str]]:
    """Offline greedy texts of each prompt under the base model and under each adapter."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for lora_id, name in enumerate([None, "first", "second"]):
        lora = None if name is None else LoRARequest(name, lora_id, str(adapters[name]))
        texts[name] = [output.outputs[0].text for output in llm.generate(PROMPTS, params, lora_request=lora)]
    assert len({tuple(t) for t in texts.values()}) == 3, "the adapters must change the outputs"
    return texts


@pytest.fixture(scope="module")
def server(tiny_llama, adapters, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    flags = ["--api-key", API_KEY, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2"]
    flags += ["--max-lora-rank", str(MAX_RANK), "--max-cpu-loras", "2", "--lora-modules", f"first={adapters['first']}"]
    process = start_server(tiny_llama, log, *flags)
    yield process
    assert stop_server(process) == 0, log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    body = {"ignore_eos": True}
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=body)
    return reply.choices[0].text


def load(server: ServerProcess, name: str, path: Path | str) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(server: ServerProcess, name: str) -> httpx.Response:
    return post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_an_adapter_named_by_model_answers_as_offline_and_the_base_model_as_itself(client, expected):
    for index, prompt in enumerate(PROMPTS):
        assert complete(client, "first", prompt) == expected["first"][index]
        assert complete(client, "tiny", prompt) == expected[None][index]
    chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "first" and chat.usage.completion_tokens > 0


def test_models_lists_each_adapter_with_its_parent(client, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny", "first"}
    assert cards["first"].parent == "tiny" and cards["first"].root == str(adapters["first"])
    assert cards["tiny"].parent is None


def test_an_unknown_adapter_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        complete(client, "no-such-adapter", "Hi")


def test_bad_loads_and_unloads_are_refused_naming_the_field(server, adapters, tmp_path):
    assert_error(load(server, "wide", adapters["too_wide"]), 400, "lora_path", "r=16", "max_lora_rank")
    assert_error(load(server, "nowhere", tmp_path / "missing"), 400, "lora_path", "adapter_config.json")
    assert_error(load(server, "long", "a" * 5000), 400, "lora_path", "cannot be read")
    assert_error(load(server, "nobody", "~no-such-user-here/adapter"), 400, "lora_path", "cannot be expanded")
    assert_error(load(server, "first", adapters["second"]), 400, "lora_name", "already served")
    assert_error(load(server, "tiny", adapters["second"]), 400, "lora_name", "already served")
    assert_error(unload(server, "never-loaded"), 404, "lora_name", "never-loaded")
    no_key = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
    assert no_key.status_code == 401
    names = {card["id"] for card in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]}
    assert names == {"tiny", "first"}, "a refused load must not be served"


def test_load_use_and_unload_at_run_time(server, client, adapters, expected):
    disk_loads, slot_writes = (
        server.metric("pagedllm:lora_disk_loads_total"),
        server.metric("pagedllm:lora_slot_writes_total"),
    )
    assert load(server, "second", adapters["second"]).status_code == 200
    assert complete(client, "second", PROMPTS[1]) == expected["second"][1]
    # Read from disk once (by the load), written into a slot by its first request.
    assert server.metric("pagedllm:lora_disk_loads_total") == disk_loads + 1
    assert server.metric("pagedllm:lora_slot_writes_total") > slot_writes
    assert 1 <= server.metric("pagedllm:lora_adapters_resident") <= 2
    assert unload(server, "second").status_code == 200
    with pytest.raises(openai.NotFoundError, match="second"):
        complete(client, "second", PROMPTS[1])
    # Loaded again under the same name: served again, with the same weights' output.
    assert load(server, "second", adapters["second"]).status_code == 200
    assert complete(client, "second", PROMPTS[2]) == expected["second"][2]
    assert unload(server, "second").status_code == 200


def test_unloading_an_adapter_in_use_lets_its_running_requests_finish(server, client, adapters):
    assert load(server, "busy", adapters["second"]).status_code == 200
    stream = client.completions.create(
        model="busy", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert unload(server, "busy").status_code == 200
    finish = None
    for chunk in chunks:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    assert len(httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]) > 100
    server.wait_for("pagedllm:kv_blocks_used", lambda used: used == 0)


def test_load_and_unload_under_load_fail_no_request_and_return_every_block(server, adapters, expected):
    async def one(client: openai.AsyncOpenAI, model: str, index: int, started: asyncio.Event) -> tuple[str, int, str]:
        stream = await client.completions.create(
            model=model,
            prompt=PROMPTS[index],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = ""
        async for chunk in stream:
            started.set()
            text += chunk.choices[0].text
        return model, index, text

    async def scenario() -> list[tuple[str, int, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        background = [one(client, ("tiny", "first")[i % 2], i % 3, asyncio.Event()) for i in range(24)]
        running = [asyncio.ensure_future(request) for request in background]
        assert (await asyncio.to_thread(load, server, "late", adapters["second"])).status_code == 200
        started = [asyncio.Event() for _ in range(6)]
        running += [asyncio.ensure_future(one(client, "late", i % 3, started[i])) for i in range(6)]
        await asyncio.gather(*(event.wait() for event in started))  # every late request is running
        assert (await asyncio.to_thread(unload, server, "late")).status_code == 200
        return await asyncio.gather(*running)

    results = asyncio.run(scenario())
    assert len(results) == 30
    for model, index, text in results:
        assert text == expected[{"tiny": None, "first": "first", "late": "second"}[model]][index], model
    server.wait_for("pagedllm:kv_blocks_used", lambda used: used == 0)


def test_lora_modules_need_enable_lora(tiny_llama, adapters, tmp_path):
    command = [sys.executable, "-m", "pagedllm", "serve", "--model", str(tiny_llama), "--port", str(free_port())]
    command += ["--lora-modules", f"first={adapters['first']}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--enable-lora" in done.stderr
