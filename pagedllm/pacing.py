"""How many pooling tokens a step that also runs generation may carry, from measured step times.

A pooling prompt (an embedding, a score) is prefill only: its tokens cost compute, nothing else, and nobody
watches them arrive. A generating sequence beside it is someone's stream: every step it is in gets one token
nearer. So while generation runs, pooling prompts get only the tokens that stretch a step by at most
`stretch` of a step without them (a flood of embeddings then costs a chat stream at most 1 + stretch times
its time per token); with no generation running they get the whole budget. A step's time is modelled as a
generation-only part plus a cost per pooled token, each a running mean of measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass

_SMOOTHING = 0.2  # weight of the newest step in each running mean
FIRST_BUDGET = 16  # pooled tokens a step may carry before any step with them was measured


@dataclass(slots=True)
class PoolingPace:
    stretch: float  # the share of a generation-only step that pooled tokens may add to it
    base_seconds: float = 0.0  # a step's time without pooled tokens (running mean)
    token_seconds: float = 0.0  # the time one pooled token adds (running mean)

    def record(self, seconds: float, num_pooled_tokens: int) -> None:
        """A step took `seconds` carrying `num_pooled_tokens` (steps with generation only: the others tell
        nothing of what pooling costs a stream)."""
        if num_pooled_tokens == 0:
            self.base_seconds = _mean(self.base_seconds, seconds)
        elif self.base_seconds:
            extra = max(seconds - self.base_seconds, 0.0) / num_pooled_tokens
            self.token_seconds = _mean(self.token_seconds, extra)

    def budget(self) -> int:
        """Pooled tokens the next step with generation may carry (at least one, so pooling never starves)."""
        if not self.token_seconds or not self.base_seconds:
            return FIRST_BUDGET
        return max(1, int(self.stretch * self.base_seconds / self.token_seconds))


def _mean(mean: float, value: float) -> float:
    return value if mean == 0.0 else mean + _SMOOTHING * (value - mean)
