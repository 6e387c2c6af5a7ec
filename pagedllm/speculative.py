"""Speculative decoding's settings and its proposer: tokens guessed ahead of a sequence, which the target model
then checks all at once in one step (several query positions of one sequence, as a prompt chunk has).

The n-gram proposer (prompt lookup decoding, vLLM's `method: "ngram"`) looks for the sequence's last n tokens
earlier in the sequence (its prompt or its output) and proposes the tokens that followed them there. Work that
copies spans of its input (edits, extraction, code) is where it guesses right.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# vLLM's names: `method` "ngram", or a draft `model` (method "draft_model", implied by the key).
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "model")
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
# Above this many running sequences a step is compute-bound on a CPU, and verifying guesses costs what it saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int
    model: str | None = None  # the draft model (an HF folder or a GGUF file) of method "draft_model"

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's `speculative_config` dict, checked: a ValueError names the key and the value."""
        unknown = [key for key in settings if key not in KEYS]
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
        model = settings.get("model")
        method = settings.get("method", "draft_model" if model is not None else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        k = _positive(settings, "num_speculative_tokens", None, MAX_SPECULATIVE_TOKENS)
        # vLLM's defaults: neither given means 5 and 5, one given stands for both.
        low = settings.get("prompt_lookup_min")
        high = settings.get("prompt_lookup_max")
        low_default = 5 if low is None and high is None else high
        high_default = 5 if low is None and high is None else low
        prompt_lookup_min = _positive(settings, "prompt_lookup_min", low_default, 1024)
        prompt_lookup_max = _positive(settings, "prompt_lookup_max", high_default, 1024)
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({prompt_lookup_max})"
            )
        disable = _positive(settings, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 2**31 - 1)
        if (method == "draft_model") != (model is not None):
            needs = "needs" if model is None else "takes no"
            raise ValueError(f"speculative_config: method {method!r} {needs} 'model'")
        if model is not None and (not isinstance(model, str) or not Path(model).exists()):
            raise ValueError(f"speculative_config: model must be an existing folder or .gguf file, got {model!r}")
        return cls(method, k, prompt_lookup_min, prompt_lookup_max, disable, model)

    def propose(self, token_ids: list[int], limit: int) -> tuple[int, list[int]]:
        """How many guesses follow `token_ids` this step (at most min(num_speculative_tokens, limit)), and the
        guesses where the proposer is the n-gram one; a draft model's are picked by the worker, in those slots."""
        k = min(self.num_speculative_tokens, limit)
        if k <= 0:
            return 0, []
        if self.method == "draft_model":
            return k, []
        guesses = propose_ngram(token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)
        return len(guesses), guesses


def _positive(settings: dict[str, Any], key: str, default: int | None, high: int) -> int:
    value = settings.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config: {key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"speculative_config: {key} must be an integer from 1 to {high}, got {value!r}")
    return value


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens (fewer at the end) that followed the latest earlier occurrence of the longest suffix of
    `token_ids` of min_n .. max_n tokens; none when no such suffix occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Windows starting at 0 .. len - n - 1: each has at least one token after it.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
