"""Batched next-token sampler: one row of float32 logits per sequence that samples this step.

Follows vLLM's semantics. Logprobs come from the model's raw logits. Then, in order: banned tokens are set to
-inf, logit biases are added, a constrained row's grammar masks the tokens it forbids (rows without one are
not touched), the repetition penalty is applied over prompt + output tokens, presence/frequency penalties over
output tokens; greedy rows take the argmax; random rows are divided by their temperature, truncated by top-k, top-p
and min-p, and sampled with uniforms that are a function of the row's seed and the token's index in its
output (and the draw's attempt) alone: a seeded request draws the same tokens whatever else shares its batch,
and a token checked ahead by speculative decoding is drawn as it would have been in its own step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

# Block sizes tried, largest first, to split the vocabulary into equal blocks (see _blocks).
_BLOCK_SIZES = (256, 128, 64)
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None  # the sequence's seed; None only for greedy rows
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS + stop_token_ids while len(output) < min_tokens
    grammar: xgr.GrammarMatcher | None = None  # a constrained row: only tokens it allows can be drawn

    @property
    def wants_logprob(self) -> bool:
        return self.params.logprobs is not None or self.params.ranks_samples

    def uniform(self, attempt: int) -> float:
        """This row's U[0, 1) draw number `attempt` (a redraw outside the nucleus is the next), on float32's grid:
        splitmix64's finalizer over the seed, the output token's index and the attempt."""
        assert self.seed is not None
        bits = _mix64(_mix64(_mix64(self.seed & _MASK64) ^ len(self.output_token_ids)) ^ attempt)
        return (bits >> 40) * 2.0**-24


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None unless params.logprobs is set; else the sampled token and the top-`logprobs` tokens of
    # the raw distribution, each with rank = 1 + the number of tokens with a strictly larger logit.
    logprobs: list[dict[int, Logprob] | None]
    # Per row: the sampled token's raw log-probability where the row wants it (see SamplingRow), else None.
    sampled_logprobs: list[float | None]


class Sampler:
    """Picks one token per row of ``logits`` ([N, V] float32).

    ``logits`` is overwritten: it is the engine's per-step scratch tensor, and working in place avoids
    allocating [N, V] temporaries, which dominates the cost on CPU.
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must have shape [{len(rows)}, vocab], got {list(logits.shape)}")
        logprob_rows = [i for i, row in enumerate(rows) if row.wants_logprob]
        raw = logits[logprob_rows] if logprob_rows else None  # a copy, taken before any change below

        _ban_tokens(logits, rows)
        _apply_logit_bias(logits, rows)
        _apply_grammars(logits, rows)
        _apply_repetition_penalty(logits, rows)
        _apply_presence_frequency_penalties(logits, rows)

        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if greedy:
            token_ids[greedy] = _argmax(_select_rows(logits, greedy))
        if random:
            token_ids[random] = _sample_random(_select_rows(logits, random), [rows[i] for i in random])

        logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        sampled_logprobs: list[float | None] = [None] * len(rows)
        if raw is not None:
            ks = [rows[i].params.logprobs for i in logprob_rows]
            picked, entries = token_logprobs(raw, token_ids[logprob_rows], ks)
            for i, logprob, entry in zip(logprob_rows, picked, entries, strict=True):
                sampled_logprobs[i], logprobs[i] = logprob, entry
        return SamplerOutput(token_ids.tolist(), logprobs, sampled_logprobs)


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Per row of ``logits``, its ``k`` most likely tokens as (log-probability, token id), best first:
    what beam search extends each beam with."""
    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    rows = zip(top.values.tolist(), top.indices.tolist(), strict=True)
    return [list(zip(values, ids, strict=True)) for values, ids in rows]


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows: ``logits`` itself when that is all of them (no copy), else a copy."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def _ban_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    row_idx = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
    if row_idx:
        token_idx = [t for row in rows for t in row.banned_token_ids]
        logits[row_idx, token_idx] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return
    row_idx = [i for i, bias in biased for _ in bias]
    token_idx = [t for _, bias in biased for t in bias]
    values = [v for _, bias in biased for v in bias.values()]
    logits[row_idx, token_idx] += torch.tensor(values, device=logits.device)


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf for every token a constrained row's grammar forbids next; unconstrained rows are not touched."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return
    import xgrammar as xgr

    # xgrammar indexes the mask and the logits by the same row; unconstrained rows keep the all-allowed fill.
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for i in constrained:
        rows[i].grammar.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=constrained)


def _padded_ids(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad non-empty token lists into [R, L] ids plus a mask of the real entries.

    Each row is padded with copies of its own first id, so padding only reads and writes an entry the row
    touches anyway: gather/scatter on it is harmless.
    """
    lengths = torch.tensor([len(s) for s in seqs])
    # np.fromiter reads Python ints several times faster than torch.tensor(list) does.
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    real = torch.arange(int(lengths.max())) < lengths[:, None]
    ids = torch.zeros(real.shape, dtype=torch.long)
    ids[real] = torch.from_numpy(flat)  # boolean-mask assignment fills row by row, in list order
    ids = torch.where(real, ids, ids[:, :1])
    return ids.to(device), real.to(device)


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    # Only the logits of tokens already seen are touched: O(tokens) per row rather than O(vocab).
    picked = [
        (i, row.prompt_token_ids + row.output_token_ids, row.params.repetition_penalty)
        for i, row in enumerate(rows)
        if row.params.repetition_penalty != 1.0 and (row.prompt_token_ids or row.output_token_ids)
    ]
    if not picked:
        return
    device = logits.device
    row_idx = torch.tensor([i for i, _, _ in picked], device=device)[:, None]
    ids, _ = _padded_ids([seq for _, seq, _ in picked], device)
    penalty = torch.tensor([p for _, _, p in picked], device=device)[:, None]
    # Duplicate ids read the same value and write back the same result, so each token is penalized once.
    seen = logits[row_idx, ids]
    logits[row_idx, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_presence_frequency_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    picked = [
        (i, row.output_token_ids, row.params.presence_penalty, row.params.frequency_penalty)
        for i, row in enumerate(rows)
        if row.output_token_ids and (row.params.presence_penalty or row.params.frequency_penalty)
    ]
    if not picked:
        return
    device = logits.device
    row_idx = torch.tensor([i for i, _, _, _ in picked], device=device)[:, None]
    ids, real = _padded_ids([seq for _, seq, _, _ in picked], device)
    presence = torch.tensor([p for _, _, p, _ in picked], device=device)[:, None]
    frequency = torch.tensor([f for _, _, _, f in picked], device=device)[:, None]
    # Accumulating -frequency once per occurrence subtracts frequency * count; padding adds 0.
    logits.index_put_((row_idx.expand_as(ids), ids), torch.where(real, -frequency, 0.0), accumulate=True)
    # Presence is subtracted once per distinct token: duplicates write back the same value.
    seen = logits[row_idx, ids]
    logits[row_idx, ids] = seen - presence


def _blocks(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` ([N, V]) viewed as [N, V / B, B] blocks, or None when no block size divides V.

    On CPU, reductions like amax/sum run at memory speed, but argmax, cumsum and anything that allocates an
    [N, V] temporary are several times slower. Block views let the greedy and random paths find the right
    block with a cheap reduction and do the expensive part inside that block only.
    """
    n, vocab = x.shape
    for size in _BLOCK_SIZES:
        if vocab % size == 0 and vocab > size:
            return x.reshape(n, vocab // size, size)
    return None


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Same result as ``logits.argmax(-1)`` (the first maximum), much faster on CPU."""
    blocks = _blocks(logits)
    if blocks is None:
        return logits.argmax(-1)
    best_block = blocks.amax(-1).argmax(-1)
    within = blocks[torch.arange(len(blocks), device=logits.device), best_block].argmax(-1)
    return best_block * blocks.shape[2] + within


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sampled token ids for rows with temperature > 0; overwrites ``logits``."""
    if any(row.seed is None for row in rows):
        raise ValueError("every row with temperature > 0 needs a seed")
    vocab = logits.shape[1]
    # A small top-k lets topk() stand in for a full-vocabulary sort; top_k >= vocab is no truncation.
    top_k = [i for i, row in enumerate(rows) if 0 < row.params.top_k < vocab]
    full = [i for i, row in enumerate(rows) if not 0 < row.params.top_k < vocab]
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if top_k:
        token_ids[top_k] = _sample_top_k(_select_rows(logits, top_k), [rows[i] for i in top_k])
    if full:
        token_ids[full] = _sample_full_vocab(_select_rows(logits, full), [rows[i] for i in full])
    return token_ids


def _row_values(rows: list[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    """[R, 1] float32 column of one SamplingParams field, to broadcast over the vocabulary."""
    return torch.tensor([getattr(row.params, name) for row in rows], device=device)[:, None]


def _mix64(x: int) -> int:
    """splitmix64's step: a bijection of 64-bit integers whose outputs pass statistical tests for counters."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _uniforms(rows: list[SamplingRow], device: torch.device, attempt: int) -> torch.Tensor:
    """Each row's draw number `attempt`, as an [R, 1] float32 column."""
    return torch.tensor([row.uniform(attempt) for row in rows], dtype=torch.float32, device=device)[:, None]


def _search(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first position whose cdf exceeds ``target`` ([R, 1]), and the cdf just before it.

    The target is first kept strictly below the row total (u * total can round up to it), so the position
    exists and has non-zero weight.
    """
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    position = torch.searchsorted(cdf, target, right=True)
    before = torch.where(position > 0, cdf.gather(1, (position - 1).clamp_(min=0)), 0.0)
    return position.squeeze(1), before


def _draw(
    weights: torch.Tensor, rows: list[SamplingRow], index: list[int] | None = None, attempt: int = 0
) -> torch.Tensor:
    """Inverse-CDF sampling: a position per row, drawn with probability proportional to ``weights``.

    ``index`` picks the rows of ``weights`` to draw for (default: all), ``rows`` being theirs. Each row uses
    its own draw number ``attempt``, so a row's draws do not depend on the other rows.
    """
    target = _uniforms(rows, weights.device, attempt)
    picked = torch.tensor(list(range(len(weights))) if index is None else index, device=weights.device)
    blocks = _blocks(weights)
    if blocks is None:
        cdf = (weights if index is None else weights[index]).cumsum(-1)
        return _search(cdf, target * cdf[:, -1:])[0]
    # Two levels: pick a block from the block sums, then a position from the cumsum inside that block.
    # Summing every row's blocks is one cheap reduction; selecting the rows first would copy them.
    block_cdf = blocks.sum(-1)[picked].cumsum(-1)
    block, before = _search(block_cdf, target * block_cdf[:, -1:])
    inner_cdf = blocks[picked, block].cumsum(-1)
    within, _ = _search(inner_cdf, target * block_cdf[:, -1:] - before)
    return block * blocks.shape[2] + within


def _sample_top_k(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    top_k = torch.tensor([row.params.top_k for row in rows], device=device)[:, None]
    # topk() returns the candidates sorted, so top-p and min-p below are prefix operations.
    values, token_ids = logits.topk(int(top_k.max()), dim=-1)
    values = values / _row_values(rows, "temperature", device)
    values.masked_fill_(torch.arange(values.shape[1], device=device) >= top_k, float("-inf"))
    probs = values.softmax(-1)
    top_p = _row_values(rows, "top_p", device)
    # Nucleus: keep a token while the mass strictly before it is below top_p (the top token always stays).
    # top_p == 1 keeps everything even when rounding makes the running sum reach 1 early.
    mass_before = probs.cumsum(-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1.0)
    keep &= probs >= _row_values(rows, "min_p", device) * probs[:, :1]
    positions = _draw(probs.masked_fill_(~keep, 0.0), rows)
    return token_ids.gather(1, positions[:, None]).squeeze(1)


def _sample_full_vocab(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    logits.div_(_row_values(rows, "temperature", logits.device))
    # Unnormalized probabilities, in place: the largest weight is exactly exp(0) = 1, so min-p compares
    # against min_p itself; sampling and the nucleus test only need ratios to the row total.
    weights = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    total = weights.sum(-1).tolist()  # before min-p: top-p comes first, on the whole distribution
    for i, row in enumerate(rows):
        if row.params.min_p > 0.0:
            # threshold_ keeps weights strictly above its threshold; the float32 just below min_p keeps
            # weights equal to it (min_p = 1 keeps the top token). Per row: batched masks are slow on CPU.
            below_min_p = float(np.nextafter(np.float32(row.params.min_p), np.float32(0.0)))
            F.threshold_(weights[i], below_min_p, 0.0)
    positions = _draw(weights, rows)
    _resample_outside_nucleus(weights, total, positions, rows)
    return positions


def _resample_outside_nucleus(
    weights: torch.Tensor, total: list[float], positions: torch.Tensor, rows: list[SamplingRow]
) -> None:
    """Enforce top-p on full-vocabulary draws by rejection sampling instead of sorting the vocabulary.

    A token is in the nucleus iff the mass of strictly more likely tokens is below top_p * total. Zeroing
    every token no more likely than the drawn one leaves exactly that mass to sum. On rejection, what is
    left is also exactly the set that may still hold nucleus tokens, so the row redraws from it; accepted
    draws are distributed as the renormalized nucleus. One or two rounds usually suffice. Zeroing the least
    likely tokens (min-p) before the test does not change the mass above any token still drawable.
    Overwrites ``weights`` and updates ``positions`` in place.
    """
    pending = [i for i, row in enumerate(rows) if row.params.top_p < 1.0]
    budget = {i: rows[i].params.top_p * total[i] for i in pending}
    attempt = 0
    while pending:
        drawn = weights[pending, positions[pending]].tolist()
        # Per-row threshold_ works in place; on CPU, batched masking allocates [N, V] temporaries and runs
        # several times slower. Rows decided earlier are summed too: cheaper than selecting the pending ones.
        for i, w in zip(pending, drawn, strict=True):
            F.threshold_(weights[i], w, 0.0)
        mass_above = weights.sum(-1)[pending].tolist()
        pending = [i for i, mass in zip(pending, mass_above, strict=True) if mass >= budget[i]]
        if pending:
            attempt += 1
            positions[pending] = _draw(weights, [rows[i] for i in pending], pending, attempt)


def token_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]
) -> tuple[list[float], list[dict[int, Logprob] | None]]:
    """Per row of ``raw`` (unmodified logits): the log-probability of ``tokens[row]``, and where ``ks[row]``
    is not None a dict of that token and the top-``ks[row]`` tokens, each with its rank (1 + the number of
    tokens with a strictly larger logit).

    Overwrites ``raw``.
    """
    # Asking for more than V gets all V.
    k = min(max(k or 0 for k in ks), raw.shape[1])
    top_logit, top_ids = raw.topk(k, dim=-1)
    sampled_logit = raw.gather(1, tokens[:, None])
    # Ranking by raw logits equals ranking by logprob (a per-row shift) without rounding ties. An int32
    # count is about twice as fast as the default int64 one on CPU.
    sampled_rank = ((raw > sampled_logit).sum(-1, dtype=torch.int32) + 1).tolist()
    # logsumexp, computed in place to avoid an [N, V] temporary.
    row_max = raw.amax(-1, keepdim=True)
    log_norm = raw.sub_(row_max).exp_().sum(-1, keepdim=True).log_().add_(row_max)
    sampled_logprob = (sampled_logit - log_norm).squeeze(1).tolist()
    top_logprob = (top_logit - log_norm).tolist()
    top_logit_list, top_ids_list = top_logit.tolist(), top_ids.tolist()

    entries: list[dict[int, Logprob] | None] = []
    for j, (row_k, token) in enumerate(zip(ks, tokens.tolist(), strict=True)):
        if row_k is None:
            entries.append(None)
            continue
        entry = {token: Logprob(sampled_logprob[j], sampled_rank[j])}
        rank = 0
        for pos in range(min(row_k, k)):
            # Tied logits share a rank: 1 + the number of strictly larger ones, all earlier in the top-k.
            if pos == 0 or top_logit_list[j][pos] < top_logit_list[j][pos - 1]:
                rank = pos + 1
            entry[top_ids_list[j][pos]] = Logprob(top_logprob[j][pos], rank)
        entries.append(entry)
    return sampled_logprob, entries
