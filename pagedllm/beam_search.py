"""Beam search on forked sequences: each step keeps the `beam_width` best continuations of all
live beams; a beam chosen more than once forks (its blocks shared copy-on-write), a beam not chosen
is dropped and its blocks return to the pool. Scores follow vLLM: cumulative logprob divided by
length ** length_penalty (length counts the prompt, and not a final EOS)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.sequence import Sequence

# One beam's best continuations after its last token: (raw log-probability, token id), best first.
TopLogprobs = list[tuple[float, int]]


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")


@dataclass(slots=True)
class Candidate:
    parent: Sequence
    token: int
    cumulative_logprob: float


@dataclass(slots=True)
class FinishedBeam:
    token_ids: list[int]  # prompt and output
    cumulative_logprob: float
    ended_with_eos: bool


@dataclass(slots=True)
class BeamState:
    params: BeamSearchParams
    eos_ids: frozenset[int]
    finished: list[FinishedBeam] = field(default_factory=list)
    rows: dict[int, TopLogprobs] = field(default_factory=dict)  # seq_id -> its best 2·width continuations
    steps: int = 0

    def ready(self, live: list[Sequence]) -> bool:
        """Every live beam has its next-token distribution (beams may finish a recompute at different steps)."""
        return bool(live) and all(seq.seq_id in self.rows for seq in live)

    @property
    def num_candidates(self) -> int:
        """How many continuations of each beam can matter: enough to fill the width after EOS picks."""
        return 2 * self.params.beam_width

    def choose(self, live: list[Sequence]) -> list[Candidate]:
        """The best `beam_width` of each beam's top 2·width continuations; EOS picks finish a beam."""
        width = self.params.beam_width
        candidates = []
        for seq in live:
            for logprob, token in self.rows.pop(seq.seq_id):
                candidates.append(Candidate(seq, token, seq.cumulative_logprob + logprob))
        candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        self.steps += 1
        chosen = []
        for candidate in candidates[:width]:
            if candidate.token in self.eos_ids and not self.params.ignore_eos:
                tokens = [*candidate.parent.token_ids, candidate.token]
                self.finished.append(FinishedBeam(tokens, candidate.cumulative_logprob, True))
            else:
                chosen.append(candidate)
        return chosen

    def ranked(self) -> list[FinishedBeam]:
        def score(beam: FinishedBeam) -> float:
            length = len(beam.token_ids) - beam.ended_with_eos
            return beam.cumulative_logprob / length**self.params.length_penalty

        return sorted(self.finished, key=score, reverse=True)[: self.params.beam_width]
