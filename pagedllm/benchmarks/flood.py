"""`pagedllm bench flood`: what a flood of embedding requests costs a chat stream on the same engine.

    pagedllm bench flood [--model M] [--num-documents 400] [--max-tokens 64] [--pooling-stretch 0.5] [--rounds 2]

One engine with task `generate,embed` (the chat model pools its last token: its embeddings) streams one greedy
chat reply of `--max-tokens` tokens alone ("idle"), then again with `--num-documents` distinct documents queued for
embedding the moment it starts ("flood"), round after round. TPOT is the mean time between the stream's tokens
after its first; the flood's embedding rate is the documents' prompt tokens pooled while the stream ran, per
second. The ratio flood / idle is what `pooling_stretch` bounds (1 + stretch): the scheduler gives pooling prompts
only the tokens that stretch a step with generation by that share of its time without them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedllm.config import DTypes, EngineConfig, add_option_flag
from pagedllm.domains import POSITIVE_INTS, ExistingPaths
from pagedllm.engine import LLMEngine
from pagedllm.entrypoints.llm import LLM, render_chat
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

CORPUS_TEXT = Path(__file__).with_name("data") / "accuracy_text.txt"
CHAT = "Tell me a long story about a lighthouse keeper and her cat."
_STREAM = "stream"


@dataclass(frozen=True, slots=True)
class StreamTiming:
    tpot_ms: float  # mean time between the stream's tokens after its first
    pooled_tokens_per_s: float  # prompt tokens of the flood pooled while the stream ran (0 when idle)


def documents(count: int) -> list[str]:
    """Distinct documents (numbered, so no two share a cached block), each one to three sentences of the shipped
    text."""
    sentences = [s.strip() for s in CORPUS_TEXT.read_text().split(". ") if s.strip()]
    return [
        f"Document {i}: " + ". ".join(sentences[(3 * i + j) % len(sentences)] for j in range(1 + i % 3))
        for i in range(count)
    ]


def time_stream(engine: LLMEngine, max_tokens: int, flood: list[str]) -> StreamTiming:
    """Stream one greedy reply, with `flood` queued for embedding at its start; the flood's leftovers are aborted."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(_STREAM, render_chat(engine.tokenizer, [{"role": "user", "content": CHAT}]), params)
    ids = [f"doc{i}" for i in range(len(flood))]
    for request_id, text in zip(ids, flood, strict=True):
        engine.add_request(request_id, text, PoolingParams(truncate_prompt_tokens=-1))  # a tiny model is short
    pooled_before = engine.stats().num_pooled_tokens
    stamps: list[float] = []
    while len(stamps) < max_tokens:
        for output in engine.step():
            if output.request_id == _STREAM:
                stamps.extend(time.perf_counter() for _ in range(len(output.outputs[0].token_ids) - len(stamps)))
    pooled = engine.stats().num_pooled_tokens - pooled_before
    for request_id in ids:
        engine.abort_request(request_id)
    gaps = stamps[-1] - stamps[0]
    return StreamTiming(1e3 * gaps / (len(stamps) - 1), pooled / (stamps[-1] - stamps[0]))


def add_bench_flood_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf (default: embedded)", **ExistingPaths().flag_kwargs()
    )
    parser.add_argument("--dtype", default="auto", **DTypes().flag_kwargs())
    add_option_flag(parser, EngineConfig, "pooling_stretch")
    parser.add_argument(
        "--num-documents", default=400, help="documents queued for embedding", **POSITIVE_INTS.flag_kwargs()
    )
    parser.add_argument("--max-tokens", default=64, help="the stream's reply", **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--rounds", default=2, help="idle and flood, in turn, this many times", **POSITIVE_INTS.flag_kwargs()
    )


def run_bench_flood(args: argparse.Namespace) -> int:
    llm = LLM(model=args.model, dtype=args.dtype, task="generate,embed", pooling_stretch=args.pooling_stretch)
    engine = llm.engine
    flood = documents(args.num_documents)
    time_stream(engine, 8, flood[:32])  # warm-up: both kinds of step, and the pace's first measurements
    print(f"pooling_stretch {args.pooling_stretch}; {len(flood)} documents queued at the stream's start")
    print(f"{'round':>5} {'idle TPOT ms':>13} {'flood TPOT ms':>14} {'flood/idle':>10} {'pooled tok/s':>13}")
    for round_ in range(args.rounds):
        idle = time_stream(engine, args.max_tokens, [])
        flooded = time_stream(engine, args.max_tokens, flood)
        ratio = flooded.tpot_ms / idle.tpot_ms
        rate = flooded.pooled_tokens_per_s
        print(f"{round_ + 1:>5} {idle.tpot_ms:>13.2f} {flooded.tpot_ms:>14.2f} {ratio:>9.2f}x {rate:>13.1f}")
        print(json.dumps({"round": round_ + 1, "idle": asdict(idle), "flood": asdict(flooded), "ratio": ratio}))
    return 0
