"""A Qwen3-MoE-shaped model end to end: pagedllm against transformers, and where pagedllm's step time goes.

Builds (once, into --folder) a random Qwen3-MoE model with transformers: hidden 512, 8 experts, top-2,
expert intermediate 256, 4 layers, with the default model's tokenizer. Then runs
`pagedllm bench throughput` on it (pagedllm and transformers' static batches, same prompts), and one more
pagedllm run with timers around every mixture-of-experts block, to report the share of the forward pass
spent in the experts.

    python scripts/bench_moe_model.py [--folder /tmp/qwen3-moe-512] [--num-prompts 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch


def build(folder: Path) -> None:
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pagedllm.models.loader import resolve_model_folder

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_folder(None))
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def expert_share(folder: Path, num_prompts: int, dtype: str) -> tuple[float, float]:
    """Seconds in the forward passes and in the MoE blocks, over one offline run of the workload."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.workloads import make_workload
    from pagedllm.models.moe import SparseMoeBlock

    llm = LLM(model=folder, dtype=dtype)
    workload = make_workload("synthetic", num_prompts, llm.engine.vocab_size, 4096, 0)
    timer = _Timer()
    for module in llm.engine.loaded.model.modules():
        if isinstance(module, SparseMoeBlock):
            module.register_forward_pre_hook(timer.start)
            module.register_forward_hook(timer.stop)
    prompts = [list(request.prompt) for request in workload.requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in workload.requests]
    llm.generate(prompts, params, use_tqdm=False)
    return llm.stats().step_seconds["forward"], timer.total


class _Timer:
    """Forward hooks that add up the wall time of the modules they wrap."""

    def __init__(self) -> None:
        self.total = 0.0
        self._began = 0.0

    def start(self, *_: object) -> None:
        self._began = time.perf_counter()

    def stop(self, *_: object) -> None:
        self.total += time.perf_counter() - self._began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/qwen3-moe-512"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if not (args.folder / "config.json").is_file():
        build(args.folder)
    bench = [sys.executable, "-m", "pagedllm", "bench", "throughput", "--model", str(args.folder)]
    bench += ["--engines", "pagedllm,hf-static", "--num-prompts", str(args.num_prompts), "--dtype", args.dtype]
    subprocess.run(bench, check=True)
    forward, experts = expert_share(args.folder, args.num_prompts, args.dtype)
    share = f"{experts:.2f} s ({experts / forward:.0%})"
    print(f"pagedllm forward {forward:.2f} s, of which mixture-of-experts blocks {share}")


if __name__ == "__main__":
    main()
