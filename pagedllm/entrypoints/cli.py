"""`pagedllm generate|chat`: the command line over the same engine the `LLM` class uses."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator

from pagedllm.benchmarks.memory import add_bench_memory_args, run_bench_memory
from pagedllm.benchmarks.serve import add_bench_serve_args, run_bench_serve
from pagedllm.benchmarks.throughput import add_bench_throughput_args, run_bench_throughput
from pagedllm.entrypoints.llm import LLM, Message
from pagedllm.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached prompt blocks",
    )
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU swap space for preemption by swap")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None)


def build_llm(args: argparse.Namespace) -> LLM:
    return LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        device=args.device,
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
    )


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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not /health, /metrics)")
    parser.add_argument("--served-model-name", nargs="+", default=None, help="default: the --model argument")
    parser.add_argument(
        "--shutdown-grace", type=float, default=5.0, help="seconds in-flight requests get after SIGTERM"
    )
    # Test-only: a request whose decoded text contains this string fails inside the engine step.
    parser.add_argument("--fault-injection-text", default=None, help=argparse.SUPPRESS)


def run_serve(args: argparse.Namespace) -> int:
    # Imported here: the web stack costs start-up time that generate and chat need not pay.
    from pagedllm.entrypoints.openai_server import DEFAULT_SERVED_NAME, ServeOptions, serve

    names = args.served_model_name or [args.model or DEFAULT_SERVED_NAME]
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=tuple(names),
        shutdown_grace_s=args.shutdown_grace,
        fault_injection_text=args.fault_injection_text,
        log_level=args.log_level,
    )
    return serve(build_llm(args), options)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="answer one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(generate)
    add_sampling_args(generate, max_tokens=256)
    generate.set_defaults(handler=run_generate)
    chat = commands.add_parser("chat", help="interactive chat, streamed")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(handler=run_chat)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(handler=run_serve)
    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    bench_serve = benchmarks.add_parser("serve", help="load-test an OpenAI-compatible server (pagedllm's, vLLM's)")
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(handler=run_bench_serve)
    bench_memory = benchmarks.add_parser("memory", help="KV memory utilization: paged vs contiguous allocators")
    add_bench_memory_args(bench_memory)
    bench_memory.set_defaults(handler=run_bench_memory)
    bench_throughput = benchmarks.add_parser(
        "throughput", help="offline throughput of one workload on pagedllm, transformers and vLLM"
    )
    add_bench_throughput_args(bench_throughput)
    bench_throughput.set_defaults(handler=run_bench_throughput)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedllm: error: {error}", file=sys.stderr)
        return 2
