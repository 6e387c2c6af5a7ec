"""Offline throughput: pagedllm vs `transformers` generate in static batches, same workload, same process.

    python benchmarks/throughput.py --num-prompts 64

The workload is seeded: prompt lengths uniform in [32, 512], output lengths uniform in [16, 256],
random token ids, greedy, EOS ignored, so both engines produce exactly the requested tokens.
The static baseline pads each batch on the left and runs it to its longest output; only the tokens
each request asked for count as output.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm import LLM, SamplingParams


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class Result:
    engine: str
    seconds: float
    requests_per_s: float
    output_tok_per_s: float
    total_tok_per_s: float


def synthetic(num_prompts: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(num_prompts)]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(num_prompts)])


def result(engine: str, seconds: float, workload: Workload) -> Result:
    n = len(workload.prompts)
    return Result(
        engine,
        seconds,
        n / seconds,
        workload.output_tokens / seconds,
        (workload.prompt_tokens + workload.output_tokens) / seconds,
    )


def run_pagedllm(llm: LLM, workload: Workload) -> tuple[Result, dict]:
    engine = llm.engine
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    utilization: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        utilization.append(engine.stats().kv_utilization)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    detail = {
        "mean_kv_utilization": sum(utilization) / len(utilization),
        "peak_blocks": stats.kv_blocks_peak,
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "step_seconds": stats.step_seconds,
    }
    return result("pagedllm", seconds, workload), detail


def run_hf_static(folder: str, dtype: torch.dtype, device: str, workload: Workload, batch_size: int) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        longest_output = max(workload.output_lens[first : first + batch_size])
        ids, mask = left_pad(prompts)
        with torch.inference_mode():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest_output,
                min_new_tokens=longest_output,
                do_sample=False,
                pad_token_id=0,
            )
    return result("hf-static", time.perf_counter() - start, workload)


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    workload = synthetic(args.num_prompts, llm.engine.vocab_size, args.seed)
    paged, detail = run_pagedllm(llm, workload)
    results = [paged]
    if not args.skip_hf:
        dtype = llm.engine.config.torch_dtype
        results.append(run_hf_static(str(llm.engine.loaded.folder), dtype, args.device, workload, args.hf_batch_size))
    report(results, detail, args)


def report(results: list[Result], detail: dict, args: argparse.Namespace) -> None:
    paged = results[0]
    print(f"{args.num_prompts} requests, {args.threads} threads, dtype {args.dtype}")
    print(f"{'engine':<10} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'seconds':>8} {'pagedllm ×':>11}")
    for r in results:
        ratio = paged.total_tok_per_s / r.total_tok_per_s
        print(
            f"{r.engine:<10} {r.requests_per_s:>8.3f} {r.output_tok_per_s:>10.1f} {r.total_tok_per_s:>12.1f} "
            f"{r.seconds:>8.1f} {ratio:>10.2f}×"
        )
    print(
        f"pagedllm: mean η {detail['mean_kv_utilization']:.3f}, peak blocks {detail['peak_blocks']}, "
        f"{detail['steps']} steps, {detail['preemptions']} preemptions"
    )
    total = sum(detail["step_seconds"].values())
    shares = ", ".join(f"{k} {v / total:.1%}" for k, v in detail["step_seconds"].items())
    print(f"pagedllm step time: {total / detail['steps'] * 1000:.1f} ms/step ({shares})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [asdict(r) for r in results], "pagedllm": detail, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
