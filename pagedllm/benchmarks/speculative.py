"""`pagedllm bench speculative`: time per output token of input-grounded requests (the answer copies spans of
the prompt: typos corrected, sentences extracted, code with a small edit), one request at a time, with and without
speculative decoding, in turn in one process. Greedy, and in float32 both answers must be the same tokens; in bf16
a step's rounding depends on how many rows it has (some kernels change with the row count), so a near-tie may
go the other way, and the table says how many answers were identical.

    pagedllm bench speculative [--model M] [--dtype D] [--speculative-config JSON] [--rounds 2]
                               [--vllm-python .venv-vllm/bin/python]

With `--vllm-python`, vLLM (in its own interpreter, `vllm_speculative_runner.py`) times the same prompt tokens
without and with its own n-gram speculation under the same settings, after pagedllm's rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedllm.benchmarks.throughput import run_peer, vllm_env
from pagedllm.config import DTypes, EngineConfig, add_option_flag
from pagedllm.domains import POSITIVE_INTS, ExistingPaths
from pagedllm.entrypoints.llm import LLM, Message
from pagedllm.models.loader import resolve_model_folder
from pagedllm.sampling_params import SamplingParams

VLLM_RUNNER = Path(__file__).with_name("vllm_speculative_runner.py")
DEFAULT_SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

_PARAGRAPH = (
    "The paged attention algorithm stores the key and value cache in fixed size blocks. Each sequence has a block "
    "table that maps its logical blocks to physical blocks in a shared pool, so memory is allocated on demand and "
    "freed as soon as a request finishes. Blocks are reference counted, so parallel samples share their prompt."
)
_CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    centre = mean(values)
    return sum((value - centre) ** 2 for value in values) / len(values)
"""
TASKS = (
    "Correct the typos in this paragraph and repeat it:\n\n"
    + _PARAGRAPH.replace("the", "teh").replace("block", "blok"),
    "Extract the sentences that mention blocks from this text, word for word:\n\n" + _PARAGRAPH,
    "Rename the function `mean` to `average` everywhere in this code and show the whole code:\n\n" + _CODE,
    "Repeat this text exactly, in capital letters where it says 'pool':\n\n" + _PARAGRAPH,
)


@dataclass(frozen=True, slots=True)
class Timing:
    tpot_ms: float  # mean over the tasks of (time to the last token - time to the first) / (tokens - 1)
    output_tokens: int
    acceptance_rate: float
    mean_accepted_length: float


def time_tasks(llm: LLM, max_tokens: int) -> tuple[Timing, list[list[int]]]:
    """Each task alone: its first token (the prompt's step) timed apart, so TPOT is the decode steps only."""
    first = SamplingParams(temperature=0.0, max_tokens=1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tpots, outputs = [], []
    before = llm.stats()
    for task in TASKS:
        messages: list[Message] = [{"role": "user", "content": task}]
        llm.chat(messages, first, use_tqdm=False)  # warms the prompt's blocks the same way on both sides
        start = time.perf_counter()
        llm.chat(messages, first, use_tqdm=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        tokens = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
        elapsed = time.perf_counter() - start - prefill
        tpots.append(elapsed / max(len(tokens) - 1, 1) * 1e3)
        outputs.append(list(tokens))
    after = llm.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = after.spec_num_drafts - before.spec_num_drafts
    return Timing(
        tpot_ms=statistics.fmean(tpots),
        output_tokens=sum(len(tokens) for tokens in outputs),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=1 + accepted / drafts if drafts else 0.0,
    ), outputs


def add_bench_speculative_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf (default: embedded)", **ExistingPaths().flag_kwargs()
    )
    parser.add_argument("--dtype", default="auto", **DTypes().flag_kwargs())
    add_option_flag(parser, EngineConfig, "speculative_config")
    parser.set_defaults(speculative_config=DEFAULT_SPECULATIVE)
    parser.add_argument("--max-tokens", default=96, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--rounds", default=2, help="each side this many times, in turn", **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="also time vLLM's n-gram speculation on the same prompts (the python of a vLLM venv)",
        **ExistingPaths().flag_kwargs(),
    )


def run_bench_speculative(args: argparse.Namespace) -> int:
    engines = {
        "off": LLM(model=args.model, dtype=args.dtype),
        "on": LLM(model=args.model, dtype=args.dtype, speculative_config=args.speculative_config),
    }
    for llm in engines.values():
        time_tasks(llm, 8)  # warm-up: the same calls on both sides
    print(
        f"speculative_config: {json.dumps(args.speculative_config)}; {len(TASKS)} input-grounded tasks, one at a time"
    )
    header = ("round", "TPOT off ms", "TPOT on ms", "off/on", "acceptance", "mean accepted", "identical")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (5, 12, 11, 7, 11, 14, 9), strict=True)))
    for round_ in range(args.rounds):
        off, off_tokens = time_tasks(engines["off"], args.max_tokens)
        on, on_tokens = time_tasks(engines["on"], args.max_tokens)
        same = sum(a == b for a, b in zip(on_tokens, off_tokens, strict=True))
        if same < len(TASKS) and engines["on"].engine.config.torch_dtype == torch.float32:
            raise RuntimeError("float32 greedy output with speculation differs from the output without it")
        print(
            f"{round_ + 1:>5} {off.tpot_ms:>12.2f} {on.tpot_ms:>11.2f} {off.tpot_ms / on.tpot_ms:>6.2f}x "
            f"{on.acceptance_rate:>11.2f} {on.mean_accepted_length:>14.2f} {same:>6}/{len(TASKS)}"
        )
        print(json.dumps({"round": round_ + 1, "off": asdict(off), "on": asdict(on), "identical_outputs": same}))
    if args.vllm_python is not None:
        time_vllm(args, engines["off"], off_tokens)
    return 0


def time_vllm(args: argparse.Namespace, llm: LLM, pagedllm_tokens: list[list[int]]) -> None:
    """vLLM without, then with, its n-gram speculation (one process each), on the prompts' token ids."""
    settings = args.speculative_config
    if settings.get("method", "ngram") != "ngram" or "model" in settings:
        raise ValueError("--vllm-python compares n-gram speculation only")
    prompts = [llm.render_chat([{"role": "user", "content": task}])["prompt_token_ids"] for task in TASKS]
    dtype = llm.engine.config.torch_dtype
    job = {
        "model": str(resolve_model_folder(args.model)),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "max_model_len": 2048,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
    }
    sides = {}
    for side, config in (("off", None), ("on", {"method": "ngram", **settings})):
        sides[side] = run_peer(
            args.vllm_python, VLLM_RUNNER, job | {"speculative_config": config}, vllm_env(job["threads"])
        )
    for round_, (off, on) in enumerate(zip(sides["off"]["rounds"], sides["on"]["rounds"], strict=True)):
        same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))
        as_pagedllm = sum(a == b for a, b in zip(off["outputs"], pagedllm_tokens, strict=True))
        print(
            f"vLLM round {round_ + 1}: TPOT off {off['tpot_ms']:.2f} ms, on {on['tpot_ms']:.2f} ms "
            f"({off['tpot_ms'] / on['tpot_ms']:.2f}x), identical with/without {same}/{len(TASKS)}, "
            f"equal to pagedllm's {as_pagedllm}/{len(TASKS)}"
        )
    print(
        json.dumps(
            {
                "vllm": {
                    side: {"tpot_ms": [r["tpot_ms"] for r in result["rounds"]], "metrics": result["metrics"]}
                    for side, result in sides.items()
                }
            }
        )
    )
