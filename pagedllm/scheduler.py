"""Iteration-level scheduling: which tokens of which sequences run in this step.

One mechanism for everything (as in vLLM's v1 core): a sequence asks for
`len(token_ids) - num_computed_tokens` new tokens, capped by the step's token
budget. A fresh prompt, the next chunk of a long prompt, a recompute after
preemption and a decode token differ only in that number. Requests (groups of
sequences: n samples, beams) are admitted, preempted and swapped as a whole.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.kv.kv_cache_manager import BlockPair, KVCacheManager
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits pick the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Carried out by the cache engine before the forward pass, in this order: swap_out, copies, swap_in.
    # (Swapping out first keeps a block's content safe when the same step hands the block to someone else.)
    swap_out: list[BlockPair] = field(default_factory=list)
    copies: list[BlockPair] = field(default_factory=list)
    swap_in: list[BlockPair] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(group.live_seqs()) for group in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._swap_in(out, budget)
            # While a request waits swapped out, new prompts wait behind it: no starvation.
            if not self.swapped:
                self._admit_waiting(out, budget)
        return out

    # ---- running requests -------------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            mark = len(out.scheduled)
            spent = self._schedule_group(group, out, budget, may_preempt=True)
            if spent is None:
                del out.scheduled[mark:]  # the group itself was preempted
                break
            budget -= spent
            index += 1
        return budget

    def _schedule_group(self, group: SequenceGroup, out: SchedulerOutput, budget: int, may_preempt: bool) -> int | None:
        """Schedule the group's sequences; returns the tokens spent, or None if the group itself was
        preempted to make room."""
        spent = 0
        for seq in group.live_seqs():
            num_new = min(seq.num_uncomputed_tokens, budget - spent)
            if num_new == 0:
                continue  # budget spent, or a beam already waiting for its siblings
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new, out.copies):
                if not may_preempt:
                    return spent  # the rest keep their place and run next step
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is group:
                    return None
            out.scheduled.append(ScheduledSeq(seq, num_new))
            spent += num_new
        return spent

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Swap the whole request out if asked and there is CPU room (a forked request keeps its
        branches that way); otherwise drop its KV and recompute it later, ahead of newer requests."""
        seqs = group.live_seqs()
        ids = [seq.seq_id for seq in seqs]
        self.num_preemptions += 1
        out.preempted.append(group)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(ids):
            out.swap_out.extend(self.kv.swap_out(ids))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.num_swap_preemptions += 1
            return
        for seq in seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0:
            group = self.swapped[0]
            ids = [seq.seq_id for seq in group.live_seqs()]
            # Room for its blocks plus one new block per sequence, so it can take its next step.
            if self.kv.blocks_to_swap_in(ids) + len(ids) > self.kv.pool.num_free:
                break
            if self.num_running_seqs + len(ids) > self.max_num_seqs:
                break
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(ids))
            for seq in group.live_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            budget -= self._schedule_group(group, out, budget, may_preempt=False) or 0
        return budget

    # ---- new and recomputed requests --------------------------------------------------------

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            group = self.waiting[0]
            seqs = group.live_seqs()
            if self.num_running_seqs + len(seqs) > self.max_num_seqs:
                return
            mark, copies = len(out.scheduled), len(out.copies)
            hits = [self._open(seq) for seq in seqs]
            spent = self._reserve_all(seqs, out, budget)
            if spent is None or not self._has_headroom(len(seqs)):
                for seq in seqs:
                    self.kv.free(seq.seq_id)
                    seq.num_computed_tokens = 0
                del out.scheduled[mark:], out.copies[copies:]
                return
            for seq, hit in zip(seqs, hits, strict=True):
                self.kv.record_prefix_query(seq.num_tokens, hit)
                seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(group)
            budget -= spent

    def _has_headroom(self, num_new_seqs: int) -> bool:
        """Admit only while every running sequence could still grow by one block: filling the pool to
        the brim means preempting (and recomputing) the newcomer a step later, over and over."""
        if not self.running:
            return True
        return self.kv.pool.num_free >= self.num_running_seqs + num_new_seqs

    def _open(self, seq: Sequence) -> int:
        """Start the sequence's block table from the prefix cache; returns the tokens it covers."""
        hit = self.kv.start_sequence(seq.seq_id, seq.token_ids, seq.cache_salt)
        seq.num_computed_tokens = hit
        return hit

    def _reserve_all(self, seqs: list[Sequence], out: SchedulerOutput, budget: int) -> int | None:
        spent = 0
        for seq in seqs:
            num_new = min(seq.num_uncomputed_tokens, budget - spent)
            if num_new == 0:
                continue
            if not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new, out.copies):
                return None
            out.scheduled.append(ScheduledSeq(seq, num_new))
            spent += num_new
        return spent

    # ---- after the step ---------------------------------------------------------------------

    def register_computed(self, scheduled: list[ScheduledSeq]) -> None:
        for item in scheduled:
            self.kv.register_computed(item.seq.seq_id, item.seq.token_ids, item.seq.num_computed_tokens)

    def fork(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        self.kv.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)

    def drop(self, group: SequenceGroup, seq: Sequence) -> None:
        """A sequence that is not continued (a beam nobody chose): its blocks go back at once."""
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        group.seqs.remove(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.kv.free(seq.seq_id)

    def remove(self, group: SequenceGroup) -> None:
        """Take a finished or aborted request out of whichever queue holds it."""
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
