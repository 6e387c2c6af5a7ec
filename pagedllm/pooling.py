"""Pooling: a prompt's hidden states made into one vector (an embedding) or a score, as the checkpoint says.

The checkpoint's own files decide, as sentence-transformers and vLLM read them: `modules.json` and its pooling
module's `config.json` (last token, mean or CLS; a `Normalize` module), `config_sentence_transformers.json`
(instruction prefixes), `config.json` (`is_matryoshka` / `matryoshka_dimensions`; a `*ForSequenceClassification`
architecture, whose `score` matrix maps the last token's hidden state to the labels; `classifier_from_token`,
a causal LM scored on the logits of its "no" and "yes" tokens, Qwen3-Reranker's recipe).

A pooling sequence runs its prompt only (in chunks like any prompt); each step the worker hands the scheduler
this step's part of the vector (`Pooler.part`), which the sequence's `PoolState` adds up, and the vector is
finished once the last chunk is computed. Mean and CLS pooling need every position's hidden state, so such a
sequence takes no prefix-cache hit (it still fills the cache); last-token pooling reads only the last position,
which is always computed, so it takes hits like a generation request. An encoder's sequence (bidirectional
attention: every position depends on the later ones) is computed whole in one step and takes no hit either; its
classifier reads the CLS row, and without sentence-transformers' modules it pools the CLS row (vLLM's default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.pooling_params import PoolingParams

if TYPE_CHECKING:  # a type only: the sequences' room stays below the models' (docs/ARCHITECTURE.md)
    from transformers import PreTrainedTokenizerBase

    from pagedllm.models.config import ModelConfig

POOLING_TYPES = ("last", "mean", "cls")
EMBED, SCORE, GENERATE = "embed", "score", "generate"

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# sentence-transformers' pooling modes, as its Pooling config names them, and ours.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True, slots=True)
class Pooler:
    """How the model makes a prompt into a vector. `head`: "none" (the hidden state is the embedding),
    "score" (the checkpoint's classification matrix; sigmoid of one label, softmax of several) or "tokens"
    (the LM head's logits of `label_token_ids`, no then yes: sigmoid of their difference, one score)."""

    task: str  # EMBED or SCORE
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    size: int  # the vector's length before any `dimensions` cut: the hidden size, or the labels
    matryoshka: tuple[int, ...] | None = None  # None: no cut; (): any length up to `size`; else these only
    head: str = "none"
    label_token_ids: tuple[int, ...] = ()
    prompts: dict[str, str] = field(default_factory=dict)  # named instruction prefixes (sentence-transformers')
    default_prompt_name: str | None = None
    bidirectional: bool = False  # an encoder's: a prompt runs whole, in one step

    @classmethod
    def of(cls, config: ModelConfig, raw_config: dict, task: str, vocab: dict[str, int]) -> Pooler:
        """The pooler a `task` engine (EMBED or SCORE) runs with this checkpoint (`raw_config`: its config.json).
        ValueError naming the file and what it asks for where pagedllm cannot follow it."""
        folder = config.folder
        prompts, default_prompt = _st_prompts(folder)
        encoder = config.encoder is not None
        if task == SCORE:
            head, labels = _score_head(config, raw_config, vocab)
            size = config.num_labels if head == "score" else 1
            # A decoder's classifier reads the last token's hidden state, an encoder's the CLS token's (or with
            # ModernBERT's classifier_pooling "mean", the mean of every token's).
            pooling = config.encoder.classifier_pooling if config.encoder is not None else "last"
            return cls(SCORE, pooling, False, size, None, head, labels, prompts, default_prompt, encoder)
        pooling_type, normalize = _st_pooling(folder, "cls" if encoder else "last")
        matryoshka = _matryoshka(raw_config)
        size = config.hidden_size
        return cls(EMBED, pooling_type, normalize, size, matryoshka, "none", (), prompts, default_prompt, encoder)

    @property
    def takes_prefix_hits(self) -> bool:
        """Whether a sequence may skip cached positions: only the last position's hidden state is pooled, and it
        depends on none after it (a decoder's)."""
        return self.pooling_type == "last" and not self.bidirectional

    def check(self, params: PoolingParams) -> None:
        """ValueError naming the field a request asks for that this model cannot give."""
        dims = params.dimensions
        if dims is None:
            return
        if self.task == SCORE:
            raise ValueError("dimensions applies to embeddings; this model scores")
        if self.matryoshka is None:
            raise ValueError(
                "dimensions: this model does not support Matryoshka representation (its config.json sets neither "
                "is_matryoshka nor matryoshka_dimensions), so its embeddings cannot be shortened"
            )
        if dims > self.size or (self.matryoshka and dims not in self.matryoshka):
            allowed = list(self.matryoshka) if self.matryoshka else f"1 to {self.size}"
            raise ValueError(f"dimensions {dims} is not one this model gives: {allowed}")

    def part(self, rows: torch.Tensor) -> torch.Tensor:
        """This step's part of a sequence's vector from its rows' hidden states (float32): the last (or first)
        row itself, or for mean pooling their sum."""
        rows = rows.float()
        return rows.sum(0) if self.pooling_type == "mean" else rows[-1]


@dataclass(slots=True)
class PoolState:
    """A pooling sequence's vector as its chunks are computed; `reset` when its KV is dropped for recompute."""

    pooler: Pooler
    params: PoolingParams
    total: torch.Tensor | None = None

    def take(self, part: torch.Tensor) -> None:
        self.total = part if self.total is None else self.total + part

    def reset(self) -> None:
        self.total = None

    def result(self, num_tokens: int) -> torch.Tensor:
        """The finished vector of a prompt of `num_tokens` tokens: averaged (mean pooling), activated (a score),
        cut to `dimensions` and normalized as asked."""
        assert self.total is not None, "a pooling sequence finished before any of its rows was pooled"
        pooler, params = self.pooler, self.params
        # A head's part is its logits already (an encoder's mean-pooling classifier read the mean row).
        vector = self.total / num_tokens if pooler.pooling_type == "mean" and pooler.head == "none" else self.total
        if pooler.task == SCORE:
            return torch.sigmoid(vector) if len(vector) == 1 else torch.softmax(vector, -1)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = pooler.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, dim=-1) if normalize else vector


def task_parts(task: str) -> list[str]:
    """The tasks an engine of this task (`EngineConfig.task`, resolved) runs: one, or generate and a pooling one."""
    return task.split(",")


def generates(task: str) -> bool:
    """Whether an engine of this task generates text."""
    return GENERATE in task_parts(task)


def pooling_task(task: str) -> str | None:
    """The pooling task (EMBED or SCORE) an engine of this task runs, if any."""
    return next((part for part in task_parts(task) if part != GENERATE), None)


def resolve_task(requested: str, config: ModelConfig, raw_config: dict) -> str:
    """What an engine on this checkpoint runs: `requested`, or with "auto" the checkpoint's own (a classifier
    or `classifier_from_token` in `raw_config`, its config.json: score; sentence-transformers' modules or a
    checkpoint without an LM head, a bare `*Model`: embed; else generate)."""
    if requested != "auto":
        return requested
    if config.num_labels or raw_config.get("classifier_from_token"):
        return SCORE
    if (config.folder / "modules.json").is_file() or not config.has_lm_head:
        return EMBED
    return GENERATE


def truncated_encoding(
    tokenizer: PreTrainedTokenizerBase, text: str | tuple[str, str], limit: int | None
) -> dict[str, list[int]]:
    """An encoder's text (or text pair) as its tokenizer encodes it, cut to `limit` tokens by the tokenizer when
    given: it keeps [CLS] and [SEP] and cuts from its own side, as sentence-transformers does (keeping the last
    tokens, a decoder's truncation, would drop the CLS token an encoder pools and classifies)."""
    pair = (text,) if isinstance(text, str) else text
    encoded = tokenizer(*pair, truncation=limit is not None, max_length=limit)
    return {key: list(encoded[key]) for key in ("input_ids", "token_type_ids") if key in encoded}


def _st_modules(folder: Path) -> list[dict]:
    path = folder / "modules.json"
    return json.loads(path.read_text()) if path.is_file() else []


def _st_pooling(folder: Path, default: str) -> tuple[str, bool]:
    """The pooling type and normalization of sentence-transformers' modules; without them vLLM's default, normalized:
    `default` (a decoder's last token, an encoder's CLS)."""
    modules = _st_modules(folder)
    if not modules:
        return default, True
    kinds = [module.get("type") for module in modules]
    others = [kind for kind in kinds if kind not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if others:
        raise ValueError(
            f"{folder / 'modules.json'}: module {others[0]} is not supported (Transformer, Pooling, Normalize are)"
        )
    pooling = next((module for module in modules if module.get("type") == _ST_POOLING), None)
    if pooling is None:
        return default, _ST_NORMALIZE in kinds
    path = folder / pooling.get("path", "") / "config.json"
    settings = json.loads(path.read_text())
    unsupported = [mode for mode in _ST_UNSUPPORTED_MODES if settings.get(mode)]
    chosen = [ours for mode, ours in _ST_MODES.items() if settings.get(mode)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path}: pagedllm pools with exactly one of {', '.join(_ST_MODES)}; this asks for "
            f"{unsupported + [mode for mode in _ST_MODES if settings.get(mode)] or 'none'}"
        )
    if chosen[0] == "mean" and settings.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt false (the instruction left out of the mean) is not supported")
    return chosen[0], _ST_NORMALIZE in kinds


def _st_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    path = folder / "config_sentence_transformers.json"
    if not path.is_file():
        return {}, None
    settings = json.loads(path.read_text())
    return dict(settings.get("prompts") or {}), settings.get("default_prompt_name")


def _matryoshka(raw_config: dict) -> tuple[int, ...] | None:
    dims = raw_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if raw_config.get("is_matryoshka") else None


def _score_head(config: ModelConfig, raw_config: dict, vocab: dict[str, int]) -> tuple[str, tuple[int, ...]]:
    """The head a score engine reads: the classification matrix, or the LM head's rows of two tokens."""
    where = config.folder / "config.json"
    tokens = raw_config.get("classifier_from_token")
    if tokens:
        if len(tokens) != 2 or any(token not in vocab for token in tokens):
            raise ValueError(
                f"{where}: classifier_from_token must name two tokens of the vocabulary (no, yes), got {tokens!r}"
            )
        if not config.has_lm_head:
            raise ValueError(
                f"{where}: classifier_from_token scores with the LM head, which {config.architecture} lacks"
            )
        return "tokens", tuple(vocab[token] for token in tokens)
    if not config.num_labels:
        raise ValueError(
            f"{where}: task score needs a *ForSequenceClassification checkpoint or classifier_from_token (the two "
            f"tokens a causal LM answers no and yes with); this is {config.architecture}"
        )
    return "score", ()
