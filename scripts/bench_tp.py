"""Tensor parallelism: output tok/s at several group sizes on one workload, and the share of rank 0's
step time spent in the collectives (all-reduce of partial sums, gather of logits, the step's inputs).

    python scripts/bench_tp.py --sizes 1,3                       # the default model (9 heads, 3 KV heads)
    python scripts/bench_tp.py --random-8-heads --sizes 1,2      # a random model of its size with 8 heads
    python scripts/bench_tp.py --device cuda --sizes 1,2,4,8     # on GPUs (NCCL)

Each size loads its own engine (its ranks started and stopped), warms up on a few requests, then runs the
seeded `synthetic` workload (greedy, EOS ignored).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import make_workload
from pagedllm.distributed import parallel
from pagedllm.models.loader import resolve_model_folder


class CollectiveTimer:
    """Wall time rank 0 spends inside each collective (the calls go through `parallel`'s functions)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        for name in ("all_reduce", "all_gather_last", "broadcast_from_first"):
            setattr(parallel, name, self._timed(name, getattr(parallel, name)))

    def _timed(self, name: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            return result

        return timed

    def reset(self) -> None:
        self.seconds.clear()


def random_eight_head_model(folder: Path) -> Path:
    """The default model's shape (30 layers, hidden 576, MLP 1536, vocab 49152) with 8 query and 2 KV
    heads, random weights, and the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    default = resolve_model_folder(None)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default / name).is_file():
            shutil.copy(default / name, folder / name)
    return folder


def run(model: Path | None, size: int, args: argparse.Namespace, timer: CollectiveTimer) -> dict[str, float]:
    llm = LLM(model=model, dtype=args.dtype, device=args.device, tensor_parallel_size=size, max_model_len=2048)
    workload = make_workload("synthetic", args.num_prompts, 49152, 2048, seed=0)
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in workload.requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload.requests]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, the same for every size
    timer.reset()
    steps_before = dict(llm.stats().step_seconds)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = {k: v - steps_before.get(k, 0.0) for k, v in llm.stats().step_seconds.items()}
    llm.engine.shutdown()
    collective = sum(timer.seconds.values())
    return {
        "size": size,
        "out_tok_s": workload.output_tokens / seconds,
        "seconds": seconds,
        "collective_share": collective / sum(steps.values()),
        **{f"{k}_s": v for k, v in timer.seconds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,3")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--random-8-heads", action="store_true", help="a random model of the default's size, 8 heads")
    args = parser.parse_args()
    timer = CollectiveTimer()
    with tempfile.TemporaryDirectory() as tmp:
        model = random_eight_head_model(Path(tmp)) if args.random_8_heads else None
        rows = [run(model, int(size), args, timer) for size in args.sizes.split(",")]
    print(f"{'TP':>3} {'out tok/s':>10} {'run s':>8} {'collectives':>12}  detail")
    for row in rows:
        detail = ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_s") and k != "out_tok_s")
        share = row["collective_share"]
        print(f"{row['size']:>3} {row['out_tok_s']:>10.1f} {row['seconds']:>8.1f} {share:>11.1%}  {detail}")


if __name__ == "__main__":
    main()
