"""Batched next-token sampler: one row of float32 logits per sequence that samples this step.

Follows vLLM's semantics. Logprobs come from the model's raw logits. Then, in order: banned tokens are set to
-inf, the repetition penalty is applied over prompt + output tokens, presence/frequency penalties over output
tokens; greedy rows take the argmax; random rows are divided by their temperature, truncated by top-k, top-p
and min-p, and sampled with the row's own generator, so a seeded request draws the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams

# torch's argmax is several times slower than amax on CPU (tracking the index defeats vectorization), so
# greedy rows first find the block holding the maximum with amax and then take the argmax inside it.
_ARGMAX_BLOCK = 256


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # per-sequence RNG; None only for greedy rows
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS + stop_token_ids while len(output) < min_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None unless params.logprobs is set; else the sampled token and the top-`logprobs` tokens of
    # the raw distribution, each with rank = 1 + the number of tokens with a strictly larger logit.
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    """Picks one token per row of ``logits`` ([N, V] float32).

    ``logits`` is overwritten: it is the engine's per-step scratch tensor, and working in place avoids
    allocating [N, V] temporaries, which dominates the cost on CPU.
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must have shape [{len(rows)}, vocab], got {list(logits.shape)}")
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw = logits[logprob_rows] if logprob_rows else None  # a copy, taken before any change below

        _ban_tokens(logits, rows)
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
        if raw is not None:
            entries = _logprobs(raw, token_ids[logprob_rows], [rows[i] for i in logprob_rows])
            for i, entry in zip(logprob_rows, entries, strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows: ``logits`` itself when that is all of them (no copy), else a copy."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def _ban_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    row_idx = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
    if row_idx:
        token_idx = [t for row in rows for t in row.banned_token_ids]
        logits[row_idx, token_idx] = float("-inf")


def _padded_ids(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad non-empty token lists into [R, L] ids plus a mask of the real entries.

    Each row is padded with copies of its own first id, so padding only reads and writes an entry the row
    touches anyway: gather/scatter on it is harmless.
    """
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [s[0]] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    real = torch.arange(width, device=device) < lengths[:, None]
    return ids, real


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


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Same result as ``logits.argmax(-1)`` (first maximum), faster on CPU."""
    n, vocab = logits.shape
    if vocab % _ARGMAX_BLOCK:
        return logits.argmax(-1)
    blocks = logits.reshape(n, vocab // _ARGMAX_BLOCK, _ARGMAX_BLOCK)
    best_block = blocks.amax(-1).argmax(-1)
    within = blocks[torch.arange(n, device=logits.device), best_block].argmax(-1)
    return best_block * _ARGMAX_BLOCK + within


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sampled token ids for rows with temperature > 0; overwrites ``logits``."""
    if any(row.generator is None for row in rows):
        raise ValueError("every row with temperature > 0 needs a generator")
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


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row from the row's own generator, as an [R, 1] column."""
    draws = [torch.rand(1, generator=row.generator, device=row.generator.device) for row in rows]
    return torch.cat(draws).to(device)[:, None]


def _draw(weights: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Inverse-CDF sampling: per row, a position drawn with probability proportional to ``weights``.

    Costs one uniform per row, so a row's draws do not depend on the other rows.
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    # u < 1, but u * total can round up to total; keeping the target strictly below total guarantees that
    # the first cdf entry above it exists and belongs to a token of non-zero weight.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(_uniforms(rows, weights.device) * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


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
    device = logits.device
    logits.div_(_row_values(rows, "temperature", device))
    # Unnormalized probabilities, in place: the largest weight is exactly exp(0) = 1, so min-p compares
    # against min_p directly; sampling and the nucleus test only need ratios to the row total.
    weights = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    total = weights.sum(-1, keepdim=True)  # before min-p: top-p comes first, on the whole distribution
    min_p = _row_values(rows, "min_p", device)
    if any(row.params.min_p > 0.0 for row in rows):
        weights.masked_fill_(weights < min_p, 0.0)
    positions = _draw(weights, rows)
    _resample_outside_nucleus(weights, total, positions, rows)
    return positions


def _resample_outside_nucleus(
    weights: torch.Tensor, total: torch.Tensor, positions: torch.Tensor, rows: list[SamplingRow]
) -> None:
    """Enforce top-p on full-vocabulary draws without sorting the vocabulary (rejection sampling).

    A token is in the nucleus iff the mass of strictly more likely tokens is below top_p * total. A rejected
    token shows that every token no more likely than it is outside too, so those are zeroed and the row
    redraws; accepted draws are distributed as the nucleus renormalized. Usually one or two rounds suffice,
    which beats sorting the vocabulary by far on CPU. Zeroing a suffix of the likelihood order (min-p, here)
    leaves the mass above any remaining token unchanged, so the test stays valid on ``weights``.
    Overwrites ``weights`` and updates ``positions`` in place.
    """
    pending = [i for i, row in enumerate(rows) if row.params.top_p < 1.0]
    if not pending:
        return
    w = _select_rows(weights, pending)
    budget = total[pending] * _row_values([rows[i] for i in pending], "top_p", weights.device)
    while True:
        sampled = w.gather(1, positions[pending][:, None])
        mass_above = torch.where(w > sampled, w, 0.0).sum(-1, keepdim=True)
        rejected = (mass_above >= budget).squeeze(1).tolist()
        keep = [j for j, r in enumerate(rejected) if r]
        if not keep:
            return
        if len(keep) < len(pending):
            pending = [pending[j] for j in keep]
            w, sampled, budget = w[keep], sampled[keep], budget[keep]
        w.masked_fill_(w <= sampled, 0.0)
        positions[pending] = _draw(w, [rows[i] for i in pending])


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[dict[int, Logprob]]:
    """Logprob dicts (sampled token + top-k) from the unmodified logits of the rows that asked."""
    log_norm = raw.logsumexp(-1, keepdim=True)
    sampled_logit = raw.gather(1, tokens[:, None])
    # Ranking by raw logits equals ranking by logprob (a per-row shift) without rounding ties.
    sampled_rank = ((raw > sampled_logit).sum(-1) + 1).tolist()
    sampled_logprob = (sampled_logit - log_norm).squeeze(1).tolist()
    k = max(row.params.logprobs for row in rows)
    top_logit, top_ids = raw.topk(k, dim=-1)
    top_logprob = (top_logit - log_norm).tolist()
    top_logit_list, top_ids_list = top_logit.tolist(), top_ids.tolist()

    entries = []
    for j, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
        entry = {token: Logprob(sampled_logprob[j], sampled_rank[j])}
        rank = 0
        for pos in range(row.params.logprobs):
            # Tied logits share a rank: 1 + the number of strictly larger ones, all earlier in the top-k.
            if pos == 0 or top_logit_list[j][pos] < top_logit_list[j][pos - 1]:
                rank = pos + 1
            entry[top_ids_list[j][pos]] = Logprob(top_logprob[j][pos], rank)
        entries.append(entry)
    return entries
