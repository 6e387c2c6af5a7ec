"""The near-tie rule for comparing two greedy runs, shared by the tests and `pagedllm bench throughput`.

Two greedy runs agree when their tokens are equal. Where they part, only the first divergence can be
judged (after it the contexts differ): it is a near-tie when the float32 reference gives the two tokens
chosen there log-probabilities within `NEAR_TIE` nats of each other, so that rounding differences of
the size the runs may have can account for the different choice. Anything else is a failure, and a
caller states how many sequences it expects to agree exactly, since a rule that excuses near-ties
would otherwise also excuse an engine that is always slightly wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Nats of float32 log-probability. One bf16 rounding step of a logit is about 0.06 in test_bf16's
# models; float32 engines part from transformers only where two logits agree to far less.
NEAR_TIE = 0.2


@dataclass(slots=True)
class Comparison:
    exact: int
    near_ties: int
    failures: list[str]

    def require(self, min_exact: int) -> None:
        """Fail on any divergence that is not a near-tie, or on fewer than `min_exact` exact sequences."""
        assert not self.failures, self.failures
        assert self.exact >= min_exact, f"{self.exact} sequences exact ({self.near_ties} near-ties), {min_exact} needed"


def float32_logprobs(model: torch.nn.Module, context: list[int]) -> torch.Tensor:
    """A float32 `transformers` model's log-probabilities (on the CPU) of the token after `context`: what
    `compare_sequences` judges a divergence by."""
    with torch.inference_mode():
        logits = model(torch.tensor([context], device=model.device)).logits[0, -1]
    return logits.float().log_softmax(-1).cpu()


def compare_sequences(
    pairs: Sequence[tuple[list[int], list[int]]],
    logprobs_at: Callable[[int, int], torch.Tensor],
) -> Comparison:
    """Each (ours, theirs) pair of greedy sequences: equal, or parted at a near-tie. `logprobs_at(i, at)`
    gives the float32 reference's log-probabilities after pair i's common first `at` tokens."""
    exact, near, failures = 0, 0, []
    for i, (ours, theirs) in enumerate(pairs):
        if ours == theirs:
            exact += 1
            continue
        at = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if at is None:
            failures.append(f"sequence {i}: one is a prefix of the other ({len(ours)} vs {len(theirs)} tokens)")
            continue
        logprobs = logprobs_at(i, at)
        gap = abs(float(logprobs[ours[at]] - logprobs[theirs[at]]))
        if gap <= NEAR_TIE:
            near += 1
        else:
            failures.append(
                f"sequence {i} parts at token {at}: {ours[at]} vs {theirs[at]}, float32 log-prob gap {gap:.3f}"
            )
    return Comparison(exact, near, failures)
