"""Micro-benchmark: pagedllm's SparseMoeBlock against transformers' own Qwen3-MoE block on the same weights.

Qwen3-MoE-shaped (hidden 512, 8 experts, top-2, moe intermediate 256 by default), bf16 and float32,
T tokens per call. Each round times `--iters` calls of each block, alternating; the table shows the best
round's time per call. "hf" is the block inside a transformers model, so it runs the experts path
`from_pretrained` models run (grouped_mm); "hf eager" is transformers' per-expert loop. pagedllm's block
is prepacked in bf16 (oneDNN blocked weights; "unpacked" is the same block without) and plain in float32.

    python scripts/bench_moe.py [--hidden 512 --experts 8 --top-k 2 --intermediate 256 --tokens 1,16,64,256]
"""

from __future__ import annotations

import argparse
import time

import torch


def hf_block(args: argparse.Namespace):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=args.hidden,
        intermediate_size=2 * args.intermediate,
        moe_intermediate_size=args.intermediate,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        mlp_only_layers=[],
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.normal_(0.0, 0.05)
    return model, model.model.layers[0].mlp


def best_per_call(fn, x: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per block per round (sets iters)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    from pagedllm.models.moe import SparseMoeBlock, moe_weights

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model, hf = hf_block(args)
    print(
        f"hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, intermediate {args.intermediate}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.rounds} rounds, us/call"
    )
    print(
        f"{'dtype':>8} {'T':>5} {'pagedllm':>10} {'unpacked':>10} {'hf':>10} {'hf eager':>10} "
        f"{'hf/ours':>8} {'eager/ours':>10}"
    )
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf.to(dtype)
        ours = SparseMoeBlock(args.hidden, args.intermediate, args.experts, args.top_k, True)
        ours.load_state_dict(moe_weights({f"mlp.{k}": v for k, v in hf.state_dict().items()}, "mlp.", args.experts))
        ours.to(dtype)
        plain = SparseMoeBlock(args.hidden, args.intermediate, args.experts, args.top_k, True)
        plain.load_state_dict(ours.state_dict())
        plain.to(dtype)
        ours.prepack()

        def run_hf(x, impl):
            model.config._experts_implementation = impl
            return hf(x[None])

        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden).to(dtype)
            fns = {
                "ours": ours,
                "plain": plain,
                "hf": lambda x: run_hf(x, "grouped_mm"),
                "eager": lambda x: run_hf(x, "eager"),
            }
            with torch.inference_mode():
                for fn in fns.values():
                    fn(x)  # warm-up
                per_call = best_per_call(ours, x, 3)
                iters = max(3, int(args.min_time / max(per_call, 1e-6)))
                best = {name: float("inf") for name in fns}
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        best[name] = min(best[name], best_per_call(fn, x, iters))
            us = {name: t * 1e6 for name, t in best.items()}
            print(
                f"{dtype_name:>8} {tokens:>5} {us['ours']:>10.1f} {us['plain']:>10.1f} "
                f"{us['hf']:>10.1f} {us['eager']:>10.1f} "
                f"{us['hf'] / us['ours']:>8.2f} {us['eager'] / us['ours']:>10.2f}"
            )


if __name__ == "__main__":
    main()
