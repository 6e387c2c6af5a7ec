"""`pagedllm generate|chat`: the command line over the same engine the `LLM` class uses."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from pagedllm.benchmarks.accuracy import add_bench_accuracy_args, run_bench_accuracy
from pagedllm.benchmarks.embed import add_bench_embed_args, run_bench_embed
from pagedllm.benchmarks.flood import add_bench_flood_args, run_bench_flood
from pagedllm.benchmarks.memory import add_bench_memory_args, run_bench_memory
from pagedllm.benchmarks.serve import add_bench_serve_args, run_bench_serve
from pagedllm.benchmarks.soak import add_bench_soak_args, run_bench_soak
from pagedllm.benchmarks.speculative import add_bench_speculative_args, run_bench_speculative
from pagedllm.benchmarks.structured import add_bench_structured_args, run_bench_structured
from pagedllm.benchmarks.throughput import add_bench_throughput_args, run_bench_throughput
from pagedllm.config import (
    EngineConfig,
    ServeOptions,
    add_dataclass_args,
    add_option_flag,
    check_options,
    option,
    option_values,
)
from pagedllm.domains import INT32_MAX, POSITIVE_INTS, SEEDS, Integers, Reals, Texts
from pagedllm.entrypoints.llm import LLM, Message
from pagedllm.heap import freeze_long_lived
from pagedllm.sampling_params import MAX_TEMPERATURE, MIN_REPETITION_PENALTY, MIN_TOP_P, SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """The SamplingParams fields `generate` and `chat` take, with the CLI's own defaults (greedy unless told
    otherwise) and SamplingParams' own bounds as domains, so that a bad one fails before the model loads."""

    max_tokens: int = option(256, "most tokens to generate", domain=POSITIVE_INTS)
    temperature: float = option(0.0, "0 is greedy", domain=Reals(0.0, MAX_TEMPERATURE))
    top_p: float = option(
        1.0, "keep the likeliest tokens whose probabilities add up to this", domain=Reals(MIN_TOP_P, 1.0)
    )
    top_k: int = option(0, "keep only this many likeliest tokens (0 or -1: all)", domain=Integers(-1, INT32_MAX))
    min_p: float = option(0.0, "drop tokens less likely than this times the likeliest", domain=Reals(0.0, 1.0))
    repetition_penalty: float = option(
        1.0, "above 1 discourages repeating tokens", domain=Reals(MIN_REPETITION_PENALTY, 1 / MIN_REPETITION_PENALTY)
    )
    sampling_seed: int | None = option(None, "seed of the request's sampling (default: random)", domain=SEEDS)

    def __post_init__(self) -> None:
        check_options(self)

    def params(self) -> SamplingParams:
        chosen = asdict(self)
        seed = chosen.pop("sampling_seed")  # --seed is the engine's
        return SamplingParams(**chosen, seed=seed)


def build_llm(args: argparse.Namespace) -> LLM:
    llm = LLM(**option_values(EngineConfig, args))
    freeze_long_lived()
    return llm


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingFlags(**option_values(SamplingFlags, args)).params()


def stream(llm: LLM, prompt: str | dict, params: SamplingParams) -> Iterator[str]:
    """Yield text as the engine produces it."""
    engine = llm.engine
    request_id = "cli"
    engine.add_request(request_id, prompt, params)
    shown = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                yield text[shown:]
                shown = len(text)
    finally:
        engine.abort_request(request_id)


def run_generate(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    use_template = not args.raw and bool(llm.get_tokenizer().chat_template)
    prompt = llm.render_chat([{"role": "user", "content": args.prompt}]) if use_template else args.prompt
    for piece in stream(llm, prompt, sampling_params(args)):
        print(piece, end="", flush=True)
    print()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    params = sampling_params(args)
    history: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
    print("pagedllm chat: an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        history.append({"role": "user", "content": user})
        reply = ""
        for piece in stream(llm, llm.render_chat(history), params):
            reply += piece
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
    return 0


def run_serve(args: argparse.Namespace) -> int:
    # Imported here: the web stack costs start-up time that generate and chat need not pay.
    engine_options, options = option_values(EngineConfig, args), ServeOptions(**option_values(ServeOptions, args))
    if engine_options.get("distributed_executor_backend") == "ray":
        from pagedllm.entrypoints.ray_serve import serve_on_ray

        return serve_on_ray(engine_options, options)
    autoscaling = options.min_replicas is not None or options.max_replicas is not None
    if options.data_parallel_size > 1 or options.ray_address is not None or autoscaling:
        raise ValueError("--data-parallel-size, --ray-address and autoscaling need --distributed-executor-backend ray")
    from pagedllm.entrypoints.openai.api_server import serve

    return serve(engine_options, options)


def run_worker(args: argparse.Namespace) -> int:
    from pagedllm.worker.group import run_node

    return run_node(EngineConfig(**option_values(EngineConfig, args)))


class _Parser(argparse.ArgumentParser):
    """argparse (3.11) drops a `--` given as a flag's value (`--log-level=--`), leaving the flag an empty list that
    no domain checks: refused here as a value outside every domain. Subcommands' parsers are of this class too."""

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            raise argparse.ArgumentError(action, "invalid value: '--'")
        return super()._get_values(action, arg_strings)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedllm", description="LLM inference on a paged KV cache")
    add_option_flag(parser, ServeOptions, "log_level")  # one flag for every command; serve passes it on to uvicorn
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="answer one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_dataclass_args(generate, EngineConfig)
    add_dataclass_args(generate, SamplingFlags)
    generate.set_defaults(handler=run_generate)
    chat = commands.add_parser("chat", help="interactive chat, streamed")
    chat.add_argument("--system", default=None, help="system prompt", **Texts().flag_kwargs())
    add_dataclass_args(chat, EngineConfig)
    add_dataclass_args(chat, SamplingFlags)
    chat.set_defaults(max_tokens=512, handler=run_chat)  # 512: room for a conversational answer
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_dataclass_args(serve, ServeOptions, skip=("log_level",))
    add_dataclass_args(serve, EngineConfig)
    serve.set_defaults(handler=run_serve)
    worker = commands.add_parser(
        "worker", help="tensor-parallel ranks of one more node (the same engine flags as node 0, and --node-rank)"
    )
    add_dataclass_args(worker, EngineConfig)
    worker.set_defaults(handler=run_worker)
    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    bench_serve = benchmarks.add_parser("serve", help="load-test an OpenAI-compatible server (pagedllm's, vLLM's)")
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(handler=run_bench_serve)
    bench_soak = benchmarks.add_parser(
        "soak", help="a seeded mix of clients, some misbehaving, then checks the server is back at rest"
    )
    add_bench_soak_args(bench_soak)
    bench_soak.set_defaults(handler=run_bench_soak)
    bench_memory = benchmarks.add_parser("memory", help="KV memory utilization: paged vs contiguous allocators")
    add_bench_memory_args(bench_memory)
    bench_memory.set_defaults(handler=run_bench_memory)
    bench_throughput = benchmarks.add_parser(
        "throughput", help="offline throughput of one workload on pagedllm, transformers and vLLM"
    )
    add_bench_throughput_args(bench_throughput)
    bench_throughput.set_defaults(handler=run_bench_throughput)
    bench_embed = benchmarks.add_parser(
        "embed", help="embedding throughput of pagedllm and sentence-transformers by batch size, same weights"
    )
    add_bench_embed_args(bench_embed)
    bench_embed.set_defaults(handler=run_bench_embed)
    bench_flood = benchmarks.add_parser(
        "flood", help="a chat stream's time per token alone and beside a flood of embeddings, on one engine"
    )
    add_bench_flood_args(bench_flood)
    bench_flood.set_defaults(handler=run_bench_flood)
    bench_structured = benchmarks.add_parser(
        "structured", help="throughput with a JSON-schema constraint on every request vs none, same tokens"
    )
    add_bench_structured_args(bench_structured)
    bench_structured.set_defaults(handler=run_bench_structured)
    bench_accuracy = benchmarks.add_parser(
        "accuracy", help="KL divergence, perplexity and top-1 agreement of each precision path against float32"
    )
    add_bench_accuracy_args(bench_accuracy)
    bench_accuracy.set_defaults(handler=run_bench_accuracy)
    bench_speculative = benchmarks.add_parser(
        "speculative", help="TPOT of input-grounded requests one at a time, with and without speculative decoding"
    )
    add_bench_speculative_args(bench_speculative)
    bench_speculative.set_defaults(handler=run_bench_speculative)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedllm: error: {error}", file=sys.stderr)
        return 2
