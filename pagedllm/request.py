"""One request as the scheduler sees it: its sequences (n samples, best_of, or beams), scheduled,
preempted and swapped together."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.beam_search import BeamState
from pagedllm.sequence import Sequence


@dataclass(eq=False, slots=True)
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    pending_forks: int = 0  # parallel samples still to fork from the first sequence at its first token
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held when it was first admitted
    beam: BeamState | None = None  # set for beam search requests

    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.status.finished]

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(seq.status.finished for seq in self.seqs)
