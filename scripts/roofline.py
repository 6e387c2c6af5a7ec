"""Where a prefill step and a decode step of the default model stand against this machine's limits.

`python scripts/roofline.py [--decode-seqs 64] [--prompt-len 256] [--repeats 5]` measures two peaks (a
GEMM in the engine's compute dtype through the same prepacked oneDNN call the model makes, and a streaming
read of 256 MB), then
times steps of the engine with every linear layer, attention call and K/V write wrapped in a wall clock:
achieved GFLOP/s of the GEMMs (2·rows·in·out per call), GB/s of attention (the K/V bytes of every
sequence's context, read once per layer), and the share of the step that is neither. Prints a markdown
table; the figures are medians over `--repeats` steps.

Then the floor of whole offline runs (`--floor-workloads`, those of `pagedllm bench throughput` at
`--num-prompts`, its defaults): prefill's GEMM and attention FLOPs at the GEMM peak, each decode step (every
request admitted at once) at the slower of its GEMM FLOPs and its read of all the weights, and every K/V
byte decode reads at the read peak. No engine runs a workload faster than its floor; 1.5x a measured run
needs that run's time / 1.5 to stay above it.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import pagedllm.attention.cpu as cpu_attention
import pagedllm.models.decoder as decoder
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import MAX_MODEL_LEN
from pagedllm.benchmarks.workloads import Workload, make_workload
from pagedllm.models.config import ModelConfig
from pagedllm.models.prepack import packed_linear, prepacked
from pagedllm.models.quantized import QuantizedLinear


@dataclass
class Tally:
    gemm_s: float = 0.0
    gemm_flop: float = 0.0
    attention_s: float = 0.0
    attention_bytes: float = 0.0
    write_kv_s: float = 0.0


@dataclass
class StepFigures:
    seconds: list[float] = field(default_factory=list)
    tallies: list[Tally] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)

    def measure(self, llm: LLM) -> None:
        """Run one step of `llm` and keep its figures."""
        seconds, tally, threads = one_step(llm)
        self.seconds.append(seconds)
        self.tallies.append(tally)
        self.threads.append(threads)


TALLY = Tally()


def timed(function: Callable, account: Callable[[float, tuple], None]) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        account(time.perf_counter() - started, args)
        return result

    return wrapper


def count_gemm(seconds: float, args: tuple) -> None:
    layer, x = args[0], args[1]
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    out_features, in_features = (
        (layer.out_features, layer.in_features) if isinstance(layer, QuantizedLinear) else layer.weight.shape
    )
    TALLY.gemm_s += seconds
    TALLY.gemm_flop += 2.0 * rows * out_features * in_features


def count_attention(seconds: float, args: tuple) -> None:
    call = args[0]
    context_tokens = int(call.metadata.seq_lens.sum())
    per_token = call.k_cache.shape[-2] * call.k_cache.shape[-1] * call.k_cache.element_size()  # heads x dim
    TALLY.attention_s += seconds
    TALLY.attention_bytes += 2.0 * context_tokens * per_token  # K and V


def count_write_kv(seconds: float, _: tuple) -> None:
    TALLY.write_kv_s += seconds


def instrument(llm: LLM) -> None:
    # The timers wrap the Python layers' calls; the lean loop (models/lean.py) calls the same kernels from C,
    # past them, so the instrumented steps take the layers (their "neither" includes the Python the loop saves).
    llm.engine.loaded.model.lean = None
    decoder.Linear.forward = timed(decoder.Linear.forward, count_gemm)
    QuantizedLinear.forward = timed(QuantizedLinear.forward, count_gemm)
    cpu_attention.attend = timed(cpu_attention.attend, count_attention)
    # Where the C kernel runs, the K/V write rides in the rotary pass: the column counts that pass whole.
    decoder.write_kv = timed(decoder.write_kv, count_write_kv)
    decoder.fused.rope_write_kv = timed(decoder.fused.rope_write_kv, count_write_kv)


def gemm_peak(dtype: torch.dtype) -> float:
    """GFLOP/s of a 2048 x 2048 x 2048 product in the engine's compute dtype (bf16, or float32 where the CPU
    lacks bf16 instructions) through the prepacked oneDNN call, best of 10."""
    x = torch.randn(2048, 2048, dtype=dtype)
    weight = prepacked(torch.randn(2048, 2048, dtype=dtype))
    best = float("inf")
    for _ in range(13):
        started = time.perf_counter()
        packed_linear(x, weight)
        best = min(best, time.perf_counter() - started)
    return 2.0 * 2048**3 / best / 1e9


def read_peak() -> float:
    """GB/s of summing 256 MB of float32, best of 10."""
    data = torch.ones(64 << 20)
    best = float("inf")
    for _ in range(12):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def one_step(llm: LLM) -> tuple[float, Tally, int]:
    """The step's time, its tally (later steps count into a tally nobody reads), and its thread count."""
    global TALLY
    TALLY = tally = Tally()
    started = time.perf_counter()
    llm.engine.step()
    seconds = time.perf_counter() - started
    TALLY = Tally()
    return seconds, tally, torch.get_num_threads()


def prefill_steps(llm: LLM, prompt_len: int, repeats: int, rng: random.Random) -> StepFigures:
    """Steps that prefill a full token budget of fresh prompts (no prefix-cache hits)."""
    figures = StepFigures()
    budget = llm.engine.scheduler.max_num_batched_tokens
    for _ in range(repeats):
        for i in range(budget // prompt_len):
            prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
            llm.engine.add_request(f"p{rng.random()}-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        figures.measure(llm)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return figures


def decode_steps(llm: LLM, num_seqs: int, prompt_len: int, repeats: int, rng: random.Random) -> StepFigures:
    """Decode steps of `num_seqs` sequences at about `prompt_len` tokens of context."""
    params = SamplingParams(max_tokens=repeats + 8, ignore_eos=True, temperature=0.0)
    for i in range(num_seqs):
        llm.engine.add_request(f"d{i}", [rng.randrange(1000, 40000) for _ in range(prompt_len)], params)
    while llm.engine.scheduler.stats(0, {}).num_waiting:  # every prompt prefilled
        llm.engine.step()
    for _ in range(4):  # the first decode steps of a batch teach the thread chooser its size
        llm.engine.step()
    figures = StepFigures()
    for _ in range(repeats):
        figures.measure(llm)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return figures


def row(name: str, figures: StepFigures, gemm_peak_gflops: float, read_peak_gbs: float) -> str:
    """The median step's figures. Attention's bandwidth means something for decode only: a prompt's attention
    is arithmetic on a short context, not a read of it."""
    median = figures.seconds.index(sorted(figures.seconds)[len(figures.seconds) // 2])
    step, pick = figures.seconds[median], figures.tallies[median]
    gemm_rate = pick.gemm_flop / pick.gemm_s / 1e9
    attention_rate = pick.attention_bytes / pick.attention_s / 1e9
    neither = step - pick.gemm_s - pick.attention_s - pick.write_kv_s
    return (
        f"| {name} | {figures.threads[median]} | {step * 1e3:.1f} ms | {pick.gemm_s * 1e3:.1f} ms, "
        f"{gemm_rate:.0f} GFLOP/s ({100 * gemm_rate / gemm_peak_gflops:.0f}% of peak) | "
        f"{pick.attention_s * 1e3:.1f} ms, {attention_rate:.1f} GB/s ({100 * attention_rate / read_peak_gbs:.0f}% "
        f"of peak) | {pick.write_kv_s * 1e3:.1f} ms | {neither * 1e3:.1f} ms ({100 * neither / step:.0f}%) |"
    )


@dataclass(frozen=True)
class RunFloor:
    prefill_flop: float  # prompts through every linear layer, their last token through the LM head, attention
    decode_steps: tuple[int, ...]  # rows of each decode step, every request admitted at once
    flop_per_row: float  # a decoded token through every linear layer and the LM head
    weight_bytes: float  # what every decode step reads, however few its rows
    kv_bytes: float  # what decode reads: each new token's whole context, every layer, K and V

    def seconds(self, gemm_peak_gflops: float, read_peak_gbs: float) -> float:
        """Prefill at the GEMM peak; each decode step at the slower of its arithmetic and its weight read;
        decode's K/V reads at the read peak."""
        gemm, read = gemm_peak_gflops * 1e9, read_peak_gbs * 1e9
        decode = sum(max(rows * self.flop_per_row / gemm, self.weight_bytes / read) for rows in self.decode_steps)
        return self.prefill_flop / gemm + decode + self.kv_bytes / read


def run_floor(workload: Workload, config: ModelConfig, linear_params: int, element_size: int) -> RunFloor:
    """The arithmetic and the memory traffic of `workload` (greedy, one sequence a request): a prompt's
    tokens go through every linear layer and its last one through the LM head (`vocab x hidden`), with
    causal attention over the prompt; each later output token goes through both and reads its context."""
    head_params = config.vocab_size * config.hidden_size
    layers, dim = config.num_hidden_layers, config.head_dim
    kv_per_position = 2 * layers * config.num_key_value_heads * dim * element_size
    prefill = kv = 0.0
    decoded = [request.output_len - 1 for request in workload.requests]
    for request, count in zip(workload.requests, decoded, strict=True):
        prompt = len(request.prompt)
        prefill += 2.0 * (prompt * linear_params + head_params)
        prefill += 4.0 * layers * config.num_attention_heads * dim * prompt * (prompt + 1) / 2
        kv += kv_per_position * (count * prompt + count * (count + 1) / 2)  # token j sees prompt + j positions
    steps = tuple(sum(count >= step for count in decoded) for step in range(1, max(decoded, default=0) + 1))
    return RunFloor(
        prefill, steps, 2.0 * (linear_params + head_params), (linear_params + head_params) * element_size, kv
    )


def print_floors(llm: LLM, names: list[str], num_prompts: int, gemm_peak_gflops: float, read_peak_gbs: float) -> None:
    model = llm.engine.worker.runner.model
    config = model.config
    linear_params = sum(
        module.in_features * module.out_features if isinstance(module, QuantizedLinear) else module.weight.numel()
        for module in model.modules()
        if isinstance(module, decoder.Linear | QuantizedLinear) and module is not model.lm_head
    )
    element_size = torch.empty((), dtype=llm.engine.config.torch_dtype).element_size()
    print(f"\n| workload (N={num_prompts}) | prefill TFLOP | decode steps | decode TFLOP | decode K/V GB | floor |")
    print("|---|---|---|---|---|---|")
    max_model_len = min(MAX_MODEL_LEN, config.max_position_embeddings)  # as `bench throughput` bounds them
    for name in names:
        workload = make_workload(name, num_prompts, config.vocab_size, max_model_len)
        floor = run_floor(workload, config, linear_params, element_size)
        decode_flop = sum(floor.decode_steps) * floor.flop_per_row
        print(
            f"| {name} | {floor.prefill_flop / 1e12:.2f} | {len(floor.decode_steps)} | {decode_flop / 1e12:.2f} | "
            f"{floor.kv_bytes / 1e9:.1f} | {floor.seconds(gemm_peak_gflops, read_peak_gbs):.1f} s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--floor-workloads", default="synthetic,sharegpt-like")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument(
        "--dequantize",
        action=argparse.BooleanOptionalAction,
        help="the GGUF's weights in the compute dtype (the peers' precision) or as stored (default: the engine's "
        "choice)",
    )
    args = parser.parse_args()
    llm = LLM(dequantize=args.dequantize)
    dtype = llm.engine.config.torch_dtype
    gemm_peak_gflops, read_peak_gbs = gemm_peak(dtype), read_peak()
    instrument(llm)
    rng = random.Random(0)
    prefill = prefill_steps(llm, args.prompt_len, args.repeats, rng)
    decode = decode_steps(llm, args.decode_seqs, args.prompt_len, args.repeats, rng)
    print(f"peaks: {dtype} GEMM {gemm_peak_gflops:.0f} GFLOP/s (prepacked 2048³), read {read_peak_gbs:.1f} GB/s")
    print(f"dtype: {dtype}; threads: as the engine chose for the step")
    print("| step | threads | time | GEMMs | attention | write_kv (with rope) | neither |")
    print("|---|---|---|---|---|---|---|")
    budget = llm.engine.scheduler.max_num_batched_tokens
    print(row(f"prefill, {budget} prompt tokens", prefill, gemm_peak_gflops, read_peak_gbs))
    print(
        row(
            f"decode, {args.decode_seqs} sequences at ~{args.prompt_len} tokens",
            decode,
            gemm_peak_gflops,
            read_peak_gbs,
        )
    )
    names = [name for name in args.floor_workloads.split(",") if name]
    print_floors(llm, names, args.num_prompts, gemm_peak_gflops, read_peak_gbs)


if __name__ == "__main__":
    main()
