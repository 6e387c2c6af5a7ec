"""Iteration-level scheduling: which tokens of which sequences run in this step.

One mechanism for everything (as in vLLM's v1 core): a sequence asks for
`len(token_ids) - num_computed_tokens` new tokens, capped by the step's token
budget. A fresh prompt, the next chunk of a long prompt, a recompute after
preemption and a decode token differ only in that number.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits pick the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve_or_preempt(seq, num_new, out):
                break  # `seq` itself was the newest and got preempted
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Reserve slots for `seq`, preempting the most recently admitted sequences until it fits."""
        while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop its KV; it re-enters at the head of the queue, so the
        preempted resume before anything newer, in their original order."""
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.kv.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
