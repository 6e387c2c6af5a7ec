"""`pagedllm bench soak`: a long, seeded mix of well-behaved and misbehaving clients against a live server,
then a check that the server came back to rest and still answers.

The mix (fixed by `--seed`) spans chat and completions, streamed and not, `n` 1-4, stop strings, logprobs,
short prompts and a few of a few hundred tokens, and small `max_tokens`, so generation on a slow CPU does not
dominate. A share of the clients misbehave: they leave mid-stream after a few chunks, close the connection
right after sending (before any token), or give up after `--client-timeout` on a non-streamed request.

After the run it waits (at most `--settle-timeout`) for `/metrics` to show nothing running, nothing waiting
and no KV block referenced, and, with `--server-pid`, compares the resident memory of the server and its
child processes (the engine core) before and after. The check is on memory outside the KV pool: on the CPU
the pool is one lazily faulted mapping, and the LRU free queue hands out every block once before reusing
any, so the pool's RSS grows with traffic until all of it (4 GiB by default) has been written, by design. A
`--warmup-requests` mix runs first and is not counted, so the baseline does not include what the first
requests allocate.

Answers are checked against the offline engine (`LLM` on `--reference-model` in `--reference-dtype`, which
must be what the server runs): a greedy probe sent before the mix and again after settling, and up to
`--check-answers` of the mix's greedy requests answered in full, spread over the run, every choice of each.
Greedy decoding is deterministic, so each must equal the offline engine's text for the same request: a
server that answers wrongly under load, or only after it, fails. Comparing the server with itself would not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.benchmarks.serve import SYNTHETIC_TEXT, _first_model, _sse_data
from pagedllm.config import DTypes
from pagedllm.domains import (
    INT64_MAX,
    NON_NEGATIVE_INTS,
    PID_MAX,
    POSITIVE_INTS,
    SEEDS,
    WAITS,
    ExistingPaths,
    Integers,
    Reals,
    Texts,
    Urls,
)
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import httpx  # imported where a benchmark runs: every command's start imports this module

# The gauges that must read 0 once the server has settled: a request or block that stays is a leak.
RUNNING = "pagedllm:num_requests_running"
WAITING = "pagedllm:num_requests_waiting"
KV_BLOCKS_USED = "pagedllm:kv_blocks_used"
ABORTS = 'pagedllm:requests_finished_total{finish_reason="abort"}'
_SETTLE_POLL_S = 0.1
_STOP_STRINGS = (".", ",", "\n", " the", " and", "!")
_GREEDY = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0}


class Behaviour(StrEnum):
    """What a client does once it has sent its request."""

    WAIT = "wait"  # reads the whole answer
    LEAVE_MID_STREAM = "leave mid-stream"  # reads a few chunks of a stream, then closes
    LEAVE_BEFORE_FIRST_TOKEN = "leave before first token"  # closes the connection right after sending
    TIME_OUT = "time out"  # gives up after the client timeout on a non-streamed request


MISBEHAVIOURS = (Behaviour.LEAVE_MID_STREAM, Behaviour.LEAVE_BEFORE_FIRST_TOKEN, Behaviour.TIME_OUT)


class Outcome(StrEnum):
    OK = "ok"  # a 2xx answer read in full, with a finish reason for every choice
    LEFT = "left"  # the client disconnected as planned
    TIMED_OUT = "timed out"  # the impatient client's timeout fired
    CLIENT_ERROR = "4xx"
    SERVER_ERROR = "5xx"
    STREAM_ERROR = "stream error"  # a 200 stream that carried an error event
    FAILED = "failed"  # anything else: a transport error, a malformed answer, a patient client's timeout


@dataclass(frozen=True, slots=True)
class SoakConfig:
    base_url: str
    requests: int = 200
    concurrency: int = 16
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 300.0  # a patient client's limit: only a stuck server reaches it
    client_timeout_s: float = 0.3  # the impatient client's
    settle_timeout_s: float = 30.0
    warmup_requests: int = 0
    server_pid: int | None = None
    max_rss_growth_mb: float = 100.0
    check_answers: int = 32  # greedy requests of the mix whose answers are compared with the offline engine's


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the mix: where it goes, its body, and how its client behaves."""

    path: str
    body: dict
    behaviour: Behaviour
    chunks_before_leaving: int = 0  # LEAVE_MID_STREAM only

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    behaviour: Behaviour
    outcome: Outcome
    latency_s: float = 0.0
    error: str = ""
    texts: tuple[str, ...] = ()  # OK only: every choice's text (chat: content), by index


@dataclass(frozen=True, slots=True)
class AnswerCheck:
    """A greedy answer the server gave, and the offline engine's answer to the same request."""

    request: str  # which request and choice, for the failure message
    served: str
    expected: str

    @property
    def ok(self) -> bool:
        return self.served == self.expected


class Reference(Protocol):
    """What decides the right greedy answer to a request body of the mix (or the probe)."""

    def answers(self, bodies: list[dict]) -> list[str]: ...


class OfflineEngine:
    """The offline engine on the server's model and dtype: the greedy text each body must be answered."""

    def __init__(self, model: str | Path | None, dtype: str) -> None:
        self._llm = LLM(model=model, dtype=dtype)

    def answers(self, bodies: list[dict]) -> list[str]:
        prompts = [self._llm.render_chat(b["messages"]) if "messages" in b else b["prompt"] for b in bodies]
        outputs = self._llm.generate(prompts, [greedy_params(b) for b in bodies], use_tqdm=False)
        return [output.outputs[0].text for output in outputs]


def greedy_params(body: dict) -> SamplingParams:
    """The body's fields that decide a greedy text; `n` copies of it, and logprobs, change no choice's text."""
    return SamplingParams(
        temperature=0.0, max_tokens=body["max_tokens"], stop=body.get("stop"), ignore_eos=body.get("ignore_eos", False)
    )


@dataclass(frozen=True, slots=True)
class SettledState:
    settled: bool
    waited_s: float
    metrics: dict[str, float]

    def gauge(self, name: str) -> float:
        return self.metrics.get(name, float("nan"))


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Resident memory of the server's process tree, and the part of it that is the KV pool."""

    rss_mib: float
    kv_pool_mib: float

    @property
    def outside_kv_pool_mib(self) -> float:
        return self.rss_mib - self.kv_pool_mib


@dataclass(frozen=True, slots=True)
class SoakResult:
    requests: int
    warmup_requests: int
    chat_requests: int
    completion_requests: int
    streamed_requests: int
    served_ok: int
    disconnects: dict[Behaviour, int]  # the misbehaviours that happened, by kind (client timeouts included)
    answered_before_misbehaving: int  # misbehaving clients whose whole answer came before they could leave
    http_4xx: int
    http_5xx: int
    stream_errors: int
    other_errors: int
    latency_p50_ms: float
    latency_p99_ms: float
    duration_s: float
    server_aborts: float  # requests the server ended with finish_reason "abort" during the measured run
    settle: SettledState
    memory_before: MemorySample | None
    memory_after: MemorySample | None
    probes: tuple[AnswerCheck, AnswerCheck]  # the greedy probe before the mix and after settling
    sampled: tuple[AnswerCheck, ...]  # choices of the mix's greedy requests
    first_errors: tuple[str, ...]
    failures: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def rss_growth_mib(self) -> float | None:
        """Growth outside the KV pool: the pool's pages fault in as fresh blocks are first written, which
        is bounded by its size and no leak."""
        if self.memory_before is None or self.memory_after is None:
            return None
        return self.memory_after.outside_kv_pool_mib - self.memory_before.outside_kv_pool_mib

    @property
    def client_timeouts(self) -> int:
        return self.disconnects.get(Behaviour.TIME_OUT, 0)


def add_bench_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000", **Urls().flag_kwargs()
    )
    parser.add_argument("--requests", default=200, help="requests in the measured mix", **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--concurrency", default=16, help="clients sending at once", **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--seed", default=0, help="fixes the mix: kinds, prompts, parameters", **SEEDS.flag_kwargs())
    parser.add_argument(
        "--model", default=None, help="default: the first model the server lists", **Texts().flag_kwargs()
    )
    # An empty OPENAI_API_KEY is no key (argparse checks a default given as text against the domain too).
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None, **Texts().flag_kwargs())
    parser.add_argument("--timeout", default=300.0, help="seconds a patient client waits", **WAITS.flag_kwargs())
    parser.add_argument(
        "--client-timeout", default=0.3, help="seconds an impatient client waits", **WAITS.flag_kwargs()
    )
    parser.add_argument(
        "--settle-timeout", default=30.0, help="seconds to wait for the server to come to rest", **WAITS.flag_kwargs()
    )
    parser.add_argument(
        "--warmup-requests",
        default=50,
        help="a mix sent first and not counted, before RSS is read",
        **NON_NEGATIVE_INTS.flag_kwargs(),
    )
    parser.add_argument(
        "--server-pid",
        default=None,
        help="measure this process's RSS (and children's)",
        **Integers(1, PID_MAX).flag_kwargs(),
    )
    parser.add_argument(
        "--max-rss-growth-mb",
        default=100.0,
        help="fail when the server's RSS outside the KV pool grows more (with a pid)",
        **Reals(0.0, INT64_MAX >> 20).flag_kwargs(),  # its bytes are an int64
    )
    parser.add_argument(
        "--reference-model",
        default=None,
        help="the server's model (HF folder or .gguf) for the offline engine the answers must equal "
        "(default: the default model, as `pagedllm serve` without --model)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument("--reference-dtype", default="auto", help="the server's --dtype", **DTypes().flag_kwargs())
    parser.add_argument(
        "--check-answers",
        default=32,
        help="greedy requests of the mix compared with the offline engine",
        **NON_NEGATIVE_INTS.flag_kwargs(),
    )


def run_bench_soak(args: argparse.Namespace) -> int:
    config = SoakConfig(
        base_url=args.base_url,
        requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        model=args.model,
        api_key=args.api_key,
        timeout_s=args.timeout,
        client_timeout_s=args.client_timeout,
        settle_timeout_s=args.settle_timeout,
        warmup_requests=args.warmup_requests,
        server_pid=args.server_pid,
        max_rss_growth_mb=args.max_rss_growth_mb,
        check_answers=args.check_answers,
    )
    result = asyncio.run(run_soak(config, OfflineEngine(args.reference_model, args.reference_dtype)))
    print(format_result(result))
    for failure in result.failures:
        print(f"pagedllm bench soak: FAIL: {failure}", file=sys.stderr)
    return 0 if result.ok else 1


async def run_soak(config: SoakConfig, reference: Reference) -> SoakResult:
    if config.requests < 1 or config.concurrency < 1:
        raise ValueError("--requests and --concurrency must be at least 1")
    if config.check_answers < 0:
        raise ValueError("--check-answers must be at least 0")
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=config.base_url, headers=headers, timeout=config.timeout_s, limits=limits
    ) as client:
        model = config.model or await _first_model(client)
        warmup = await _warm_up(client, config, model)
        probe_before = await _greedy_answer(client, model)
        memory_before = _memory(config.server_pid)
        aborts_before = (await scrape(client)).get(ABORTS, 0.0)
        specs = build_mix(random.Random(config.seed), config.requests, model)
        started = time.perf_counter()
        outcomes = await run_mix(client, config, specs)
        duration = time.perf_counter() - started
        settle = await wait_settled(client, config.settle_timeout_s)
        memory_after = _memory(config.server_pid)
        probe_after = await _greedy_answer(client, model)
    aborts = settle.metrics.get(ABORTS, 0.0) - aborts_before
    # The offline engine runs after the last request, so it takes no core from the server under load.
    probes, sampled = check_answers(reference, specs, outcomes, (probe_before, probe_after), config.check_answers)
    measured = _Measured(
        specs, outcomes, warmup, duration, settle, aborts, memory_before, memory_after, probes, sampled
    )
    return _tally(measured, config)


async def _warm_up(client: httpx.AsyncClient, config: SoakConfig, model: str) -> list[RequestOutcome]:
    if config.warmup_requests <= 0:
        return []
    # A string seed: the warm-up mix is as fixed as the measured one, yet not its prefix.
    specs = build_mix(random.Random(f"warmup-{config.seed}"), config.warmup_requests, model)
    outcomes = await run_mix(client, config, specs)
    await wait_settled(client, config.settle_timeout_s)
    return outcomes


# ---- the mix ---------------------------------------------------------------------------------------------


def build_mix(rng: random.Random, count: int, model: str) -> list[RequestSpec]:
    """`count` requests drawn from `rng` alone, so a seed always gives the same kinds, prompts and params."""
    return [_one_spec(rng, model) for _ in range(count)]


def _one_spec(rng: random.Random, model: str) -> RequestSpec:
    behaviour = rng.choices(list(Behaviour), weights=(70, 10, 10, 10))[0]
    chat = rng.random() < 0.5
    if behaviour is Behaviour.LEAVE_MID_STREAM:
        stream = True
    elif behaviour is Behaviour.TIME_OUT:
        stream = False
    else:
        stream = rng.random() < 0.5
    body = _sampling_body(rng, model, chat, stream, behaviour)
    body |= _chat_fields(rng) if chat else _completion_fields(rng)
    chunks = rng.randint(1, 3) if behaviour is Behaviour.LEAVE_MID_STREAM else 0
    return RequestSpec("/v1/chat/completions" if chat else "/v1/completions", body, behaviour, chunks)


def _sampling_body(rng: random.Random, model: str, chat: bool, stream: bool, behaviour: Behaviour) -> dict:
    body: dict = {"model": model, "stream": stream, "n": rng.choices((1, 2, 3, 4), weights=(70, 10, 10, 10))[0]}
    if behaviour is Behaviour.WAIT:
        body["max_tokens"] = rng.randint(1, 64)
    else:
        # Long enough that the client is still waiting when it leaves: the server must do the aborting.
        body |= {"max_tokens": rng.randint(48, 64), "ignore_eos": True}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body |= {"temperature": 0.8, "seed": rng.randrange(2**31)}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(_STOP_STRINGS, rng.randint(1, 2))
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.25:
        k = rng.randint(0, 5)
        body |= {"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k}
    return body


def _completion_fields(rng: random.Random) -> dict:
    return {"prompt": _prompt(rng)}


def _chat_fields(rng: random.Random) -> dict:
    messages = [{"role": "user", "content": _prompt(rng)}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "You are a terse assistant."})
    return {"messages": messages}


def _prompt(rng: random.Random) -> str:
    words = SYNTHETIC_TEXT.split()
    # Most prompts are short; one in ten runs to a few hundred tokens, so prefill chunks and the prefix cache
    # see long sequences come and go.
    length = rng.randint(150, 300) if rng.random() < 0.1 else rng.randint(3, 24)
    return " ".join(rng.choices(words, k=length))


# ---- the clients -----------------------------------------------------------------------------------------


async def run_mix(client: httpx.AsyncClient, config: SoakConfig, specs: list[RequestSpec]) -> list[RequestOutcome]:
    """Send `specs` from `config.concurrency` clients, each taking the next request when its last one ends."""
    outcomes: list[RequestOutcome | None] = [None] * len(specs)
    queue = iter(enumerate(specs))  # shared: the event loop hands each spec to exactly one worker

    async def worker() -> None:
        for index, spec in queue:
            outcomes[index] = await _send(client, config, spec)

    await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    return [outcome for outcome in outcomes if outcome is not None]


async def _send(client: httpx.AsyncClient, config: SoakConfig, spec: RequestSpec) -> RequestOutcome:
    import httpx

    started = time.perf_counter()
    try:
        if spec.behaviour is Behaviour.LEAVE_BEFORE_FIRST_TOKEN:
            return await _send_and_close(client, spec)
        if spec.behaviour is Behaviour.TIME_OUT:
            return await _impatient(client, spec, config.client_timeout_s, started)
        if spec.stream:
            return await _streamed(client, spec, started)
        return await _whole(client, spec, started)
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as error:  # ValueError: JSON
        return RequestOutcome(spec.behaviour, Outcome.FAILED, error=f"{spec.path}: {error!r}")


async def _whole(client: httpx.AsyncClient, spec: RequestSpec, started: float) -> RequestOutcome:
    response = await client.post(spec.path, json=spec.body)
    return _judge_whole(spec, response, started)


async def _impatient(client: httpx.AsyncClient, spec: RequestSpec, timeout_s: float, started: float) -> RequestOutcome:
    import httpx

    try:
        response = await client.post(spec.path, json=spec.body, timeout=timeout_s)
    except httpx.TimeoutException:  # httpx closes the connection, which the server sees as a disconnect
        return RequestOutcome(spec.behaviour, Outcome.TIMED_OUT)
    return _judge_whole(spec, response, started)


def _judge_whole(spec: RequestSpec, response: httpx.Response, started: float) -> RequestOutcome:
    if response.status_code >= 300:
        return _http_error(spec, response.status_code, response.text)
    choices = response.json()["choices"]
    reasons = {choice["index"]: choice["finish_reason"] for choice in choices}
    texts = {
        choice["index"]: choice["message"]["content"] if "message" in choice else choice["text"] for choice in choices
    }
    return _complete_or_malformed(spec, reasons, texts, time.perf_counter() - started)


async def _streamed(client: httpx.AsyncClient, spec: RequestSpec, started: float) -> RequestOutcome:
    reasons: dict[int, str | None] = {}
    texts: dict[int, str] = {}
    async with client.stream("POST", spec.path, json=spec.body) as response:
        if response.status_code >= 300:
            return _http_error(spec, response.status_code, (await response.aread()).decode(errors="replace"))
        async with contextlib.aclosing(_sse_data(response)) as events:
            chunks = 0
            async for data in events:
                if "error" in data:
                    return RequestOutcome(spec.behaviour, Outcome.STREAM_ERROR, error=json.dumps(data["error"]))
                for choice in data.get("choices") or []:
                    index = choice["index"]
                    reasons[index] = choice.get("finish_reason") or reasons.get(index)
                    delta = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    texts[index] = texts.get(index, "") + (delta or "")
                chunks += 1
                if _leaves_now(spec, chunks, reasons):
                    # Leaving the `async with` closes the connection with the body unread.
                    return RequestOutcome(spec.behaviour, Outcome.LEFT)
    return _complete_or_malformed(spec, reasons, texts, time.perf_counter() - started)


async def _send_and_close(client: httpx.AsyncClient, spec: RequestSpec) -> RequestOutcome:
    """Write the whole request on a socket of its own and close it at once, before any answer can arrive."""
    url = client.base_url
    body = json.dumps(spec.body).encode()
    lines = [f"POST {url.path.rstrip('/')}{spec.path} HTTP/1.1", f"Host: {url.netloc.decode()}"]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in client.headers.items() if name.lower() == "authorization"]
    port = url.port or (443 if url.scheme == "https" else 80)
    _, writer = await asyncio.open_connection(url.host, port, ssl=url.scheme == "https")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return RequestOutcome(spec.behaviour, Outcome.LEFT)


def _leaves_now(spec: RequestSpec, chunks: int, reasons: dict[int, str | None]) -> bool:
    # A stream that has already finished every choice has nothing left to walk away from.
    leaving = spec.behaviour is Behaviour.LEAVE_MID_STREAM and chunks >= spec.chunks_before_leaving
    return leaving and not _all_finished(spec, reasons)


def _all_finished(spec: RequestSpec, reasons: dict[int, str | None]) -> bool:
    return all(reasons.get(index) for index in range(spec.n))


def _complete_or_malformed(
    spec: RequestSpec, reasons: dict[int, str | None], texts: Mapping[int, str | None], latency_s: float
) -> RequestOutcome:
    if sorted(reasons) != list(range(spec.n)) or not _all_finished(spec, reasons):
        return RequestOutcome(spec.behaviour, Outcome.FAILED, error=f"{spec.path}: finish reasons {reasons}")
    answers = tuple(texts.get(index) or "" for index in range(spec.n))
    return RequestOutcome(spec.behaviour, Outcome.OK, latency_s=latency_s, texts=answers)


def _http_error(spec: RequestSpec, status: int, text: str) -> RequestOutcome:
    outcome = Outcome.SERVER_ERROR if status >= 500 else Outcome.CLIENT_ERROR
    return RequestOutcome(spec.behaviour, outcome, error=f"{spec.path}: HTTP {status}: {text[:300]}")


# ---- the server's state ----------------------------------------------------------------------------------


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """`/metrics` as {'name' or 'name{label="value"}': value}."""
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{name}="{value}"' for name, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


async def wait_settled(client: httpx.AsyncClient, timeout_s: float) -> SettledState:
    """Poll `/metrics` until nothing runs, waits or holds a KV block, for at most `timeout_s`."""
    started = time.perf_counter()
    while True:
        metrics = await scrape(client)
        waited = time.perf_counter() - started
        if all(metrics.get(name) == 0 for name in (RUNNING, WAITING, KV_BLOCKS_USED)):
            return SettledState(True, waited, metrics)
        if waited >= timeout_s:
            return SettledState(False, waited, metrics)
        await asyncio.sleep(_SETTLE_POLL_S)


async def _greedy_answer(client: httpx.AsyncClient, model: str) -> str:
    response = await client.post("/v1/completions", json=_GREEDY | {"model": model})
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _memory(pid: int | None) -> MemorySample | None:
    if pid is None:
        return None
    if not Path(f"/proc/{pid}").exists():
        raise ValueError(f"no process {pid}")
    # The engine core is a child of the server's process: the tree holds the model and the KV pool.
    tree = list(_process_tree(pid))
    rss = sum(_vm_rss_kib(member) for member in tree)
    return MemorySample(rss / 1024, sum(_kv_pool_rss_kib(member) for member in tree) / 1024)


def _process_tree(root: int) -> Iterator[int]:
    # /proc/PID/task/*/children needs CONFIG_PROC_CHILDREN, which not every kernel has; every stat file has the
    # parent's pid.
    children: dict[int, list[int]] = {}
    for pid, parent in _parents():
        children.setdefault(parent, []).append(pid)
    stack = [root]
    while stack:
        pid = stack.pop()
        yield pid
        stack += children.get(pid, [])


def _parents() -> Iterator[tuple[int, int]]:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process may end between the listing and the read
            # The command name in parentheses may hold spaces; the fields after its last ')' do not.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            yield int(stat.parent.name), int(fields[1])


def _kv_pool_rss_kib(pid: int) -> int:
    """Resident KiB of the mappings advised MADV_NOHUGEPAGE ('nh'): on the CPU that
    is the KV pool alone (`worker.cache_engine.zeroed`). Its pages fault in lazily as the LRU free queue
    hands out blocks never written before, so until every block has been used once the pool's RSS grows
    with traffic by design."""
    resident, mapping_rss = 0, 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            if line.startswith("Rss:"):
                mapping_rss = int(line.split()[1])
            elif line.startswith("VmFlags:") and "nh" in line.split()[1:]:
                resident += mapping_rss  # VmFlags is a mapping's last line: its Rss came before
    return resident


def _vm_rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0  # ended, or a kernel thread: no resident memory of its own


# ---- the verdict -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Measured:
    """What one soak gathered, before it is counted up."""

    specs: list[RequestSpec]
    outcomes: list[RequestOutcome]
    warmup: list[RequestOutcome]
    duration_s: float
    settle: SettledState
    server_aborts: float
    memory_before: MemorySample | None
    memory_after: MemorySample | None
    probes: tuple[AnswerCheck, AnswerCheck]
    sampled: tuple[AnswerCheck, ...]


def check_answers(
    reference: Reference,
    specs: list[RequestSpec],
    outcomes: list[RequestOutcome],
    probes: tuple[str, str],
    count: int,
) -> tuple[tuple[AnswerCheck, AnswerCheck], tuple[AnswerCheck, ...]]:
    """The probe's answers before and after the mix, and every choice of up to `count` of the mix's greedy
    requests answered in full, each beside the reference's answer to the same body."""
    greedy = [i for i, (spec, o) in enumerate(zip(specs, outcomes, strict=True)) if _greedy_ok(spec, o)]
    # Spread over the run, so the busiest moments of the mix are among the sampled, not just its start.
    taken = min(count, len(greedy))
    chosen = [greedy[k * len(greedy) // taken] for k in range(taken)]
    expected_probe, *expected = reference.answers([_GREEDY, *(specs[i].body for i in chosen)])
    before, after = probes
    checked = (
        AnswerCheck("probe before the mix", before, expected_probe),
        AnswerCheck("probe after settling", after, expected_probe),
    )
    sampled = tuple(
        AnswerCheck(f"request {i} ({_describe(specs[i])}) choice {choice}", text, answer)
        for i, answer in zip(chosen, expected, strict=True)
        for choice, text in enumerate(outcomes[i].texts)
    )
    return checked, sampled


def _greedy_ok(spec: RequestSpec, outcome: RequestOutcome) -> bool:
    return spec.body["temperature"] == 0.0 and outcome.outcome is Outcome.OK


def _describe(spec: RequestSpec) -> str:
    return f"{spec.path}, {'streamed' if spec.stream else 'whole'}, n={spec.n}, max_tokens={spec.body['max_tokens']}"


def _tally(measured: _Measured, config: SoakConfig) -> SoakResult:
    outcomes = measured.outcomes
    kinds = Counter(outcome.outcome for outcome in outcomes)
    left = Counter(o.behaviour for o in outcomes if o.outcome in (Outcome.LEFT, Outcome.TIMED_OUT))
    latencies_ms = np.asarray([o.latency_s for o in outcomes if o.outcome is Outcome.OK] or [0.0]) * 1000
    chat = sum(spec.path.endswith("/chat/completions") for spec in measured.specs)
    result = SoakResult(
        requests=len(measured.specs),
        warmup_requests=len(measured.warmup),
        chat_requests=chat,
        completion_requests=len(measured.specs) - chat,
        streamed_requests=sum(spec.stream for spec in measured.specs),
        served_ok=kinds[Outcome.OK],
        disconnects={behaviour: left[behaviour] for behaviour in MISBEHAVIOURS},
        answered_before_misbehaving=sum(o.behaviour in MISBEHAVIOURS and o.outcome is Outcome.OK for o in outcomes),
        http_4xx=kinds[Outcome.CLIENT_ERROR],
        http_5xx=kinds[Outcome.SERVER_ERROR],
        stream_errors=kinds[Outcome.STREAM_ERROR],
        other_errors=kinds[Outcome.FAILED],
        latency_p50_ms=float(np.percentile(latencies_ms, 50)),
        latency_p99_ms=float(np.percentile(latencies_ms, 99)),
        duration_s=measured.duration_s,
        server_aborts=measured.server_aborts,
        settle=measured.settle,
        memory_before=measured.memory_before,
        memory_after=measured.memory_after,
        probes=measured.probes,
        sampled=measured.sampled,
        first_errors=tuple(o.error for o in outcomes if o.error)[:5],
    )
    return replace(result, failures=tuple(_failures(result, config, measured.warmup)))


def _failures(result: SoakResult, config: SoakConfig, warmup: list[RequestOutcome]) -> Iterator[str]:
    # Every request of the mix is valid, so a 4xx is as much a server bug as a 5xx.
    for count, what in (
        (result.http_5xx, "HTTP 5xx answers"),
        (result.stream_errors, "streams that carried an error"),
        (result.http_4xx, "HTTP 4xx answers to valid requests"),
        (result.other_errors, "requests that failed otherwise (transport, malformed answer, patient timeout)"),
    ):
        if count:
            yield f"{count} {what}"
    warmup_errors = sum(o.outcome in (Outcome.SERVER_ERROR, Outcome.STREAM_ERROR) for o in warmup)
    if warmup_errors:
        yield f"{warmup_errors} server errors during the warm-up"
    if not result.settle.settled:
        state = ", ".join(f"{name} {result.settle.gauge(name):g}" for name in (RUNNING, WAITING, KV_BLOCKS_USED))
        yield f"not settled after {config.settle_timeout_s:g} s: {state}"
    for check in (*result.probes, *result.sampled):
        if not check.ok:
            yield f"greedy {check.request}: served {check.served!r}, the offline engine {check.expected!r}"
    if not result.probes[0].expected:
        yield "the greedy probe's answer is empty"
    growth = result.rss_growth_mib
    if growth is not None and growth > config.max_rss_growth_mb:
        yield f"server RSS outside the KV pool grew {growth:.1f} MiB (limit {config.max_rss_growth_mb:g})"


def format_result(result: SoakResult) -> str:
    settle = result.settle
    lines = [
        "{s:{c}^60}".format(s=" Soak Result ", c="="),
        _row("Warm-up requests (not counted):", result.warmup_requests),
        _row("Requests sent:", result.requests),
        _row("  chat / completions:", f"{result.chat_requests} / {result.completion_requests}"),
        _row("  streamed:", result.streamed_requests),
        _row("Served OK (2xx complete):", result.served_ok),
        _row("Disconnects mid-stream:", result.disconnects[Behaviour.LEAVE_MID_STREAM]),
        _row("Disconnects before first token:", result.disconnects[Behaviour.LEAVE_BEFORE_FIRST_TOKEN]),
        _row("Client timeouts:", result.client_timeouts),
        _row("Misbehaving clients answered in full first:", result.answered_before_misbehaving),
        _row("Server aborts (finish_reason=abort):", int(result.server_aborts)),
        _row("HTTP 4xx:", result.http_4xx),
        _row("HTTP 5xx:", result.http_5xx),
        _row("Errors inside 200 streams:", result.stream_errors),
        _row("Other failures:", result.other_errors),
        _row("Latency p50 / p99 (ms):", f"{result.latency_p50_ms:.0f} / {result.latency_p99_ms:.0f}"),
        _row("Duration (s):", f"{result.duration_s:.1f}"),
        _row("Settled:", f"{'yes' if settle.settled else 'NO'} after {settle.waited_s:.1f} s"),
        _row("Running / waiting / KV blocks used:", _gauges(settle)),
        *_memory_rows(result),
        _row("Greedy probe before / after = offline:", " / ".join("yes" if c.ok else "NO" for c in result.probes)),
        _row("Sampled greedy answers = offline:", f"{sum(c.ok for c in result.sampled)}/{len(result.sampled)}"),
        _row("Verdict:", "PASS" if result.ok else "FAIL"),
        "=" * 60,
    ]
    lines += [f"failure: {failure}" for failure in result.failures]
    lines += [f"e.g.: {error}" for error in result.first_errors if result.failures]
    return "\n".join(lines)


def _memory_rows(result: SoakResult) -> list[str]:
    before, after = result.memory_before, result.memory_after
    if before is None or after is None:
        return [_row("Server RSS before / after (MiB):", "- (no --server-pid)")]
    return [
        _row("Server RSS before / after (MiB):", f"{before.rss_mib:.1f} / {after.rss_mib:.1f}"),
        _row("  of which KV pool, faulted in (MiB):", f"{before.kv_pool_mib:.1f} / {after.kv_pool_mib:.1f}"),
        _row("  growth outside the KV pool (MiB):", f"{result.rss_growth_mib:.1f}"),
    ]


def _gauges(settle: SettledState) -> str:
    return " / ".join(f"{settle.gauge(name):g}" for name in (RUNNING, WAITING, KV_BLOCKS_USED))


def _row(label: str, value: object) -> str:
    return f"{label:<44}{value!s:>16}"
