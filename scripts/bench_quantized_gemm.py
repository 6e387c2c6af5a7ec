"""Multiply-accumulates per second of one quantized matrix at several activation row counts: the packed integer
kernel against torch's bf16 GEMM on a dequantized copy. The machine's GEMM ceiling bounds what a batch can reach.

    python scripts/bench_quantized_gemm.py [--type Q4_0] [--shape 8192 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.models.quantized import QuantizedWeight, _tiled_product, library, matmul, pack, packs


def seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    call()
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048], metavar=("OUT", "IN"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_features, in_features = args.shape
    values = torch.randn(out_features, in_features) * 0.02
    kind = GGMLQuantizationType[args.type]
    weight = QuantizedWeight(kind, torch.from_numpy(quantize(values.numpy(), kind).copy()), in_features)
    quantized = pack(weight) if packs(weight, torch.bfloat16) else weight
    dense = weight.dequantize(torch.bfloat16)
    print(f"{args.type} {out_features}x{in_features}, {args.threads} threads; {type(quantized).__name__} kernel")
    for rows in args.rows:
        x = torch.randn(rows, in_features).bfloat16()
        repeats = max(3, 4096 // rows)
        quantized_s = seconds_per_call(lambda x=x: matmul(x, quantized), repeats)
        tiles_s = seconds_per_call(lambda x=x: _tiled_product(x, quantized, library()), repeats)
        dense_s = seconds_per_call(lambda x=x: torch.nn.functional.linear(x, dense), repeats)
        macs = rows * out_features * in_features / 1e9
        print(
            f"rows {rows:5d}: quantized {macs / quantized_s:6.1f}, dequantized tiles {macs / tiles_s:6.1f}, "
            f"bf16 F.linear on a copy {macs / dense_s:6.1f} GMAC/s"
        )


if __name__ == "__main__":
    main()
