"""`pagedllm bench serve`: load-test any OpenAI-compatible server (pagedllm's, vLLM's) as vLLM's
`bench serve` does.

Requests arrive as a Poisson process at `--request-rate` (inf: all at once) and stream
`/v1/completions`. The metrics follow vLLM's definitions: TTFT is the time to the first chunk with text;
ITL the gaps between later text chunks; TPOT per request is (e2e - TTFT) / (output tokens - 1), over
requests with more than one token; e2e ends at the last text chunk. Output tokens are the server's own
count (`usage.completion_tokens`, asked for with `stream_options.include_usage`). `--json` also keeps
every request's TTFT and TPOT (`ttfts_s`, `tpots_s`, seconds) and plots their CDFs beside the file.

`--cold` is for a server just started, sent nothing yet: its first burst is measured, then a second burst of as many
new prompts (drawn after the first's, so no prefix is shared with them), and the report gives the first burst's
figures, the second's under `warm`, and `cold_over_warm`, the first's output throughput over the second's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.domains import NON_NEGATIVE_INTS, POSITIVE_INTS, SEEDS, FilePaths, Reals, Texts, Urls

if TYPE_CHECKING:
    import httpx  # imported where a benchmark runs: every command's start imports this module

_TIMEOUT_S = 6 * 3600  # as vLLM: a saturated server may take long, and the benchmark measures it, not us
# Synthetic prompts draw words from this text: no dataset to download, and any tokenizer reads them.
SYNTHETIC_TEXT = (
    "the quick brown fox jumps over a lazy dog while paged attention keeps every key and value in small fixed "
    "blocks so that many requests share one pool and the scheduler admits new work at each step"
)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    num_prompts: int
    request_rate: float
    model: str | None = None
    input_len: int = 128  # words of synthetic prompt
    max_tokens: int = 128
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = None
    num_warmups: int = 0  # requests sent all at once, and waited for, before the measured ones
    cold: bool = False  # measure a second burst after the first, the server then warm


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000", **Urls().flag_kwargs()
    )
    parser.add_argument("--num-prompts", default=100, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--request-rate",
        default=math.inf,
        help="requests/s (inf: all at once)",
        **Reals(0.0, math.inf, low_open=True).flag_kwargs(),
    )
    parser.add_argument(
        "--model", default=None, help="default: the first model the server lists", **Texts().flag_kwargs()
    )
    parser.add_argument("--input-len", default=128, help="words per synthetic prompt", **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--max-tokens", default=128, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--ignore-eos", action="store_true", help="vLLM extra: always generate max-tokens")
    parser.add_argument("--seed", default=0, **SEEDS.flag_kwargs())
    parser.add_argument(
        "--num-warmups",
        default=0,
        help="requests sent at once and finished before measuring (as vLLM's)",
        **NON_NEGATIVE_INTS.flag_kwargs(),
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="the server has just started: measure its first burst, then the same burst again, warm, and their ratio",
    )
    # An empty OPENAI_API_KEY is no key (argparse checks a default given as text against the domain too).
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None, **Texts().flag_kwargs())
    parser.add_argument(
        "--json",
        default=None,
        help="also write the results here, with every request's TTFT and TPOT, and latency_cdf.png beside it",
        **FilePaths().flag_kwargs(),
    )


def run_bench_serve(args: argparse.Namespace) -> int:
    config = BenchConfig(
        base_url=args.base_url,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        model=args.model,
        input_len=args.input_len,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        api_key=args.api_key,
        num_warmups=args.num_warmups,
        cold=args.cold,
    )
    if args.cold and args.num_warmups:
        raise ValueError("--cold measures a server's first requests: it takes no --num-warmups")
    report = asyncio.run(run_benchmark(config))
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        # Imported here: matplotlib costs a noticeable part of the CLI's start, and only --json needs it.
        from pagedllm.benchmarks.plots import plot_latency_cdfs

        plot_latency_cdfs(report["ttfts_s"], report["tpots_s"], args.json.parent / "latency_cdf.png")
    if report["failed"]:
        print(f"pagedllm bench: {report['failed']} requests failed, e.g.: {report['first_error']}", file=sys.stderr)
    return 0 if report["completed"] else 1


async def run_benchmark(config: BenchConfig) -> dict:
    rng = random.Random(config.seed)
    words = SYNTHETIC_TEXT.split()
    prompts = [" ".join(rng.choices(words, k=config.input_len)) for _ in range(config.num_prompts)]
    # Drawn after the measured prompts: the same seed measures the same requests with or without warm-ups.
    warmups = [" ".join(rng.choices(words, k=config.input_len)) for _ in range(config.num_warmups)]
    again = [" ".join(rng.choices(words, k=config.input_len)) for _ in range(config.num_prompts if config.cold else 0)]
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=config.base_url, headers=headers, timeout=_TIMEOUT_S, limits=limits
    ) as client:
        model = config.model or await _first_model(client)
        payloads = [_payload(config, model, prompt) for prompt in prompts]
        if warmups:
            await _send_all(client, [_payload(config, model, prompt) for prompt in warmups], [0.0] * len(warmups))
        report = await _burst(client, payloads, config.request_rate, rng)
        if again:
            warm = await _burst(client, [_payload(config, model, prompt) for prompt in again], config.request_rate, rng)
            report |= {"warm": warm, "cold_over_warm": report["output_throughput"] / warm["output_throughput"]}
    return report | {
        "model": model,
        "base_url": config.base_url,
        "num_prompts": config.num_prompts,
        "request_rate": config.request_rate,
        "input_len_words": config.input_len,
        "max_tokens": config.max_tokens,
        "num_warmups": config.num_warmups,
        "cold": config.cold,
    }


async def _burst(client: httpx.AsyncClient, payloads: list[dict], rate: float, rng: random.Random) -> dict:
    started = time.perf_counter()
    results = await _send_all(client, payloads, poisson_offsets(len(payloads), rate, rng))
    return summarize(results, time.perf_counter() - started)


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def poisson_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of a Poisson process: exponential gaps of mean 1/rate, the first
    request at 0. An infinite rate sends everything at once."""
    if rate == float("inf"):
        return [0.0] * count
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]
    return list(itertools.accumulate(gaps))


async def _send_all(client: httpx.AsyncClient, payloads: list[dict], offsets: list[float]) -> list[RequestResult]:
    started = time.perf_counter()
    tasks = []
    for payload, offset in zip(payloads, offsets, strict=True):
        # Sleep to absolute send times, so the time spent starting requests does not stretch the gaps.
        await asyncio.sleep(max(started + offset - time.perf_counter(), 0.0))
        tasks.append(asyncio.create_task(send_request(client, payload)))
    return await asyncio.gather(*tasks)


def _payload(config: BenchConfig, model: str, prompt: str) -> dict:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def send_request(client: httpx.AsyncClient, payload: dict) -> RequestResult:
    import httpx

    result = RequestResult()
    started = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}"
                return result
            async for data in _sse_data(response):
                now = time.perf_counter()
                if "error" in data:
                    result.error = json.dumps(data["error"])
                    return result
                if data.get("choices") and data["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError) as error:  # ValueError: a chunk that is not JSON
        result.error = repr(error)
        return result
    result.latency = last - started
    result.success = True
    return result


async def _sse_data(response: httpx.Response) -> AsyncIterator[dict]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    report = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "first_error": next((r.error for r in results if not r.success), ""),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    report |= _distribution("ttft", [r.ttft for r in done])
    report |= _distribution("tpot", tpots)
    report |= _distribution("itl", [gap for r in done for gap in r.itl])
    report |= _distribution("e2el", [r.latency for r in done])
    # Per request, in seconds, for CDFs and for statistics this summary does not compute.
    return report | {"ttfts_s": [r.ttft for r in done], "tpots_s": tpots}


def _distribution(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds or [0.0]) * 1000
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


_SECTIONS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"))
_SECTIONS += (("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def format_report(report: dict) -> str:
    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        _row("Successful requests:", report["completed"]),
        _row("Failed requests:", report["failed"]),
        _row("Request rate (req/s):", report["request_rate"]),
        _row("Benchmark duration (s):", report["duration"]),
        _row("Total input tokens:", report["total_input_tokens"]),
        _row("Total generated tokens:", report["total_output_tokens"]),
        _row("Request throughput (req/s):", report["request_throughput"]),
        _row("Output token throughput (tok/s):", report["output_throughput"]),
        _row("Total token throughput (tok/s):", report["total_token_throughput"]),
    ]
    for key, title, short in _SECTIONS:
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        lines += [_row(f"{stat.title()} {short} (ms):", report[f"{stat}_{key}_ms"]) for stat in ("mean", "median")]
        lines.append(_row(f"P99 {short} (ms):", report[f"p99_{key}_ms"]))
    if "warm" in report:
        lines.append("{s:{c}^50}".format(s=" The same burst again, warm ", c="-"))
        lines.append(_row("Output token throughput (tok/s):", report["warm"]["output_throughput"]))
        lines.append(_row("Cold over warm:", report["cold_over_warm"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def _row(label: str, value: float) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>10}"
