"""Every quantized product of a GGUF model at several row counts: the blocks as stored (`quantized.matmul`, the
kernel the row count picks) against the dequantized, prepacked float32 copy (`QuantizedLinear.hold_dense`).

    python scripts/bench_model_products.py [--model FILE.gguf] [--rows 1 8 32 128 512] [--repeats 5]

Each pass multiplies random activations through every quantized layer but the LM head (30 layers x 4 products on
the default model); a 128 MB write before each pass evicts the weights and activations, as a step's attention
does in the engine. Prints the best pass of each, in milliseconds, as a markdown table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedllm import LLM
from pagedllm.models.default import default_model_file
from pagedllm.models.prepack import packed_linear
from pagedllm.models.quantized import QuantizedLinear, matmul

FLUSH_FLOATS = 32 << 20  # 128 MB, four times a large L3


def layers_of(model_path: str) -> list[QuantizedLinear]:
    llm = LLM(model=model_path, dtype="float32", dequantize=None, max_model_len=512, num_kv_blocks=64)
    model = llm.engine.worker.runner.model
    found = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not model.lm_head]
    if not found or any(layer.dense is None for layer in found):
        raise SystemExit("the model holds no quantized layers with dense copies here (see `pagedllm generate --help`)")
    return found


def on_the_blocks(layers: list[QuantizedLinear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        for part in layer.parts:
            matmul(inputs[layer.in_features], part)


def on_the_dense_copies(layers: list[QuantizedLinear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        packed_linear(inputs[layer.in_features], layer.dense)


def best_ms(run: Callable[[], None], repeats: int, flush: torch.Tensor) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        flush.add_(1.0)
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_file()))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layers = layers_of(args.model)
    flush = torch.zeros(FLUSH_FLOATS)
    print(f"{len(layers)} products, float32, best of {args.repeats} cold passes:\n")
    print("| rows | blocks (ms) | dense copy (ms) | blocks ÷ dense |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        inputs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}
        on_blocks = best_ms(lambda inputs=inputs: on_the_blocks(layers, inputs), args.repeats, flush)
        on_dense = best_ms(lambda inputs=inputs: on_the_dense_copies(layers, inputs), args.repeats, flush)
        print(f"| {rows} | {on_blocks:.1f} | {on_dense:.1f} | {on_blocks / on_dense:.2f} |")


if __name__ == "__main__":
    main()
