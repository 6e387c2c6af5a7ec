"""Attention microbenchmark: what reading K/V through a block table costs, for decode, and the CPU
kernel against torch on the engine's own shapes.

    python scripts/bench_attention.py [--quick] [--json PATH]
    python scripts/bench_attention.py --engine [--json PATH]

`--engine` (CPU) times the default model's attention (SmolLM2-135M: 9 heads, 3 KV heads, head dim 64,
bf16, block size 16) on three shapes of a real run, each against what torch does for it:
- decode: 111 sequences of 290 tokens, one query token each, against the torch fallback path and
  contiguous SDPA. Every timed call attends over ENGINE_LAYERS layers' caches (about 200 MB, far beyond
  the 32 MB L3) and reports the time per layer, so K/V come from DRAM as they do in the engine;
- prompt: one 258-token prompt that is its whole context, against torch's fused causal SDPA (the path
  the engine took before the kernel handled prompts);
- chunk after prefix: 258 query tokens after 1790 cached ones, against the torch path (gather the
  blocks, batched matmul, mask, softmax).

On the CPU: the engine's `cpu` backend (the metadata built once, as the engine does per step, then the
per-layer call) against torch's `scaled_dot_product_attention` on the same K/V stored contiguously per sequence.
The contiguous baseline gives each KV head its group of query heads as query rows, the fastest
contiguous form (SDPA's `enable_gqa` is 3-7x slower here). The cost of paging is paged time / contiguous
time. That ratio also compares two different kernels, so the paged kernel is timed a second time with
each sequence's blocks in order in memory: paged_cpu / paged_cpu_blocks_in_order is the cost of the
scattered blocks alone. Implementations are timed in alternation and the best of each is kept, because
on a shared 2-core machine other processes only ever add time.

On CUDA the same grid compares the Triton kernels (decode v1 and v2) and FlashAttention's paged call
(`flash_attn_with_kvcache` with `block_table`, when installed) against contiguous SDPA, and reports the
bandwidth each achieves (K/V bytes read per second) as a fraction of the H200's 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionCall, AttentionMetadata, get_backend, paged_attention
from pagedllm.worker.cache_engine import stored_layout

H200_BYTES_PER_S = 4.8e12
FLASH_ATTN_PAGE = 256  # flash_attn_with_kvcache needs pages that are multiples of 256 tokens
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096)
QUICK_BATCHES = (1, 16, 64)
QUICK_CONTEXTS = (128, 1024)
CPU_ROUNDS = 15
ENGINE_ROUNDS = 30
ENGINE_LAYERS = 8  # 8 layers' caches (about 200 MB) outrun the 32 MB L3, as the engine's 30 layers do
# (paged, baseline) time ratios reported, where both ran.
RATIOS = (
    ("paged_cpu", "contiguous_sdpa"),
    ("paged_cpu", "paged_cpu_blocks_in_order"),
    ("triton_v1", "contiguous_sdpa"),
    ("triton_v2", "contiguous_sdpa"),
    ("flash_attn_paged", "contiguous_sdpa"),
)


@dataclass(frozen=True, slots=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(slots=True)
class Case:
    """One grid point: the same K/V paged (shuffled blocks) and contiguous `[B, H_kv, L, D]`."""

    query: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    k_contiguous: torch.Tensor
    v_contiguous: torch.Tensor
    scale: float

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_contiguous.numel() * self.k_contiguous.element_size()


@dataclass(slots=True)
class Row:
    device: str
    batch: int
    context: int
    ms: dict[str, float]
    paging_ratio: dict[str, float] = field(default_factory=dict)  # "paged / baseline": time ratio
    bandwidth_fraction: dict[str, float] = field(default_factory=dict)  # of the H200's peak, CUDA only


def make_case(shape: Shape, batch: int, context: int, block_size: int, device: str, seed: int = 0) -> Case:
    # Drawn where they are used: gigabytes of K/V drawn on the CPU would take longer than the benchmark.
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = stored_layout(torch.randn(cache_shape, generator=gen, device=device).to(shape.torch_dtype))
    v_cache = stored_layout(torch.randn(cache_shape, generator=gen, device=device).to(shape.torch_dtype))
    tables = torch.randperm(num_blocks, generator=gen, device=device)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device=device).to(shape.torch_dtype)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        positions = cache[tables.long()].reshape(batch, blocks_per_seq * block_size, shape.num_kv_heads, -1)
        return positions[:, :context].transpose(1, 2).contiguous()

    return Case(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        k_contiguous=contiguous(k_cache),
        v_contiguous=contiguous(v_cache),
        scale=shape.head_dim**-0.5,
    )


def contiguous_decode(case: Case) -> torch.Tensor:
    """Decode has no causal mask, so a KV head's query heads can be SDPA's query rows."""
    batch, num_heads, head_dim = case.query.shape
    num_kv_heads = case.k_contiguous.shape[1]
    grouped = case.query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, case.k_contiguous, case.v_contiguous, scale=case.scale)
    return out.reshape(batch, num_heads, head_dim)


def in_order(case: Case) -> Case:
    """The same K/V with each sequence's blocks laid out one after another, block table 0, 1, 2, ...: the
    paged kernel on contiguous memory, which isolates the cost of scattered blocks from the kernel's own."""
    order = case.block_tables.long().flatten()
    tables = torch.arange(order.numel(), dtype=torch.int32, device=order.device).view_as(case.block_tables)
    return Case(
        query=case.query,
        k_cache=case.k_cache[order],
        v_cache=case.v_cache[order],
        block_tables=tables,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
        k_contiguous=case.k_contiguous,
        v_contiguous=case.v_contiguous,
        scale=case.scale,
    )


def cpu_paged(case: Case, block_size: int) -> Callable[[], torch.Tensor]:
    metadata = AttentionMetadata.build(case.block_tables, case.seq_lens, case.query_start_loc, block_size, "cpu")
    attend = get_backend("cpu", "cpu")
    return lambda: attend(case.query, case.k_cache, case.v_cache, metadata, case.scale)


def cpu_candidates(case: Case, block_size: int) -> dict[str, Callable[[], torch.Tensor]]:
    return {
        "contiguous_sdpa": lambda: contiguous_decode(case),
        "paged_cpu": cpu_paged(case, block_size),
        "paged_cpu_blocks_in_order": cpu_paged(in_order(case), block_size),
    }


@dataclass(slots=True)
class EngineRow:
    case: str
    ms: dict[str, float]  # per call (per layer for decode)
    speedup: dict[str, float] = field(default_factory=dict)  # "baseline / paged_cpu": time ratio


def engine_decode(shape: Shape) -> EngineRow:
    layers = [make_case(shape, 111, 290, shape.block_size, "cpu", seed=layer) for layer in range(ENGINE_LAYERS)]
    metadata = [
        AttentionMetadata.build(c.block_tables, c.seq_lens, c.query_start_loc, shape.block_size, "cpu") for c in layers
    ]

    def paged(backend: str) -> Callable[[], torch.Tensor]:
        """The C kernel ("cpu") or the path machines without a compiler run ("torch")."""
        attend = get_backend(backend, "cpu")

        def run() -> torch.Tensor:
            for case, step in zip(layers, metadata, strict=True):
                out = attend(case.query, case.k_cache, case.v_cache, step, case.scale)
            return out

        return run

    def contiguous() -> torch.Tensor:
        for case in layers:
            out = contiguous_decode(case)
        return out

    candidates = {"paged_cpu": paged("cpu"), "paged_torch": paged("torch"), "contiguous_sdpa": contiguous}
    check_agreement(layers[-1], candidates)
    ms = {name: t / ENGINE_LAYERS for name, t in time_cpu(candidates, ENGINE_ROUNDS).items()}
    return EngineRow("decode 111 x 290 (per layer, cold)", ms)


def engine_prefill(shape: Shape, q_len: int, seq_len: int) -> EngineRow:
    """One sequence whose last `q_len` tokens are this step's queries; their K/V are already in the cache,
    as the engine writes them before attention."""
    case = make_case(shape, 1, seq_len, shape.block_size, "cpu")
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(q_len, shape.num_heads, shape.head_dim, generator=gen).to(shape.torch_dtype)
    starts = torch.tensor([0, q_len], dtype=torch.int32)
    metadata = AttentionMetadata.build(case.block_tables, case.seq_lens, starts, shape.block_size, "cpu")
    key = case.k_contiguous[0, :, seq_len - q_len :].transpose(0, 1)  # this step's K/V, [q_len, H_kv, D]
    value = case.v_contiguous[0, :, seq_len - q_len :].transpose(0, 1)

    def paged(backend: str) -> Callable[[], torch.Tensor]:
        attend = get_backend(backend, "cpu")
        return lambda: attend(query, case.k_cache, case.v_cache, metadata, case.scale)

    expected = paged_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, starts, case.scale, backend="reference"
    )
    if q_len == seq_len:
        name, baseline = f"prompt {q_len}", ("sdpa_causal", lambda: causal_sdpa(query, key, value, case.scale))
    else:
        name, baseline = f"chunk {q_len} after {seq_len - q_len}", ("paged_torch", paged("torch"))
    candidates = {"paged_cpu": paged("cpu"), baseline[0]: baseline[1]}
    for label, fn in candidates.items():
        if not torch.allclose(fn().float(), expected.float(), atol=2e-2, rtol=2e-2):
            raise AssertionError(f"{label} disagrees with the reference")
    return EngineRow(name, time_cpu(candidates, ENGINE_ROUNDS))


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's fused causal kernel, reached only with 4-D inputs."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def measure_engine_cases(shape: Shape) -> list[EngineRow]:
    rows = [engine_decode(shape), engine_prefill(shape, 258, 258), engine_prefill(shape, 258, 2048)]
    for row in rows:
        for name, t in row.ms.items():
            if name != "paged_cpu":
                row.speedup[f"{name} / paged_cpu"] = t / row.ms["paged_cpu"]
    return rows


def format_engine_table(rows: list[EngineRow]) -> str:
    lines = ["case | paged_cpu ms | baseline | baseline ms | baseline / paged_cpu", "--- | --- | --- | --- | ---"]
    for row in rows:
        for name, t in row.ms.items():
            if name != "paged_cpu":
                speedup = row.speedup[f"{name} / paged_cpu"]
                lines.append(f"{row.case} | {row.ms['paged_cpu']:.3f} | {name} | {t:.3f} | {speedup:.2f}x")
    return "\n".join(lines)


def report_engine_cases(shape: Shape, json_path: str | None) -> None:
    rows = measure_engine_cases(shape)
    print(f"engine shapes, cpu, {shape}, threads={torch.get_num_threads()}")
    print(format_engine_table(rows))
    if json_path:
        report = {"device": "cpu", "shape": asdict(shape), "threads": torch.get_num_threads()}
        report["engine"] = [asdict(row) for row in rows]
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)


def cuda_candidates(case: Case) -> dict[str, Callable[[], torch.Tensor]]:
    from pagedllm.attention import triton_ops

    block_size = case.k_cache.shape[1]
    metadata = AttentionMetadata.build(case.block_tables, case.seq_lens, case.query_start_loc, block_size, "cuda")
    call = AttentionCall(case.query, case.k_cache, case.v_cache, metadata, case.scale)

    def triton_decode(version: int) -> Callable[[], torch.Tensor]:
        return lambda: triton_ops.attend(call, version=version)

    return {
        "contiguous_sdpa": lambda: contiguous_decode(case),
        "triton_v1": triton_decode(1),
        "triton_v2": triton_decode(2),
    }


def flash_attn_decode(case: Case) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(
        case.query[:, None],
        case.k_cache,
        case.v_cache,
        cache_seqlens=case.seq_lens,
        block_table=case.block_tables,
        softmax_scale=case.scale,
    )
    return out[:, 0]


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def time_cpu(candidates: dict[str, Callable[[], torch.Tensor]], rounds: int = CPU_ROUNDS) -> dict[str, float]:
    """Best of `rounds` alternating runs, in milliseconds."""
    best = dict.fromkeys(candidates, float("inf"))
    for fn in candidates.values():
        fn()  # warm-up: page faults, the native kernel's build, thread pools
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def time_cuda(candidates: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    import triton.testing

    return {name: float(triton.testing.do_bench(fn)) for name, fn in candidates.items()}


def check_agreement(case: Case, candidates: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Every implementation must compute the same attention, or the timings compare different work."""
    expected = contiguous_decode(case).float()
    for name, fn in candidates.items():
        if not torch.allclose(fn().float(), expected, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"{name} disagrees with contiguous SDPA")


def measure(shape: Shape, batch: int, context: int, device: str) -> Row:
    case = make_case(shape, batch, context, shape.block_size, device)
    if device == "cpu":
        candidates = cpu_candidates(case, shape.block_size)
        check_agreement(case, candidates)
        ms = time_cpu(candidates)
    else:
        candidates = cuda_candidates(case)
        check_agreement(case, candidates)
        if flash_attn_available() and context % FLASH_ATTN_PAGE == 0:
            fa_case = make_case(shape, batch, context, FLASH_ATTN_PAGE, device)
            fa = {"flash_attn_paged": lambda: flash_attn_decode(fa_case)}
            check_agreement(fa_case, fa)
            candidates |= fa
        ms = time_cuda(candidates)
    row = Row(device, batch, context, ms)
    for paged, baseline in RATIOS:
        if paged in ms:
            row.paging_ratio[f"{paged} / {baseline}"] = ms[paged] / ms[baseline]
    if device == "cuda":
        row.bandwidth_fraction = {name: case.kv_bytes / (t * 1e-3) / H200_BYTES_PER_S for name, t in ms.items()}
    return row


def format_table(rows: list[Row]) -> str:
    """A markdown table; a cell is "-" where an implementation did not run (FlashAttention below one page)."""
    names = list(dict.fromkeys(name for row in rows for name in row.ms))
    ratios = list(dict.fromkeys(label for row in rows for label in row.paging_ratio))
    fractions = names if any(row.bandwidth_fraction for row in rows) else []
    header = ["batch", "context", *(f"{n} ms" for n in names), *ratios]
    header += [f"{n} of 4.8TB/s" for n in fractions]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for row in rows:
        cells = [str(row.batch), str(row.context), *(_cell(row.ms, n, "{:.3f}") for n in names)]
        cells += [_cell(row.paging_ratio, n, "{:.2f}") for n in ratios]
        cells += [_cell(row.bandwidth_fraction, n, "{:.0%}") for n in fractions]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _cell(values: dict[str, float], name: str, template: str) -> str:
    return template.format(values[name]) if name in values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--engine", action="store_true", help="the engine's decode and prefill shapes (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    # Defaults: the embedded model's attention (SmolLM2-135M: 9 heads, 3 KV heads, head dim 64).
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.block_size, args.dtype)
    if args.engine:
        report_engine_cases(shape, args.json)
        return
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    rows = [measure(shape, batch, context, args.device) for batch in batches for context in contexts]
    print(f"decode attention, {args.device}, {shape}, threads={torch.get_num_threads()}")
    print(format_table(rows))
    if args.json:
        report = {"device": args.device, "shape": asdict(shape), "threads": torch.get_num_threads()}
        report["rows"] = [asdict(row) for row in rows]
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
