"""Sampler: vLLM's processing order and semantics, per-row reproducibility, and distribution sanity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import (
    Sampler,
    SamplingRow,
    _apply_presence_frequency_penalties,
    _apply_repetition_penalty,
    _argmax,
    _search,
)

sampler = Sampler()


def row(
    params: SamplingParams | None = None,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int = 0,
    banned: tuple[int, ...] = (),
) -> SamplingRow:
    params = params or SamplingParams()
    return SamplingRow(params, prompt or [0], output or [], None if params.is_greedy else seed, banned)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    # The sampler overwrites its input; keep the caller's tensor intact.
    return sampler(logits.clone(), rows).token_ids


def frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Empirical token distribution from `draws` rows of the same logits, each with its own seed."""
    rows = [row(params, seed=i) for i in range(draws)]
    tokens = torch.tensor(sample(logits.expand(draws, -1), rows))
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


def assert_distribution(freq: torch.Tensor, expected: torch.Tensor, draws: int) -> None:
    """Pearson chi-square over tokens with expected mass, plus no mass where none is expected."""
    expected = expected.double()
    assert torch.all(freq[expected == 0] == 0), (freq, expected)
    support = expected > 0
    chi2 = (draws * (freq[support] - expected[support]) ** 2 / expected[support]).sum().item()
    dof = int(support.sum()) - 1
    # Loose bound: well above the 99.99% quantile for these small degrees of freedom.
    assert chi2 < 3 * dof + 30, (chi2, freq, expected)


# ---- interface ------------------------------------------------------------------------------------


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        sampler(torch.zeros(2, 5), [row()])


def test_random_row_needs_seed() -> None:
    with pytest.raises(ValueError, match="seed"):
        sampler(torch.zeros(1, 5), [SamplingRow(SamplingParams(), [0], [], None)])


# ---- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, 100, 1024, 49152])
def test_greedy_is_argmax(vocab: int) -> None:
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(9)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [64 * 3, 256 * 4, 1000])
def test_blocked_argmax_matches_torch_including_ties(vocab: int) -> None:
    # Few distinct values: many ties, and the first maximum must win as in torch.argmax.
    logits = torch.randint(0, 4, (50, vocab), generator=torch.Generator().manual_seed(1)).float()
    logits[0] = 0.0
    assert torch.equal(_argmax(logits), logits.argmax(-1))


def test_near_zero_temperature_is_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [row(SamplingParams(temperature=1e-6, seed=i)) for i in range(4)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


# ---- banned tokens and penalties -------------------------------------------------------------------


def test_banned_tokens_never_chosen() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0]])
    assert sample(logits, [row(SamplingParams(temperature=0.0), banned=(0, 1))]) == [2]
    hot = SamplingParams(temperature=5.0)
    rows = [row(hot, seed=i, banned=(0, 2, 4)) for i in range(500)]
    tokens = sample(logits.expand(500, -1), rows)
    assert set(tokens) == {1, 3}


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0], [2.0, -1.0, 0.5, -3.0, 1.0, 4.0]])
    rows = [
        row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3, 3]),
        row(SamplingParams(), prompt=[0, 1], output=[1, 3]),  # no penalty: untouched
    ]
    _apply_repetition_penalty(logits, rows)
    # Seen tokens 0, 1, 3 (once each, despite repeats): positive logits divided, negative multiplied.
    assert logits[0].tolist() == [1.0, -2.0, 0.5, -6.0, 1.0, 4.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, -3.0, 1.0, 4.0]


def test_presence_frequency_penalties_hand_computed() -> None:
    base = [1.0, 1.0, 1.0, 1.0, 1.0]
    logits = torch.tensor([base, base, base])
    rows = [
        row(SamplingParams(presence_penalty=0.25, frequency_penalty=0.5), prompt=[0, 4], output=[2, 2, 3, 2]),
        row(SamplingParams(presence_penalty=-1.0), prompt=[1], output=[1]),
        row(SamplingParams(frequency_penalty=1.0), prompt=[0], output=[]),  # nothing generated yet
    ]
    _apply_presence_frequency_penalties(logits, rows)
    # Output tokens only: 2 appears 3 times, 3 once; prompt tokens 0 and 4 are not penalized.
    expected = [1.0, 1.0, 1.0 - (0.5 * 3 + 0.25), 1.0 - (0.5 * 1 + 0.25), 1.0]
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    torch.testing.assert_close(logits[1], torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(logits[2], torch.tensor(base))


def test_penalties_in_order_through_sampler() -> None:
    # Greedy rows leave the penalized logits in the (overwritten) input, which shows the whole pipeline.
    logits = torch.tensor([[3.0, -2.0, 2.0, 1.0, 0.5]])
    params = SamplingParams(temperature=0, repetition_penalty=2, presence_penalty=0.5, frequency_penalty=1)
    rows = [row(params, prompt=[0], output=[2, 2, 1], banned=(4,))]
    token = sampler(logits, rows).token_ids
    # Ban 4; repetition over {0, 1, 2}; then frequency/presence over outputs {2: 2, 1: 1}.
    expected = [1.5, -4.0 - 1.0 - 0.5, 1.0 - 2.0 - 0.5, 1.0, -math.inf]
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    assert token == [0]


def test_penalties_with_ragged_rows() -> None:
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    original = logits.clone()
    outputs = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9], [30, 31]]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.1)
    rows = [row(params, prompt=[10 + i], output=out) for i, out in enumerate(outputs)]
    _apply_repetition_penalty(logits, rows)
    _apply_presence_frequency_penalties(logits, rows)
    for i, out in enumerate(outputs):
        expected = original[i].clone()
        for t in set(out) | {10 + i}:
            expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
        for t in set(out):
            expected[t] -= 0.5 * out.count(t) + 0.1
        torch.testing.assert_close(logits[i], expected)


# ---- truncation -------------------------------------------------------------------------------------


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(4))
    rows = [row(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(16)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_k", [0, 20])
def test_tiny_top_p_keeps_only_argmax(top_k: int) -> None:
    logits = torch.randn(16, 1024, generator=torch.Generator().manual_seed(5))
    rows = [row(SamplingParams(temperature=2.0, top_p=1e-6, top_k=top_k), seed=i) for i in range(16)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_k", [0, 3])
def test_min_p_filters(top_k: int) -> None:
    probs = torch.tensor([0.45, 0.3, 0.14, 0.08, 0.03])
    logits = probs.log()[None]
    # min_p * max = 0.2 * 0.45 = 0.09: tokens 3 and 4 go (and top_k=3 would cut 3, 4 anyway).
    freq = frequencies(logits, SamplingParams(min_p=0.2, top_k=top_k), draws=4000)
    expected = torch.tensor([0.45, 0.3, 0.14, 0.0, 0.0]) / 0.89
    assert_distribution(freq, expected, 4000)


@pytest.mark.parametrize("top_k", [0, 40])
def test_min_p_one_keeps_only_the_top_token(top_k: int) -> None:
    logits = torch.randn(8, 256, generator=torch.Generator().manual_seed(6))
    rows = [row(SamplingParams(min_p=1.0, top_k=top_k), seed=i) for i in range(8)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


# ---- distributions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_plain_sampling_distribution(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2]])
    draws = 8000
    freq = frequencies(logits, SamplingParams(temperature=temperature), draws)
    assert_distribution(freq, (logits[0] / temperature).softmax(-1), draws)


@pytest.mark.parametrize("top_k", [0, 6])
def test_top_p_distribution(top_k: int) -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.02, 0.18])
    # Sorted: 0.4, 0.25, 0.18 | 0.1 ...: the mass before 0.1 is 0.83 >= 0.8, so the nucleus is 3 tokens.
    draws = 6000
    freq = frequencies(probs.log()[None], SamplingParams(top_p=0.8, top_k=top_k), draws)
    expected = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.0, 0.18]) / 0.83
    assert_distribution(freq, expected, draws)


@pytest.mark.parametrize("top_k", [0, 6])
def test_top_p_applies_before_min_p(top_k: int) -> None:
    probs = torch.tensor([0.4, 0.25, 0.18, 0.1, 0.05, 0.02])
    # top_p=0.7 on the whole distribution keeps 0.4, 0.25, 0.18 (mass before 0.18 is 0.65); min_p=0.4 keeps
    # p >= 0.16. Applying min-p first would renormalize and make top-p drop 0.18 too.
    draws = 6000
    freq = frequencies(probs.log()[None], SamplingParams(top_p=0.7, min_p=0.4, top_k=top_k), draws)
    expected = torch.tensor([0.4, 0.25, 0.18, 0.0, 0.0, 0.0]) / 0.83
    assert_distribution(freq, expected, draws)


def test_top_k_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 1.5, -1.0]])
    draws = 6000
    freq = frequencies(logits, SamplingParams(temperature=0.8, top_k=3), draws)
    expected = torch.where(logits[0] >= 1.0, logits[0] / 0.8, -math.inf).softmax(-1)
    assert_distribution(freq, expected, draws)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_blocked_draw_distribution_across_blocks(top_p: float) -> None:
    # 1024 tokens = 4 blocks of 256; put the mass on tokens in different blocks and block edges.
    logits = torch.full((1, 1024), -math.inf)
    hot = torch.tensor([0, 255, 256, 600, 1023])
    logits[0, hot] = torch.tensor([1.0, 0.0, 0.5, -0.5, 0.8])
    draws = 5000
    freq = frequencies(logits, SamplingParams(top_p=top_p), draws)
    expected = logits[0].softmax(-1)
    if top_p < 1.0:
        # Sorted probs ~ 0.30, 0.25, 0.18, 0.11, 0.07 (cumsum 0.30, 0.55, 0.73): three tokens remain.
        expected[hot[[1, 3]]] = 0.0
        expected /= expected.sum()
    assert_distribution(freq, expected, draws)


def test_search_never_lands_on_zero_weight_tail() -> None:
    # A target at (or rounding up to) the total must still pick the last token with weight.
    cdf = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.0, 0.5, 1.0, 1.0]])
    position, before = _search(cdf, cdf[:, -1:].clone())
    assert position.tolist() == [1, 2]
    torch.testing.assert_close(before, torch.tensor([[0.1], [0.5]]))
    position, _ = _search(cdf, torch.zeros(2, 1))
    assert position.tolist() == [0, 1]


# ---- reproducibility ------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1000, 4096])
def test_seeded_rows_independent_of_batch(vocab: int) -> None:
    gen = torch.Generator().manual_seed(7)
    mine = torch.randn(3, vocab, generator=gen) * 3
    others = torch.randn(5, vocab, generator=gen) * 3
    my_params = [
        SamplingParams(temperature=0.9, top_p=0.6, seed=11),
        SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.01, seed=12),
        SamplingParams(temperature=0.7, presence_penalty=0.3, seed=13),
    ]
    other_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.3, seed=1),
        SamplingParams(top_k=5),
        SamplingParams(min_p=0.1, repetition_penalty=1.3),
        SamplingParams(temperature=2.0, top_p=0.95),
    ]

    def run(order: list[tuple[str, int]]) -> dict[tuple[str, int], list[int]]:
        """Sample 5 steps for rows laid out in `order`."""
        rows = {}
        for kind, i in order:
            params = my_params[i] if kind == "mine" else other_params[i]
            rows[kind, i] = row(params, prompt=[1, 2], output=[3], seed=100 + i if kind == "mine" else i)
        tokens: dict[tuple[str, int], list[int]] = {key: [] for key in order}
        for _ in range(5):
            logits = torch.stack([(mine if kind == "mine" else others)[i] for kind, i in order])
            sampled = sampler(logits, [rows[key] for key in order]).token_ids
            for key, token in zip(order, sampled, strict=True):
                tokens[key].append(token)
        return tokens

    alone = {("mine", i): run([("mine", i)])["mine", i] for i in range(3)}
    mixed = run([("other", 0), ("mine", 2), ("other", 1), ("other", 2), ("mine", 0), ("other", 3)])
    reversed_batch = run([("mine", 1), ("other", 4), ("mine", 0), ("mine", 2)])
    for key, tokens in alone.items():
        if key in mixed:
            assert mixed[key] == tokens
        assert reversed_batch[key] == tokens


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    draws = [sample(logits, [row(SamplingParams(), seed=s)])[0] for s in range(20)]
    assert len(set(draws)) > 10


# ---- logprobs --------------------------------------------------------------------------------------


def test_logprobs_from_raw_logits() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(8))
    raw_logprobs = logits.log_softmax(-1)
    # Penalties, bans and temperature must not leak into the reported logprobs.
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.7),
        SamplingParams(temperature=0.5, logprobs=3, top_p=0.9, presence_penalty=1.0),
        SamplingParams(temperature=1.0),
    ]
    top_token = int(logits[0].argmax())
    rows = [
        row(params[0], prompt=[top_token], banned=(top_token,)),
        row(params[1], output=[1, 2, 3], seed=3),
        row(params[2], seed=4),
    ]
    out = sampler(logits.clone(), rows)
    assert out.logprobs[2] is None
    for i, k in [(0, 5), (1, 3)]:
        entry = out.logprobs[i]
        token = out.token_ids[i]
        top = raw_logprobs[i].topk(k)
        assert set(entry) == {token} | set(top.indices.tolist())
        for rank, (t, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            assert entry[t].rank == rank
            assert entry[t].logprob == pytest.approx(value, abs=1e-5)
        assert entry[token].logprob == pytest.approx(raw_logprobs[i, token].item(), abs=1e-5)
        assert entry[token].rank == 1 + int((raw_logprobs[i] > raw_logprobs[i, token]).sum())
    # Row 0 banned its raw argmax: the sampled token is ranked 2 by the raw distribution.
    assert out.logprobs[0][out.token_ids[0]].rank == 2
    assert out.logprobs[0][top_token].rank == 1


def test_logprobs_zero_and_rank_outside_top_k() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    rows = [row(SamplingParams(temperature=0.0, logprobs=0), banned=(0, 1, 2))]
    out = sampler(logits.clone(), rows)
    assert out.token_ids == [3]
    assert list(out.logprobs[0]) == [3]
    assert out.logprobs[0][3].rank == 4
    assert out.logprobs[0][3].logprob == pytest.approx(logits.log_softmax(-1)[0, 3].item(), abs=1e-6)


def test_logprobs_beyond_vocab_returns_whole_vocab() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    out = sampler(logits.clone(), [row(SamplingParams(logprobs=10), seed=1)])
    assert {t: lp.rank for t, lp in out.logprobs[0].items()} == {1: 1, 2: 2, 0: 3}


def test_logprob_ranks_share_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    out = sampler(logits.clone(), [row(SamplingParams(temperature=0.0, logprobs=3))])
    entry = out.logprobs[0]
    assert out.token_ids == [1]
    assert {t: lp.rank for t, lp in entry.items()} == {1: 1, 2: 1, 3: 3}


# ---- properties ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    vocab=st.sampled_from([5, 16, 64 * 3]),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    top_k=st.sampled_from([0, 1, 2, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_sampled_token_is_allowed(
    data: st.DataObject, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    seed = data.draw(st.integers(0, 2**31))
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    banned = tuple(data.draw(st.sets(st.integers(0, vocab - 1), max_size=vocab - 1)))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    token = sample(logits, [row(params, seed=seed, banned=banned)])[0]

    assert token not in banned
    allowed = logits[0].double().clone()
    allowed[list(banned)] = -math.inf
    if params.is_greedy:
        assert allowed[token] == allowed.max()
        return
    order = allowed.argsort(descending=True)
    if top_k:
        allowed[order[top_k:]] = -math.inf
    probs = (allowed / temperature).softmax(-1)
    mass_above = probs[probs > probs[token]].sum().item()
    assert mass_above < top_p + 1e-5
    assert probs[token] >= min_p * probs.max() - 1e-6
