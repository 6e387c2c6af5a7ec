"""`pagedllm bench structured`: what a JSON-schema constraint on every request costs in throughput.

    pagedllm bench structured --num-prompts 64 --rounds 2

One engine, one set of chat prompts asking for a JSON record. Each round runs the batch constrained by
the schema, then the same batch unconstrained with each sample's output length set to what its
constrained run produced (EOS ignored), so both runs generate exactly the same tokens per request and
differ only by the grammar's work: filling each constrained row's token mask, applying it, accepting the
token. Both sides are warmed the same way before the first round (one small batch each), and the cold
costs are reported apart: reading the tokenizer's vocabulary into xgrammar and compiling the schema.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.config import DTypes, resolve_dtype
from pagedllm.domains import POSITIVE_INTS, SEEDS, ExistingPaths, FolderPaths
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "level": {"enum": ["junior", "mid", "senior"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "skills", "level", "address"],
    "additionalProperties": False,
}
ROLES = ("a software engineer", "a nurse", "a chef", "a pilot", "a teacher", "a farmer", "a painter", "a lawyer")
CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Austin", "Pune", "Perth")


@dataclass(slots=True)
class Round:
    constrained_tok_per_s: float
    unconstrained_tok_per_s: float
    output_tokens: int
    constrained_sample_s: float  # time in the sampler (mask included) during the constrained run
    unconstrained_sample_s: float

    @property
    def slowdown(self) -> float:
        """How much slower the constrained run is, as a fraction (0.05 = 5% slower)."""
        return self.unconstrained_tok_per_s / self.constrained_tok_per_s - 1.0


def chat_prompts(count: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [
        [
            {
                "role": "user",
                "content": f"Invent {rng.choice(ROLES)} living in {rng.choice(CITIES)} and describe them as a JSON "
                "record with name, age, email, skills, level and address.",
            }
        ]
        for _ in range(count)
    ]


def _params(count: int, seed: int, max_tokens: int, structured: StructuredOutputsParams | None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.7, seed=seed + i, max_tokens=max_tokens, structured_outputs=structured)
        for i in range(count)
    ]


def _matched(lengths: list[int], seed: int) -> list[SamplingParams]:
    """Unconstrained twins of the constrained run: the same seeds, exactly its output lengths."""
    return [
        SamplingParams(temperature=0.7, seed=seed + i, max_tokens=length, ignore_eos=True)
        for i, length in enumerate(lengths)
    ]


def _timed(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[float, float, list[int]]:
    """Seconds, sampler seconds, and each request's output length."""
    sampled_before = llm.stats().step_seconds.get("sample", 0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    sampled = llm.stats().step_seconds.get("sample", 0.0) - sampled_before
    return seconds, sampled, [len(o.outputs[0].token_ids) for o in outputs]


def run_rounds(llm: LLM, num_prompts: int, rounds: int, max_tokens: int, seed: int) -> list[Round]:
    structured = StructuredOutputsParams(json=SCHEMA)
    prompts = [llm.render_chat(conversation) for conversation in chat_prompts(num_prompts, seed)]
    warm = min(4, num_prompts)
    _timed(llm, prompts[:warm], _params(warm, seed, max_tokens, structured))
    _timed(llm, prompts[:warm], _params(warm, seed, max_tokens, None))
    results = []
    for _ in range(rounds):
        seconds, sampled, lengths = _timed(llm, prompts, _params(num_prompts, seed, max_tokens, structured))
        plain_seconds, plain_sampled, plain_lengths = _timed(llm, prompts, _matched(lengths, seed))
        if plain_lengths != lengths:
            raise RuntimeError("the unconstrained run did not generate the constrained run's lengths")
        tokens = sum(lengths)
        results.append(Round(tokens / seconds, tokens / plain_seconds, tokens, sampled, plain_sampled))
    return results


def cold_costs(llm: LLM) -> dict[str, float]:
    """Seconds to read the vocabulary into xgrammar (once per engine) and to compile the schema (once per
    distinct schema; later requests find it in the cache)."""
    compiler = llm.engine.structured_outputs
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(regex="a"))  # reads the vocabulary; a trivial grammar
    vocabulary = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=SCHEMA))
    return {"vocabulary_s": vocabulary, "schema_compile_s": time.perf_counter() - start}


def add_bench_structured_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf (default: embedded SmolLM2-135M)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument("--dtype", default="auto", **DTypes().flag_kwargs())
    parser.add_argument("--threads", default=torch.get_num_threads(), **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--num-prompts", default=64, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--rounds", default=2, help="constrained/unconstrained pairs, run in turn", **POSITIVE_INTS.flag_kwargs()
    )
    parser.add_argument("--max-tokens", default=160, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--seed", default=0, **SEEDS.flag_kwargs())
    parser.add_argument("--out", default=None, help="folder for structured.json", **FolderPaths().flag_kwargs())


def run_bench_structured(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=resolve_dtype(args.dtype), seed=args.seed)
    cold = cold_costs(llm)
    rounds = run_rounds(llm, args.num_prompts, args.rounds, args.max_tokens, args.seed)
    print(format_report(args, cold, rounds))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"cold": cold, "rounds": [asdict(r) | {"slowdown": r.slowdown} for r in rounds]}
        (args.out / "structured.json").write_text(json.dumps(report, indent=2))
    return 0


def format_report(args: argparse.Namespace, cold: dict[str, float], rounds: list[Round]) -> str:
    lines = [
        f"{args.num_prompts} chat requests, JSON schema on every one vs none; {args.threads} threads",
        f"cold: vocabulary into xgrammar {cold['vocabulary_s']:.2f} s, schema compile {cold['schema_compile_s']:.3f} s",
        f"{'round':>5} {'tokens':>7} {'constrained tok/s':>18} {'plain tok/s':>12} {'slower':>7} "
        f"{'sampler s (c / p)':>18}",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"{i:>5} {r.output_tokens:>7} {r.constrained_tok_per_s:>18.1f} {r.unconstrained_tok_per_s:>12.1f} "
            f"{r.slowdown:>6.1%} {r.constrained_sample_s:>8.2f} / {r.unconstrained_sample_s:<8.2f}"
        )
    return "\n".join(lines)
