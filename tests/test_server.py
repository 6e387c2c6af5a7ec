"""`pagedllm serve` over real HTTP: the server runs as a subprocess on a free port with the tiny model and is
driven with the official `openai` client, and with raw requests where that client would refuse to send."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams

API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAULT = "~!~"  # tests/fault_server.py's marker: a prompt ending in it fails inside the engine step
FAULT_SERVER = Path(__file__).with_name("fault_server.py")
NUM_KV_BLOCKS = "512"
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log: Path

    def metrics(self) -> dict[str, float]:
        lines = httpx.get(f"{self.url}/metrics").text.splitlines()
        samples = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def wait_for(self, name: str, accept: Callable[[float], bool], timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while not accept(value := self.metric(name)):
            assert time.monotonic() < deadline, f"{name} stayed at {value}"
            time.sleep(0.02)
        return value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, log: Path, *flags: str, fault: str | None = None) -> ServerProcess:
    """`pagedllm serve`, or with `fault`, tests/fault_server.py with that marker."""
    port = free_port()
    launcher = ["-m", "pagedllm", "serve"] if fault is None else [str(FAULT_SERVER), fault]
    command = [sys.executable, *launcher, "--model", str(model), "--port", str(port)]
    command += ["--dtype", "float32", "--num-kv-blocks", NUM_KV_BLOCKS, *flags]
    with log.open("w") as sink:  # a file, not a pipe: a pipe nobody reads would block the server's logging
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    _wait_healthy(server)
    return server


def _wait_healthy(server: ServerProcess, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"server exited:\n{server.log.read_text()}"
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not healthy after {timeout} s:\n{server.log.read_text()}")


def stop_server(server: ServerProcess) -> int:
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=15)
    finally:
        server.process.kill()


def sse_data(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = ["--api-key", API_KEY, "--served-model-name", "tiny", "tiny-alias"]
    process = start_server(tiny_llama, log, *flags, fault=FAULT)
    yield process
    assert stop_server(process) == 0, log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def post(server: ServerProcess, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, **{"timeout": 60.0} | kwargs)


def streamed_completion(client: openai.OpenAI, **kwargs) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


# ---- completions and chat -----------------------------------------------------------------------


def test_completion_equals_offline_generate(client, tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=int(NUM_KV_BLOCKS))
    (expected,) = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    result = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_completion_equals_non_streamed_also_when_a_stop_string_cuts_it(client):
    args = dict(prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(model="tiny", **args).choices[0]
    assert streamed_completion(client, **args) == (whole.text, whole.finish_reason)
    # A stop string from the middle of the greedy text: the stream must hold back what the stop will cut.
    stop = whole.text[len(whole.text) // 2 : len(whole.text) // 2 + 2]
    cut = client.completions.create(model="tiny", stop=[stop], **args).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == whole.text[: whole.text.index(stop)]
    assert streamed_completion(client, stop=[stop], **args) == (cut.text, "stop")


def test_chat_streamed_equals_non_streamed_with_usage(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    # The same counts, but for the prompt tokens the cache served: the streamed request came second.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens <= cached <= whole.usage.prompt_tokens
    streamed_usage = chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"})
    assert chunks[-1].choices == [] and streamed_usage == whole.usage.model_dump(exclude={"prompt_tokens_details"})
    assert whole.usage.completion_tokens > 0
    assert whole.usage.prompt_tokens == len(tokenize(server, messages=messages))


def tokenize(server: ServerProcess, **body) -> list[int]:
    response = post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_several_prompts_with_n_samples_streamed_and_not(client):
    args = dict(prompt=["Hello world", "The quick"], n=2, max_tokens=5, temperature=0.8, seed=7)
    whole = client.completions.create(model="tiny", extra_body={"ignore_eos": True}, **args)
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == 4 * 5
    texts = {choice.index: "" for choice in whole.choices}
    finishes = {}
    for chunk in client.completions.create(model="tiny", extra_body={"ignore_eos": True}, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {choice.index: choice.text for choice in whole.choices}  # seeded: the same samples
    assert finishes == dict.fromkeys(range(4), "length")


def test_logprobs_and_echo(client):
    result = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens
    # Keyed by token text, as in OpenAI's legacy format: tokens that decode alike (partial UTF-8) share a key.
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True))
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode()) for entry in content)
    # Greedy: each sampled token is the most likely one, and the top list is in order.
    assert all(entry.logprob == entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)
    plain = client.completions.create(model="tiny", prompt="Hello world", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="Hello world", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello world" + plain.choices[0].text


def test_models_tokenize_and_detokenize(server, client):
    assert [model.id for model in client.models.list()] == ["tiny", "tiny-alias"]
    assert client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    tokens = tokenize(server, prompt="Paged attention")
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"].endswith("Paged attention")


# ---- load, disconnects, failures -----------------------------------------------------------------


def test_32_concurrent_streams_all_complete_and_free_their_blocks(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"Request {i}: the quick brown fox",
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    generated = server.metric("pagedllm:generation_tokens_total")
    results = asyncio.run(all_of_them())
    assert [finish for _, finish in results] == ["length"] * 32
    assert server.metric("pagedllm:generation_tokens_total") - generated == 32 * 16
    metrics = server.metrics()
    assert metrics["pagedllm:kv_blocks_used"] == 0
    assert metrics["pagedllm:num_requests_running"] == 0
    assert metrics["pagedllm:kv_blocks_peak"] > 0


def long_request(stream: bool) -> dict:
    return {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": stream}


def test_disconnect_mid_stream_aborts_and_returns_the_blocks(server):
    aborted = server.metric('pagedllm:requests_finished_total{finish_reason="abort"}')
    generated = server.metric("pagedllm:generation_tokens_total")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long_request(True), headers=AUTH) as response:
        for count, _ in enumerate(sse_data(response)):
            if count == 3:
                assert server.metric("pagedllm:kv_blocks_used") > 0
                break  # leaving the iterator closes the connection
    server.wait_for('pagedllm:requests_finished_total{finish_reason="abort"}', lambda v: v == aborted + 1)
    assert server.metric("pagedllm:kv_blocks_used") == 0
    assert server.metric("pagedllm:generation_tokens_total") - generated < 480


def test_disconnect_while_waiting_for_a_whole_completion_aborts_it(server):
    aborted = server.metric('pagedllm:requests_finished_total{finish_reason="abort"}')
    body = json.dumps(long_request(False) | {"n": 16, "temperature": 1.0}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        server.wait_for("pagedllm:num_requests_running", lambda v: v > 0)
    server.wait_for('pagedllm:requests_finished_total{finish_reason="abort"}', lambda v: v == aborted + 1)
    assert server.metric("pagedllm:kv_blocks_used") == 0
    time.sleep(0.2)  # the handler's last lines run after the abort
    assert "InvalidStateError" not in server.log.read_text()  # it once read the result of a task it cancelled


def test_a_failure_inside_the_engine_fails_only_that_request(server, client):
    errors = server.metric('pagedllm:requests_finished_total{finish_reason="error"}')
    healthy: dict[str, object] = {}

    def run_healthy(started: threading.Event) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long_request(True), headers=AUTH) as response:
            chunks = []
            for data in sse_data(response):
                started.set()
                chunks.append(data)
            healthy["chunks"] = chunks

    started = threading.Event()
    thread = threading.Thread(target=run_healthy, args=(started,))
    thread.start()
    assert started.wait(30)
    failed = post(server, "/v1/completions", {"prompt": f"Hello {FAULT}", "max_tokens": 8})
    assert thread.is_alive()  # the healthy request was running beside the failing one
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"prompt": f"Hi {FAULT}", "stream": True}, headers=AUTH
    ) as response:
        failed_stream = list(sse_data(response))
    thread.join(60)

    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error" and "injected fault" in failed.json()["error"]["message"]
    assert "injected fault" in failed_stream[0] and failed_stream[-1] == "[DONE]"
    assert healthy["chunks"][-1] == "[DONE]" and '"finish_reason":"length"' in healthy["chunks"][-2]
    assert server.metric('pagedllm:requests_finished_total{finish_reason="error"}') == errors + 2
    assert client.completions.create(model="tiny", prompt="Still there?", max_tokens=3).usage.completion_tokens == 3
    assert server.wait_for("pagedllm:kv_blocks_used", lambda v: v == 0) == 0


# ---- bad input ----------------------------------------------------------------------------------


def assert_refused(response: httpx.Response, param: str | None, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", b'{"prompt": "hi",', None, "malformed JSON"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "integer"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ("/v1/completions", {"prompt": "hi", "max_tokenz": 5}, "max_tokenz", "unknown field"),
        ("/v1/completions", {"max_tokens": 5}, "prompt", "required"),
        ("/v1/completions", {"prompt": 5}, "prompt", "prompt must be"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, "min_tokens", "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'user'"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "logprobs",
        ),
        ("/detokenize", {"tokens": [10**9]}, "tokens", "outside the vocabulary"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/"}, "lora_name", "--enable-lora"),
        ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_path", "required"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, words):
    if isinstance(body, bytes):
        response = httpx.post(f"{server.url}{path}", content=body, headers=AUTH | {"content-type": "application/json"})
    else:
        response = post(server, path, body)
    assert_refused(response, param, words)


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert raised.value.body["param"] == "model" and "gpt-17" in raised.value.body["message"]


def test_over_long_prompt_is_a_400_saying_both_lengths(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=2)
    assert "600" in raised.value.body["message"] and str(MAX_MODEL_LEN) in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=[5] * 500, max_tokens=100)
    assert "500" in raised.value.body["message"] and str(MAX_MODEL_LEN) in raised.value.body["message"]


def test_api_key_is_required_except_for_health_and_metrics(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


# ---- shutdown ------------------------------------------------------------------------------------


def test_sigterm_ends_in_flight_streams_cleanly_and_exits_0_within_10_s(tiny_llama, tmp_path):
    server = start_server(tiny_llama, tmp_path / "server.log", "--shutdown-grace", "1")
    seen: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long_request(True), timeout=30) as response:
            for data in sse_data(response):
                started.set()
                seen.append(data)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    returncode = server.process.wait(timeout=15)
    elapsed = time.monotonic() - signalled
    thread.join(10)
    assert returncode == 0, server.log.read_text()
    assert elapsed < 10
    # The stream was finished or aborted, and ended properly either way.
    assert seen[-1] == "[DONE]"
    assert '"finish_reason":"abort"' in seen[-2] or '"finish_reason":"length"' in seen[-2]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_streamed_echo_survives_a_prompt_prefilled_in_chunks(tiny_llama, tmp_path):
    """A prompt longer than the step's token budget is prefilled over several steps, each reported with
    no new token; the echoed prompt must still open the stream."""
    server = start_server(tiny_llama, tmp_path / "server.log", "--max-num-batched-tokens", "16")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        prompt = "Hello world, " * 12
        request = {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 4, "temperature": 0}
        plain = client.completions.create(**request).choices[0].text
        streamed = client.completions.create(**request, echo=True, stream=True)
        assert "".join(choice.text for chunk in streamed for choice in chunk.choices) == prompt + plain
    finally:
        assert stop_server(server) == 0, server.log.read_text()


def test_a_body_over_the_limit_is_refused_unread_and_the_server_carries_on(server, client):
    too_big = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'
    headers = AUTH | {"Content-Type": "application/json"}
    for content in (too_big, iter([too_big[i : i + (1 << 20)] for i in range(0, len(too_big), 1 << 20)])):
        response = httpx.post(f"{server.url}/v1/completions", content=content, headers=headers, timeout=60)
        assert response.status_code == 413
        assert "limit of 16777216 bytes" in response.json()["error"]["message"]
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
