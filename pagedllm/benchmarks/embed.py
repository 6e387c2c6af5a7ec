"""`pagedllm bench embed`: a fixed corpus embedded by pagedllm and by sentence-transformers, on the same weights in
the same dtype with the same torch thread count, in one process, batch size by batch size.

    pagedllm bench embed [--model M] [--num-sentences 10000] [--batch-sizes 1,8,32,128,256] [--dtype float32]
                         [--output embed.json] [--plot embed.png]

The corpus: windows of the shipped text (`data/accuracy_text.txt`, read cyclically) that start at a sentence's
first word and run a log-uniform number of words, 4 to 150 (about 5 to 200 tokens): a short sentence, part of a
long one, or a run of several. It is drawn from one seeded generator, so the first N sentences are the same for
every N and a small run measures a sample of the large one.

Batch size B is at most B sentences in one forward pass on both sides: sentence-transformers'
`encode(batch_size=B)` (its batches of B, sorted by length and padded), and pagedllm with `max_num_seqs=B` and the
whole corpus submitted at once (`LLM.embed`, how one embeds a corpus offline with it): each step holds up to B
sequences, unpadded, within `max_num_batched_tokens` (2048 by default). Submitting B at a time instead would make
the harness, not the engine, leave the last step of every B partly empty. Prefix caching is off: the windows
repeat and share beginnings, which a prefix cache would skip and sentence-transformers computes.

Before each batch size, both engines embed the corpus's first `--warmup` sentences at that batch size, untimed.
A timing is the wall time of the whole call, tokenizing included on both sides. Both engines' embeddings are
compared sentence by sentence (cosine, mean and worst), so the speeds compared are of the same answers; in
float32 a worst cosine under `AGREEMENT_FLOOR` fails the run. pagedllm's time is also split by step phase
(`EngineStats.step_seconds`), with what lies outside its steps (tokenizing and queueing the prompts, output
processing) as "outside steps".
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DTypes, resolve_dtype
from pagedllm.domains import NON_NEGATIVE_INTS, POSITIVE_INTS, CommaLists, ExistingPaths, FilePaths
from pagedllm.entrypoints.llm import LLM
from pagedllm.models.loader import resolve_model_folder

CORPUS_TEXT = Path(__file__).with_name("data") / "accuracy_text.txt"
MIN_WORDS, MAX_WORDS = 4, 150
CORPUS_SEED = 0
DEFAULT_BATCH_SIZES = (1, 8, 32, 128, 256)
# float32 engines differ only in the order of their sums: cosines of 1 - 1e-6 or closer. Anything further apart
# is another computation (other tokens, another pooling), whose speed is no comparison.
AGREEMENT_FLOOR = 0.9999
_SENTENCE_END = re.compile(r"[.!?][\"'’”]?$")
_TITLES = frozenset({"Mr.", "Mrs.", "Dr.", "St."})  # full stops that end no sentence


@dataclass(frozen=True, slots=True)
class EmbedSetup:
    folder: Path  # a sentence-transformers folder, read by both engines
    dtype: torch.dtype
    threads: int
    warmup: int  # sentences embedded untimed before each batch size


@dataclass(frozen=True, slots=True)
class EngineRun:
    """One engine's timed pass over the corpus at one batch size."""

    seconds: float
    vectors: torch.Tensor  # one float32 row per sentence
    token_counts: list[int]
    phases: dict[str, float]  # pagedllm's seconds per step phase (and "outside steps"); empty for the peer


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float
    sentences_per_s: float
    tokens_per_s: float

    @classmethod
    def of(cls, seconds: float, sentences: int, tokens: int) -> Timing:
        return cls(seconds, sentences / seconds, tokens / seconds)


@dataclass(frozen=True, slots=True)
class BatchResult:
    batch_size: int
    sentences: int
    tokens: int
    pagedllm: Timing
    sentence_transformers: Timing
    cosine_mean: float
    cosine_worst: float
    pagedllm_phases: dict[str, float]

    @property
    def ratio(self) -> float:
        """pagedllm's sentences/s over sentence-transformers'."""
        return self.pagedllm.sentences_per_s / self.sentence_transformers.sentences_per_s

    def as_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def make_corpus(num_sentences: int) -> list[str]:
    """The benchmark's first `num_sentences` sentences (see the module's docstring)."""
    words = CORPUS_TEXT.read_text().split()
    starts = [0] + [i + 1 for i, word in enumerate(words[:-1]) if _SENTENCE_END.search(word) and word not in _TITLES]
    rng = random.Random(CORPUS_SEED)
    low, high = math.log(MIN_WORDS), math.log(MAX_WORDS)
    corpus = []
    for _ in range(num_sentences):
        start, count = rng.choice(starts), round(math.exp(rng.uniform(low, high)))
        corpus.append(" ".join(words[(start + k) % len(words)] for k in range(count)))
    return corpus


@contextmanager
def embedder_folder(model: str | Path | None) -> Iterator[Path]:
    """The model as a sentence-transformers folder: a folder with modules.json as it is; any other (the embedded
    default's converted folder, an HF folder, a .gguf file's float weights) as a temporary folder of links to its
    files with last-token pooling and normalization, how decoder embedders (Qwen3-Embedding's kind) pool."""
    folder = resolve_model_folder(model)
    if (folder / "modules.json").is_file():
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="pagedllm-embed-") as tmp:
        yield wrap_last_token(folder, Path(tmp))


def wrap_last_token(folder: Path, into: Path) -> Path:
    """`into` made a sentence-transformers model of `folder`'s files: Transformer, last-token Pooling, Normalize."""
    for path in folder.iterdir():
        (into / path.name).symlink_to(path.resolve())
    hidden_size = json.loads((folder / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_lasttoken": True}
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (into / "1_Pooling").mkdir()
    (into / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (into / "2_Normalize").mkdir()
    (into / "modules.json").write_text(json.dumps(modules))
    return into


def time_pagedllm(setup: EmbedSetup, corpus: list[str], batch_size: int) -> EngineRun:
    torch.set_num_threads(setup.threads)  # the engine's worker takes torch's count as its most threads
    llm = LLM(
        setup.folder, task="embed", dtype=setup.dtype, max_num_seqs=batch_size, enable_prefix_caching=False, seed=0
    )
    if setup.warmup:
        llm.embed(corpus[: setup.warmup], use_tqdm=False)
    before = llm.stats().step_seconds
    gc.collect()
    start = time.perf_counter()
    outputs = llm.embed(corpus, use_tqdm=False)
    seconds = time.perf_counter() - start
    phases = step_phases(before, llm.stats().step_seconds, seconds)
    vectors = torch.stack([output.outputs.data for output in outputs])
    return EngineRun(seconds, vectors, [len(output.prompt_token_ids) for output in outputs], phases)


def step_phases(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Seconds per step phase between two readings of the engine's totals, and the rest of `seconds`."""
    phases = {phase: total - before.get(phase, 0.0) for phase, total in after.items()}
    return phases | {"outside steps": seconds - sum(phases.values())}


def load_sentence_transformer(folder: Path, dtype: torch.dtype):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})


def time_sentence_transformers(setup: EmbedSetup, model, corpus: list[str], batch_size: int) -> EngineRun:
    # pagedllm's worker sets torch's thread count per step: back to the setup's before this side runs.
    torch.set_num_threads(setup.threads)

    def encode(sentences: list[str]) -> torch.Tensor:
        return model.encode(sentences, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)

    if setup.warmup:
        encode(corpus[: setup.warmup])
    gc.collect()
    start = time.perf_counter()
    vectors = encode(corpus)
    seconds = time.perf_counter() - start
    counts = [len(ids) for ids in model.tokenizer(corpus)["input_ids"]]
    return EngineRun(seconds, vectors.float(), counts, {})


def measure_batch(setup: EmbedSetup, model, corpus: list[str], batch_size: int) -> BatchResult:
    """Both engines on the corpus at one batch size, pagedllm first (each side warmed the same way)."""
    paged = time_pagedllm(setup, corpus, batch_size)
    gc.collect()  # the engine and its KV pool go before the peer runs
    peer = time_sentence_transformers(setup, model, corpus, batch_size)
    if paged.token_counts != peer.token_counts:
        raise RuntimeError("pagedllm and sentence-transformers tokenize the corpus differently")
    cosines = F.cosine_similarity(paged.vectors, peer.vectors, dim=-1)
    tokens = sum(paged.token_counts)
    return BatchResult(
        batch_size=batch_size,
        sentences=len(corpus),
        tokens=tokens,
        pagedllm=Timing.of(paged.seconds, len(corpus), tokens),
        sentence_transformers=Timing.of(peer.seconds, len(corpus), tokens),
        cosine_mean=cosines.mean().item(),
        cosine_worst=cosines.min().item(),
        pagedllm_phases=paged.phases,
    )


def add_bench_embed_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="sentence-transformers folder, or an HF folder or .gguf embedded with last-token pooling (default: "
        "the embedded SmolLM2-135M)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument("--num-sentences", default=10_000, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--batch-sizes", default=DEFAULT_BATCH_SIZES, help="comma-separated", **CommaLists(POSITIVE_INTS).flag_kwargs()
    )
    parser.add_argument("--dtype", default="float32", **DTypes().flag_kwargs())
    parser.add_argument("--threads", default=torch.get_num_threads(), **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--warmup", default=64, help="sentences each engine embeds untimed first", **NON_NEGATIVE_INTS.flag_kwargs()
    )
    parser.add_argument("--output", default=None, help="JSON of the figures", **FilePaths().flag_kwargs())
    parser.add_argument("--plot", default=None, help="PNG of sentences/s by batch size", **FilePaths().flag_kwargs())


def run_bench_embed(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    dtype = resolve_dtype(args.dtype)
    torch.set_num_threads(args.threads)
    corpus = make_corpus(args.num_sentences)
    results: list[BatchResult] = []
    with embedder_folder(args.model) as folder:
        setup = EmbedSetup(folder, dtype, args.threads, min(args.warmup, len(corpus)))
        model = load_sentence_transformer(folder, dtype)
        print(describe(setup, len(corpus)))
        print(TABLE_HEADER, flush=True)
        for batch_size in args.batch_sizes:
            results.append(measure_batch(setup, model, corpus, batch_size))
            print(format_row(results[-1]), flush=True)
            if args.output is not None:  # after every batch size: a long run stopped early keeps what it measured
                wall = time.perf_counter() - started
                args.output.write_text(json.dumps(report(setup, args.model, results, wall), indent=2))
    print(format_phases(results))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    if args.plot is not None:
        plot(results, args.plot, f"{Path(args.model).name if args.model else 'SmolLM2-135M'}, {dtype}")
    worst = min(result.cosine_worst for result in results)
    if dtype == torch.float32 and worst < AGREEMENT_FLOOR:
        print(f"the engines' embeddings disagree: worst cosine {worst:.6f} < {AGREEMENT_FLOOR}", file=sys.stderr)
        return 1
    return 0


def describe(setup: EmbedSetup, sentences: int) -> str:
    return (
        f"{sentences} sentences; {setup.dtype}, {setup.threads} threads (CPU {torch.backends.cpu.get_cpu_capability()})"
        f"; pagedllm: max_num_seqs = batch size, all submitted, max_num_batched_tokens "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, prefix caching off; warm-up {setup.warmup} sentences each"
    )


TABLE_HEADER = (
    f"{'batch':>5} {'tokens':>8} {'pagedllm sent/s':>16} {'tok/s':>8} {'ST sent/s':>10} {'tok/s':>8} "
    f"{'pagedllm/ST':>12} {'cos mean':>10} {'cos worst':>10}"
)


def format_row(result: BatchResult) -> str:
    paged, peer = result.pagedllm, result.sentence_transformers
    return (
        f"{result.batch_size:>5} {result.tokens:>8} {paged.sentences_per_s:>16.2f} {paged.tokens_per_s:>8.1f} "
        f"{peer.sentences_per_s:>10.2f} {peer.tokens_per_s:>8.1f} {result.ratio:>11.2f}x "
        f"{result.cosine_mean:>10.7f} {result.cosine_worst:>10.7f}"
    )


def format_phases(results: list[BatchResult]) -> str:
    """pagedllm's timed seconds per step phase at each batch size."""
    phases = list(dict.fromkeys(phase for result in results for phase in result.pagedllm_phases))
    lines = [
        "pagedllm's seconds by step phase (pooling runs in 'sample'):",
        f"{'batch':>5} {'run':>8}" + "".join(f" {phase:>13}" for phase in phases),
    ]
    for result in results:
        cells = "".join(f" {result.pagedllm_phases.get(phase, 0.0):>13.2f}" for phase in phases)
        lines.append(f"{result.batch_size:>5} {result.pagedllm.seconds:>8.2f}{cells}")
    return "\n".join(lines)


def report(setup: EmbedSetup, model: str | Path | None, results: list[BatchResult], wall: float) -> dict:
    return {
        "model": "embedded default (SmolLM2-135M), last-token pooling" if model is None else str(model),
        "dtype": str(setup.dtype),
        "threads": setup.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "num_sentences": results[0].sentences if results else 0,
        "warmup": setup.warmup,
        "pagedllm_batching": "max_num_seqs = batch size, the whole corpus submitted at once, prefix caching off",
        "max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "sentence_transformers": version("sentence-transformers"),
        "wall_seconds": wall,
        "results": [result.as_dict() for result in results],
    }


def plot(results: list[BatchResult], path: Path, title: str) -> None:
    from pagedllm.benchmarks.plots import plot_embed_throughput

    series = {
        "pagedllm": [result.pagedllm.sentences_per_s for result in results],
        "sentence-transformers": [result.sentence_transformers.sentences_per_s for result in results],
    }
    plot_embed_throughput([result.batch_size for result in results], series, path, f"Embedding throughput ({title})")
