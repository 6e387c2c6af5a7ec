"""Per-request sampling settings, with vLLM's field names, defaults and validation rules."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

# Temperatures below this are treated as 0 (greedy), as in vLLM: dividing logits by a tiny temperature
# overflows to inf/nan instead of approaching argmax.
_SAMPLING_EPS = 1e-5
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-9
MIN_REPETITION_PENALTY = 0.01


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, with vLLM's names: exactly one of a JSON schema (``json``, as a
    dict or its JSON text), any JSON object (``json_object``), a regular expression, a choice among
    strings, or an EBNF grammar (xgrammar's dialect, which reads GBNF). Whether it compiles is checked when
    the request is added; here only its shape.

    ``reasoning`` holds the constraint to what follows a reasoning model's thinking, as vLLM's reasoning parsers
    do: "optional", the text may open with a ``<think>…</think>`` block (Qwen3's way); "open", the text starts
    inside a block that ``</think>`` closes (DeepSeek-R1's, whose prompt opened it)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}, got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.reasoning not in (None, *REASONING_BLOCKS):
            raise ValueError(f"structured_outputs.reasoning must be one of {REASONING_BLOCKS}, got {self.reasoning!r}")

    @property
    def kind(self) -> str:
        """Which constraint it is: one of the field names."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
REASONING_BLOCKS = ("optional", "open")


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the completions of one request.

    ``top_k`` of 0 or -1 disables top-k (-1 is normalized to 0); ``stop`` is normalized to a list of
    strings and ``stop_token_ids`` to a list of ints. Invalid values raise ``ValueError`` naming the field.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the top-k of each prompt position, plus the prompt's own token
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n)
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of)
        self.temperature = _check_float("temperature", self.temperature)
        self.top_p = _check_float("top_p", self.top_p)
        self.top_k = _check_int("top_k", self.top_k)
        self.min_p = _check_float("min_p", self.min_p)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_int(name, getattr(self, name)))
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._verify_ranges()

    def _verify_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n={self.n}, got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.temperature < _SAMPLING_EPS:
            raise ValueError("best_of must equal n when sampling greedily (temperature 0)")
        # The sampler works in float32: past these bounds logits overflow to inf (and then NaN), and a top_p
        # below float32's smallest number is 0, which keeps no token.
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 1 / MIN_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {1 / MIN_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")

    @property
    def num_samples(self) -> int:
        """How many sequences run: best_of when given (the best n of them are returned), else n."""
        return self.best_of or self.n

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: samples are ranked by cumulative logprob, needed even without `logprobs`."""
        return self.num_samples > self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def sample_seed(self, index: int) -> int | None:
        """Seed for the generator of the ``index``-th of the ``n`` samples: distinct per sample, so that the
        n completions of a seeded request differ from each other yet are all reproducible."""
        if not 0 <= index < self.num_samples:
            raise ValueError(f"index must be in [0, {self.num_samples}), got {index}")
        return None if self.seed is None else self.seed + index


def _check_int(name: str, value: object) -> int:
    # bool is a subclass of int, but n=True is a caller bug, not a request for one sample.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a float, got {value!r}")
    # NaN would slip through every range comparison below; inf turns logits into nan.
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    normalized = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        value = _check_float("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
        normalized[int(token)] = value
    return normalized or None


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError(f"stop must not contain empty strings, got {stop!r}")
    return list(items)


def _normalize_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of int, got {ids!r}")
    if any(i < 0 for i in ids):
        raise ValueError(f"stop_token_ids must be non-negative, got {ids!r}")
    return [int(i) for i in ids]
