"""How many pooling tokens a step that also runs generation may carry, from measured step times.

A pooling prompt (an embedding, a score) is prefill only: its tokens cost compute, nothing else, and nobody
watches them arrive. A generating sequence beside it is someone's stream: every step it is in gets one token
nearer. So while generation runs, pooling prompts get only the tokens that stretch a step by at most
`stretch` of a step without them (a flood of embeddings then costs a chat stream at most 1 + stretch times
its time per token); with no generation running they get the whole budget. A step's time is modelled as a
generation-only part plus a cost per pooled token, each a running mean of measured steps. Under a flood every
step would carry pooled tokens, and the generation-only part would never be measured again (nor ever, were the
flood there first): so one step in `PROBE_EVERY` carries none.
"""

from __future__ import annotations

from dataclasses import dataclass

_SMOOTHING = 0.2  # weight of the newest step in each running mean
FIRST_BUDGET = 16  # pooled tokens a step may carry before any step with them was measured
PROBE_EVERY = 16  # steps with generation between two that carry no pooled tokens (measuring the step without)


@dataclass(slots=True)
class PoolingPace:
    stretch: float  # the share of a generation-only step that pooled tokens may add to it
    base_seconds: float | None = None  # a step's time without pooled tokens (running mean)
    # What pooled tokens added to their steps, and how many they were (running means): their ratio is a token's
    # cost. A ratio of means, not a mean of ratios: a step of one pooled token measures mostly the clock's noise.
    extra_seconds: float | None = None
    pooled_tokens: float | None = None
    since_probe: int = PROBE_EVERY  # steps with generation since the last without pooled tokens

    def record(self, seconds: float, num_pooled_tokens: int) -> None:
        """A step took `seconds` carrying `num_pooled_tokens` (steps with generation only: the others tell
        nothing of what pooling costs a stream)."""
        if num_pooled_tokens == 0:
            self.base_seconds = _mean(self.base_seconds, seconds)
            self.since_probe = 0
            return
        self.since_probe += 1
        if self.base_seconds is not None:
            self.extra_seconds = _mean(self.extra_seconds, seconds - self.base_seconds)
            self.pooled_tokens = _mean(self.pooled_tokens, num_pooled_tokens)

    def budget(self) -> int:
        """Pooled tokens the next step with generation may carry: none on a probe, else at least one (so
        pooling never starves)."""
        if self.since_probe >= PROBE_EVERY or self.base_seconds is None:
            return 0
        if self.extra_seconds is None or self.pooled_tokens is None:
            return FIRST_BUDGET
        # The budget at most doubles what steps have carried: tokens measured as nearly free (the clock's noise
        # around a small cost) are tried in growing steps, not all at once.
        token_seconds = max(self.extra_seconds, 0.0) / self.pooled_tokens
        grown = int(2 * self.pooled_tokens) + FIRST_BUDGET
        return max(1, min(grown, int(self.stretch * self.base_seconds / max(token_seconds, 1e-12))))


def _mean(mean: float | None, value: float) -> float:
    return value if mean is None else mean + _SMOOTHING * (value - mean)
