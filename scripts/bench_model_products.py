"""Every quantized product of a GGUF model at several row counts, float32: the blocks as stored (`quantized.matmul`,
the float kernel the row count picks), the same weights packed for the int16 kernel where this CPU has it
(`quantized.pack`, AVX2), and the dequantized, prepacked float32 copy (`QuantizedLinear.hold_dense`).

    python scripts/bench_model_products.py [--model FILE.gguf] [--rows 1 8 32 128 512] [--repeats 5]

Each pass multiplies random activations through every quantized layer but the LM head (30 layers x 4 products on
the default model); a 128 MB write before each pass evicts the weights and activations, as a step's attention
does in the engine. The three run in turn within each repeat. Prints the best pass of each, in milliseconds, as a
markdown table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedllm import LLM
from pagedllm.models.default import default_model_file
from pagedllm.models.prepack import packed_linear
from pagedllm.models.quantized import (
    PackedWeight,
    QuantizedLinear,
    QuantizedWeight,
    has_integer_kernel,
    matmul,
    pack,
    packs,
)

FLUSH_FLOATS = 32 << 20  # 128 MB, four times a large L3


def layers_of(model_path: str) -> list[QuantizedLinear]:
    llm = LLM(
        model=model_path,
        dtype="float32",
        dequantize=None,
        int16_activations=False,
        max_model_len=512,
        num_kv_blocks=64,
    )
    model = llm.engine.worker.runner.model
    found = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not model.lm_head]
    if not found or any(layer.dense is None for layer in found):
        raise SystemExit("the model holds no quantized layers with dense copies here (see `pagedllm generate --help`)")
    return found


def packed_copies(layers: list[QuantizedLinear]) -> list[QuantizedWeight | PackedWeight]:
    """Each layer's parts packed for the float32 int16 kernel (a copy: the layers keep theirs), where it takes them."""
    parts = [part for layer in layers for part in layer.parts]
    copies = [QuantizedWeight(p.kind, p.data.clone(), p.in_features) for p in parts]
    return [pack(p) if packs(p, torch.float32) else p for p in copies]


def on_the_blocks(parts: list[QuantizedWeight | PackedWeight], inputs: dict[int, torch.Tensor]) -> None:
    for part in parts:
        matmul(inputs[part.in_features], part)


def on_the_dense_copies(layers: list[QuantizedLinear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        packed_linear(inputs[layer.in_features], layer.dense)


def timed_ms(run: Callable[[], None], flush: torch.Tensor) -> float:
    flush.add_(1.0)
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_file()))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layers = layers_of(args.model)
    blocks = [part for layer in layers for part in layer.parts]
    packed = packed_copies(layers) if has_integer_kernel(torch.float32) else None
    flush = torch.zeros(FLUSH_FLOATS)
    print(f"{len(blocks)} products, float32, best of {args.repeats} cold passes:\n")
    print("| rows | blocks (ms) | packed, int16 (ms) | dense copy (ms) | blocks ÷ dense | packed ÷ dense |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        inputs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}
        runs = {
            "blocks": lambda inputs=inputs: on_the_blocks(blocks, inputs),
            "dense": lambda inputs=inputs: on_the_dense_copies(layers, inputs),
        }
        if packed is not None:
            runs["packed"] = lambda inputs=inputs: on_the_blocks(packed, inputs)
        best = {name: float("inf") for name in runs}
        for run in runs.values():
            run()  # warm
        for _ in range(args.repeats):
            for name, run in runs.items():
                best[name] = min(best[name], timed_ms(run, flush))
        on_packed = f"{best['packed']:.1f}" if packed is not None else "—"
        ratio = f"{best['packed'] / best['dense']:.2f}" if packed is not None else "—"
        print(
            f"| {rows} | {best['blocks']:.1f} | {on_packed} | {best['dense']:.1f} | "
            f"{best['blocks'] / best['dense']:.2f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
