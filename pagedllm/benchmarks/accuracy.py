"""`pagedllm bench accuracy`: how far each precision path is from float32, in next-token distributions.

    pagedllm bench accuracy [--model M] [--configs pagedllm-float32,pagedllm-bfloat16,transformers-bfloat16]

In the manner of llama.cpp's `llama-perplexity --kl-divergence`: a fixed text (public-domain prose shipped
in `data/accuracy_text.txt`, or `--text`) is cut into windows of `--window` tokens and teacher-forced
through every configuration and through the reference, `transformers` in float32 on the same weights.
Per configuration: perplexity of the text, its difference from the reference's, the mean and 99th
percentile of KL(reference || configuration) over every scored position, and top-1 agreement (the share
of positions where both put the same token first).

Each window's first half is one prompt step and its second half is fed one token per step, as generation
does, so both the prompt path (prefill attention tiles) and the decode path (decode kernel, one row per
sequence) are measured; the table gives the mean KL of each half too. The windows run together, as
concurrent sequences of one batch. pagedllm's configurations run on a fresh engine whose model runner
this harness steps directly over the engine's paged KV tensors (the scheduler cannot force the text's
tokens); `transformers` decodes its second halves with its own KV cache.

The oracle of a reduced precision (issue 25): pagedllm's mean KL at most `KL_RATIO` times the peer's
(`transformers` in the same dtype), and its top-1 agreement not worse than the peer's by more than
`TOP1_SLACK` unless the gap is within noise: positions where only pagedllm misses minus positions where only
the peer misses, at most `TOP1_Z` standard errors of that paired difference (McNemar). A top-1 miss is mostly
a near-tie flipped by rounding, so on a few hundred positions half a point is two or three coin flips.

An int8 KV cache (`kv_cache_dtype="int8"`) is judged against its `base`, the same configuration with the
model-dtype cache: its perplexity at most `BASE_PERPLEXITY_RATIO` times the base's (issue 26: int8 KV adds
under 0.5% perplexity).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from pagedllm.attention import cpu
from pagedllm.config import EngineConfig
from pagedllm.domains import INT32_MAX, POSITIVE_INTS, Choices, CommaLists, ExistingPaths, FilePaths, Integers
from pagedllm.entrypoints.llm import LLM
from pagedllm.models.loader import resolve_model_folder
from pagedllm.worker.model_runner import FlatBatch

TEXT = Path(__file__).with_name("data") / "accuracy_text.txt"
KL_RATIO = 1.1
TOP1_SLACK = 0.005
TOP1_Z = 2.0
BASE_PERPLEXITY_RATIO = 1.005
REFERENCE = "transformers-float32"
_BLOCK_SIZE = next(f.default for f in fields(EngineConfig) if f.name == "block_size")


@dataclass(frozen=True, slots=True)
class Configuration:
    """One path to measure: an engine, a dtype and, for pagedllm, any further engine options; `peer`, the
    configuration whose distance from float32 this one's must not exceed (the oracle), where there is one;
    `base`, the configuration this one differs from in its KV cache only, whose perplexity bounds its own."""

    name: str
    engine: str  # "pagedllm" or "transformers"
    dtype: torch.dtype
    options: dict[str, object] = field(default_factory=dict)
    peer: str | None = None
    base: str | None = None


CONFIGURATIONS = {
    c.name: c
    for c in (
        # Where int16 kernels take a float32 model's quantized layers (AVX2), they quantize its activations.
        Configuration("pagedllm-float32", "pagedllm", torch.float32, peer="transformers-bfloat16"),
        Configuration("pagedllm-float32-float-activations", "pagedllm", torch.float32, {"int16_activations": False}),
        Configuration("pagedllm-bfloat16", "pagedllm", torch.bfloat16, peer="transformers-bfloat16"),
        # A GGUF file's weights dequantized at load, as before they stayed quantized (issue 26).
        Configuration(
            "pagedllm-dequantized-bfloat16", "pagedllm", torch.bfloat16, {"dequantize": True}, "transformers-bfloat16"
        ),
        # Weights quantized at load: their peers are other engines' files of those types (llama.cpp's
        # `llama-perplexity --kl-divergence`), outside this command.
        Configuration("pagedllm-int8-bfloat16", "pagedllm", torch.bfloat16, {"quantization": "int8"}),
        Configuration("pagedllm-int4-bfloat16", "pagedllm", torch.bfloat16, {"quantization": "int4"}),
        Configuration(
            "pagedllm-kv-int8-float32", "pagedllm", torch.float32, {"kv_cache_dtype": "int8"}, base="pagedllm-float32"
        ),
        Configuration(
            "pagedllm-kv-int8-bfloat16",
            "pagedllm",
            torch.bfloat16,
            {"kv_cache_dtype": "int8"},
            base="pagedllm-bfloat16",
        ),
        Configuration("transformers-bfloat16", "transformers", torch.bfloat16),
        Configuration(REFERENCE, "transformers", torch.float32),
    )
}
DEFAULT_CONFIGS = ("pagedllm-float32", "pagedllm-bfloat16", "transformers-bfloat16")


@dataclass(frozen=True, slots=True)
class Text:
    """The teacher-forced windows: `len(windows)` rows of `width` token ids; positions below `split` are one
    prompt step, the rest are decoded one at a time. Position p's distribution is scored against token p + 1."""

    windows: torch.Tensor  # [windows, width] int64
    split: int

    @property
    def width(self) -> int:
        return self.windows.shape[1]


@dataclass(slots=True)
class Row:
    config: str
    perplexity: float
    delta_perplexity: float
    mean_kl: float
    p99_kl: float
    top1_agreement: float  # a share, 0..1
    mean_kl_prompt: float
    mean_kl_decode: float
    seconds: float
    agrees: torch.Tensor = field(repr=False)  # bool per scored position: top-1 equals the reference's

    def summary(self) -> dict[str, float | str]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "agrees"}


@dataclass(slots=True)
class Verdict:
    """The oracle for one reduced-precision pagedllm configuration against its `transformers` peer."""

    config: str
    peer: str
    kl_ratio: float
    top1_difference: float  # pagedllm's minus the peer's, a share
    top1_losses: int  # positions where only pagedllm's top-1 differs from the reference's
    top1_wins: int  # positions where only the peer's does

    @property
    def top1_z(self) -> float:
        """The paired difference in standard errors; positive when pagedllm misses more."""
        flips = self.top1_losses + self.top1_wins
        return (self.top1_losses - self.top1_wins) / math.sqrt(flips) if flips else 0.0

    @property
    def passed(self) -> bool:
        top1 = self.top1_difference >= -TOP1_SLACK or self.top1_z <= TOP1_Z
        return self.kl_ratio <= KL_RATIO and top1


@dataclass(frozen=True, slots=True)
class BaseVerdict:
    """A KV-cache variant's perplexity against its base configuration's."""

    config: str
    base: str
    perplexity_ratio: float

    @property
    def passed(self) -> bool:
        return self.perplexity_ratio <= BASE_PERPLEXITY_RATIO


def load_text(tokenizer, path: Path, width: int, max_windows: int | None) -> Text:
    """The text's tokens in whole windows of `width` (a BOS first in each, where the tokenizer adds one)."""
    ids = tokenizer(path.read_text(), add_special_tokens=False).input_ids
    bos = [tokenizer.bos_token_id] if _adds_bos(tokenizer) else []
    body = width - len(bos)
    count = len(ids) // body if max_windows is None else min(max_windows, len(ids) // body)
    if width < 4 or count == 0:
        raise ValueError(f"window: {width} tokens leaves no whole window of a {len(ids)}-token text")
    windows = [bos + ids[i * body : (i + 1) * body] for i in range(count)]
    return Text(torch.tensor(windows, dtype=torch.long), split=width // 2)


def _adds_bos(tokenizer) -> bool:
    return tokenizer.bos_token_id is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]


# ---- the configurations' log-probabilities ------------------------------------------------------


def transformers_logprobs(folder: Path, dtype: torch.dtype, text: Text, whole: bool = False) -> torch.Tensor:
    """`[windows, width - 1, vocab]` float32 log-probabilities from `transformers`: the first halves in one
    forward pass, then one token at a time on its KV cache; `whole`: every position in one pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    split = text.width - 1 if whole else text.split
    with torch.inference_mode():
        out = model(text.windows[:, :split], use_cache=not whole)
        pieces = [out.logits.float().log_softmax(-1)]
        cache = out.past_key_values
        for p in range(split, text.width - 1):
            out = model(text.windows[:, p : p + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            pieces.append(out.logits.float().log_softmax(-1))
    return torch.cat(pieces, dim=1)


def pagedllm_logprobs(model: str | Path | None, config: Configuration, text: Text) -> torch.Tensor:
    """The same from a fresh pagedllm engine on `model` as the user named it (a GGUF file runs on its
    quantized weights): its model runner stepped over the engine's KV pool, each window a sequence with
    blocks of its own."""
    count, width = text.windows.shape
    block_size = int(config.options.get("block_size", _BLOCK_SIZE))
    per_window = -(-width // block_size)
    options = {"num_kv_blocks": count * per_window, "max_model_len": width} | config.options
    llm = LLM(model=model, dtype=config.dtype, **options)
    runner = llm.engine.worker.runner
    tables = torch.arange(count * per_window, dtype=torch.int32).view(count, per_window)
    pieces = [_step(runner, text, tables, 0, text.split)]
    pieces += [_step(runner, text, tables, p, p + 1) for p in range(text.split, width - 1)]
    return torch.cat(pieces, dim=1)


def _step(runner, text: Text, tables: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions `start .. end` of every window as one flat batch; their log-probs `[windows, end - start, vocab]`."""
    count, size = len(text.windows), end - start
    positions = torch.arange(start, end).repeat(count)
    rows = torch.arange(count).repeat_interleave(size)
    blocks = tables[rows, positions // runner.block_size].long()
    batch = FlatBatch(
        input_ids=text.windows[:, start:end].reshape(-1),
        positions=positions,
        slot_mapping=blocks * runner.block_size + positions % runner.block_size,
        block_tables=tables,
        seq_lens=torch.full((count,), end, dtype=torch.int32),
        query_start_loc=torch.arange(0, count * size + 1, size, dtype=torch.int32),
        logits_index=torch.arange(count * size),
        prompt=None,
    )
    logits = runner.run(batch).logits
    return logits.log_softmax(-1).view(count, size, -1)


# ---- statistics ---------------------------------------------------------------------------------


def score(name: str, reference: torch.Tensor, logprobs: torch.Tensor, text: Text, seconds: float) -> Row:
    """One configuration's row against the reference's log-probabilities (both `[windows, width - 1, vocab]`)."""
    targets = text.windows[:, 1:]
    kl = (reference.exp() * (reference - logprobs)).sum(-1)  # [windows, width - 1]
    nll = -logprobs.gather(-1, targets[..., None])[..., 0]
    reference_nll = -reference.gather(-1, targets[..., None])[..., 0]
    perplexity = math.exp(nll.double().mean().item())
    flat = kl.double().flatten()
    agrees = logprobs.argmax(-1) == reference.argmax(-1)
    return Row(
        config=name,
        perplexity=perplexity,
        delta_perplexity=perplexity - math.exp(reference_nll.double().mean().item()),
        mean_kl=flat.mean().item(),
        p99_kl=torch.quantile(flat, 0.99).item(),
        top1_agreement=agrees.double().mean().item(),
        mean_kl_prompt=kl[:, : text.split].double().mean().item(),
        mean_kl_decode=kl[:, text.split :].double().mean().item(),
        seconds=seconds,
        agrees=agrees.flatten(),
    )


def _paired(rows: list[Row], role: str) -> list[tuple[Row, Row]]:
    """Each row with the row of the configuration its configuration names as `role` ("peer", "base"), where
    both ran."""
    by_name = {row.config: row for row in rows}
    pairs = []
    for row in rows:
        config = CONFIGURATIONS.get(row.config)
        other = by_name.get(getattr(config, role)) if config is not None else None
        if other is not None:
            pairs.append((row, other))
    return pairs


def verdicts(rows: list[Row]) -> list[Verdict]:
    """Each row whose configuration has a peer judged against the peer's row, where both ran."""
    found = []
    for row, peer in _paired(rows, "peer"):
        ratio = row.mean_kl / peer.mean_kl if peer.mean_kl > 0 else math.inf
        losses = int((peer.agrees & ~row.agrees).sum())
        wins = int((row.agrees & ~peer.agrees).sum())
        difference = row.top1_agreement - peer.top1_agreement
        found.append(Verdict(row.config, peer.config, ratio, difference, losses, wins))
    return found


def base_verdicts(rows: list[Row]) -> list[BaseVerdict]:
    """Each row whose configuration has a base judged against the base's row, where both ran."""
    pairs = _paired(rows, "base")
    return [BaseVerdict(row.config, base.config, row.perplexity / base.perplexity) for row, base in pairs]


def run_accuracy(model: str | Path | None, names: list[str], text: Text) -> list[Row]:
    """The reference row first, then one row per configuration, in the order asked. `transformers` reads
    the model's folder (a GGUF file's weights dequantized to float32)."""
    folder = resolve_model_folder(model)
    started = time.perf_counter()
    reference = transformers_logprobs(folder, torch.float32, text, whole=True)
    rows = [score(REFERENCE, reference, reference, text, time.perf_counter() - started)]
    for name in names:
        config = CONFIGURATIONS[name]
        started = time.perf_counter()
        if config.engine == "pagedllm":
            # Quantizing at load starts from the folder's float weights (a GGUF file's own quantized
            # tensors would be kept as they are).
            source = folder if "quantization" in config.options else model
            logprobs = pagedllm_logprobs(source, config, text)
        else:
            logprobs = transformers_logprobs(folder, config.dtype, text)
        rows.append(score(name, reference, logprobs, text, time.perf_counter() - started))
        del logprobs
        gc.collect()  # one configuration's model and cache go before the next loads
    return rows


# ---- the command --------------------------------------------------------------------------------


def add_bench_accuracy_args(parser: argparse.ArgumentParser) -> None:
    measured = [n for n in CONFIGURATIONS if n != REFERENCE]
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf (default: embedded SmolLM2-135M)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated, from {','.join(measured)} (the reference runs always)",
        **CommaLists(Choices(tuple(measured))).flag_kwargs(),
    )
    parser.add_argument(
        "--text", default=TEXT, help="a UTF-8 text file (default: the shipped prose)", **ExistingPaths().flag_kwargs()
    )
    parser.add_argument("--window", default=512, help="tokens per window", **Integers(4, INT32_MAX).flag_kwargs())
    parser.add_argument(
        "--max-windows", default=None, help="use at most this many windows", **POSITIVE_INTS.flag_kwargs()
    )
    parser.add_argument("--threads", default=torch.get_num_threads(), **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--out", default=None, help="write the rows as JSON to this file", **FilePaths().flag_kwargs())


def run_bench_accuracy(args: argparse.Namespace) -> int:
    names = list(args.configs)
    torch.set_num_threads(args.threads)
    folder = resolve_model_folder(args.model)
    from transformers import AutoTokenizer

    text = load_text(AutoTokenizer.from_pretrained(folder), args.text, args.window, args.max_windows)
    rows = run_accuracy(args.model, names, text)
    found, against_base = verdicts(rows), base_verdicts(rows)
    print(format_table(rows, found, text, args.threads))
    for b in against_base:
        print(
            f"{b.config} vs {b.base}: perplexity {100 * (b.perplexity_ratio - 1):+.3f}% (at most "
            f"{100 * (BASE_PERPLEXITY_RATIO - 1):+.1f}%): {'within' if b.passed else 'OUTSIDE'} the bound"
        )
    if args.out is not None:
        report = {"model": str(folder), "threads": args.threads, "windows": len(text.windows), "width": text.width}
        report |= {"rows": [r.summary() for r in rows]}
        report |= {"verdicts": [asdict(v) | {"top1_z": v.top1_z, "passed": v.passed} for v in found]}
        report |= {"base_verdicts": [asdict(b) | {"passed": b.passed} for b in against_base]}
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all(v.passed for v in [*found, *against_base]) else 1


def format_table(rows: list[Row], found: list[Verdict], text: Text, threads: int) -> str:
    count, width = text.windows.shape
    name = max([30] + [len(r.config) for r in rows])
    lines = [
        f"{count} windows of {width} tokens ({count * (width - 1)} scored, the first {text.split} of each in one "
        f"prompt step, the rest decoded); {threads} threads; bf16 attention kernel: "
        f"{'AVX512-BF16' if cpu.has_fast_bf16() else 'portable'}; KL(float32 reference || config) in nats",
        f"{'config':<{name}} {'PPL':>8} {'ΔPPL':>8} {'mean KL':>9} {'p99 KL':>9} {'top-1':>7} "
        f"{'KL prompt':>10} {'KL decode':>10} {'s':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r.config:<{name}} {r.perplexity:>8.3f} {r.delta_perplexity:>+8.3f} {r.mean_kl:>9.5f} {r.p99_kl:>9.5f} "
            f"{100 * r.top1_agreement:>6.2f}% {r.mean_kl_prompt:>10.5f} {r.mean_kl_decode:>10.5f} {r.seconds:>6.1f}"
        )
    for v in found:
        lines.append(
            f"{v.config} vs {v.peer}: mean KL {v.kl_ratio:.3f}× (at most {KL_RATIO}×), top-1 "
            f"{100 * v.top1_difference:+.2f} points (at least {-100 * TOP1_SLACK:.1f}, or within "
            f"{TOP1_Z:g} standard errors: {v.top1_losses} lost, {v.top1_wins} won, z {v.top1_z:+.2f}): "
            f"{'within' if v.passed else 'OUTSIDE'} the oracle"
        )
    return "\n".join(lines)
