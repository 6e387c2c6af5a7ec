"""SamplingParams: vLLM defaults, normalization, and validation errors that name the offending field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids) == ([], [])
    assert (p.include_stop_str_in_output, p.ignore_eos, p.skip_special_tokens) == (False, False, True)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)


def test_normalization() -> None:
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(7, 8), temperature=1, top_p=1)
    assert p.top_k == 0
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 8]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_valid_boundaries() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, max_tokens=1, min_tokens=1, logprobs=0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01, seed=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.0),
        ("n", True),
        ("temperature", -1.0),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", False),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", 2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 1.5),
        ("seed", 1.5),
        ("seed", True),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 5),
        ("stop", ["ok", 5]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 3),
        ("ignore_eos", 1),
        ("skip_special_tokens", None),
        ("include_stop_str_in_output", "yes"),
    ],
)
def test_invalid_value_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_message_reports_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 100\], got -1.0"):
        SamplingParams(temperature=-1)


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)


@pytest.mark.parametrize(
    ("temperature", "seed", "expected"),
    [
        (0.0, None, SamplingType.GREEDY),
        (1e-6, 3, SamplingType.GREEDY),
        (1e-5, None, SamplingType.RANDOM),
        (0.7, None, SamplingType.RANDOM),
        (0.7, 3, SamplingType.RANDOM_SEED),
    ],
)
def test_sampling_type(temperature: float, seed: int | None, expected: SamplingType) -> None:
    p = SamplingParams(temperature=temperature, seed=seed)
    assert p.sampling_type is expected
    assert p.is_greedy == (expected is SamplingType.GREEDY)


def test_sample_seed() -> None:
    p = SamplingParams(n=3, seed=10)
    assert [p.sample_seed(i) for i in range(3)] == [10, 11, 12]
    assert SamplingParams(n=2).sample_seed(1) is None
    with pytest.raises(ValueError, match="index"):
        p.sample_seed(3)


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=10))
def test_top_p_range_property(top_p: float) -> None:
    if 1e-9 <= top_p <= 1.0:  # below 1e-9 float32 sampling would keep no token
        assert SamplingParams(top_p=top_p).top_p == top_p
    else:
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=top_p)


@given(st.integers(min_value=-5, max_value=5), st.one_of(st.none(), st.integers(min_value=-2, max_value=5)))
def test_token_count_rules_property(min_tokens: int, max_tokens: int | None) -> None:
    valid = min_tokens >= 0 and (max_tokens is None or (max_tokens >= 1 and min_tokens <= max_tokens))
    if valid:
        SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens)
    else:
        with pytest.raises(ValueError, match="_tokens"):
            SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 1e300), ("top_p", 5e-324), ("repetition_penalty", 1e-40), ("repetition_penalty", 1e40)],
)
def test_values_float32_sampling_cannot_represent_are_refused(field: str, value: float) -> None:
    """Each once reached the sampler and made NaN logits (or kept no token): now a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_seed_past_64_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        SamplingParams(seed=2**70)
