"""Iteration-level scheduling: which tokens of which sequences run in this step, and everything that
follows from the step's sampled tokens.

One mechanism for everything (as in vLLM's v1 core): a sequence asks for
`len(token_ids) - num_computed_tokens` new tokens, capped by the step's token
budget. A fresh prompt, the next chunk of a long prompt, a recompute after
preemption and a decode token differ only in that number. Requests (groups of
sequences: n samples, beams) are admitted, preempted and swapped as a whole.

`schedule()` says what the worker runs; `update()` takes what it returned and does all the
bookkeeping: computed tokens, prefix-cache registration, forks, beams, stops and freed blocks. The
scheduler is the only owner of the KV cache manager.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass

from pagedllm.beam_search import Candidate, FinishedBeam
from pagedllm.kv.events import KVEventSink
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.outputs import EngineStats, KVSnapshot, SequenceKV
from pagedllm.request import SequenceGroup
from pagedllm.sequence import Sequence, SequenceFactory, SequenceStatus
from pagedllm.speculative import SpeculativeConfig
from pagedllm.step import ModelOutput, NewToken, RowOutput, SampleRow, ScheduledSeq, SchedulerOutput, StepUpdate
from pagedllm.stopping import StopDecision, grammar_stop, length_stop, token_stop


@dataclass(slots=True)
class SpecCounts:
    """Speculative decoding so far: proposals checked, tokens they guessed, and guesses the target agreed with."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str,
        sequences: SequenceFactory,
        eos_ids: frozenset[int],
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 0,
    ) -> None:
        self.kv = kv
        self.max_loras = max_loras  # distinct LoRA adapters running at once
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.sequences = sequences
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.waiting: deque[SequenceGroup] = deque()
        # Pooling requests (embeddings, scores) wait apart: generation is admitted first, and while it runs they
        # get at most `pooling_budget` tokens a step (the engine sets it from measured steps: `pacing.py`).
        self.waiting_pooled: deque[SequenceGroup] = deque()
        self.pooling_budget: int | None = None
        self._pool_left: int | None = None  # this step's pooled tokens still to give (None: no cap)
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.groups: dict[str, SequenceGroup] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.speculative = speculative
        self._speculating = False  # this step's decision: speculation pays at low batch only
        self.spec = SpecCounts()
        self.num_pooled_requests = 0  # pooling requests finished, and their prompt tokens
        self.num_pooled_tokens = 0

    def check_fits(self, num_prompt_tokens: int, num_tokens: int, num_seqs: int) -> None:
        """Refuse a request that could never run: its `num_seqs` sequences (n samples, best_of or beams, each
        up to `num_tokens` long) need more sequence slots than max_num_seqs, or more blocks than the whole
        pool even sharing the prompt's full blocks (a preempted request runs again only once it fits)."""
        if num_seqs > self.max_num_seqs:
            raise ValueError(
                f"request runs {num_seqs} sequences (n, best_of or beam width) but max_num_seqs is {self.max_num_seqs}"
            )
        per_seq = self.kv.blocks_to_hold(num_tokens, self.max_num_batched_tokens)
        # Forks share the prompt's full blocks; where layers slide, those go, so no sharing is counted on.
        shared = 0 if self.kv.sliding_window else min(num_prompt_tokens // self.kv.block_size, per_seq)
        need = shared + num_seqs * (per_seq - shared)
        if need > self.kv.num_blocks:
            sequences = "" if num_seqs == 1 else f" for its {num_seqs} sequences (n, best_of or beam width)"
            raise ValueError(f"request needs {need} KV blocks{sequences} but the whole pool has {self.kv.num_blocks}")

    def add(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group
        self._queue_of(group).append(group)

    def _queue_of(self, group: SequenceGroup) -> deque[SequenceGroup]:
        return self.waiting_pooled if group.seqs[0].pool is not None else self.waiting

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.waiting_pooled or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(group.live_seqs()) for group in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        spec = self.speculative
        self._speculating = spec is not None and self.num_running_seqs <= spec.disable_by_batch_size
        # Paced only on an engine that pools (its budget is set) while generation runs or waits.
        self._pool_left = self.pooling_budget if self.pooling_budget is not None and self._generating() else None
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._swap_in(out, budget)
            # While a request waits swapped out, new prompts wait behind it: no starvation.
            if not self.swapped:
                self._admit_waiting(out, budget)
        for item in out.scheduled:
            item.block_table = self.kv.block_table(item.seq.seq_id)
        self._plan_samples(out)
        return out

    def _generating(self) -> bool:
        """Whether a generation request is running or waits: its stream is paced, pooling yields to it."""
        if self.waiting:
            return True
        return any(group.seqs[0].pool is None for queue in (self.running, self.swapped) for group in queue)

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
        """Schedule the group's sequences; returns the tokens spent, or None when the pool ran short (with
        `may_preempt`, only when the group itself was preempted to make room)."""
        spent = 0
        for seq in group.live_seqs():
            num_new = min(seq.num_uncomputed_tokens, budget - spent)
            paced = seq.pool is not None and self._pool_left is not None
            if paced:
                num_new = min(num_new, self._pool_left)
            if num_new == 0:
                continue  # budget spent, or a beam already waiting for its siblings
            num_drafts, drafts = self._drafts(group, seq, budget - spent)
            if num_drafts and self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, 1 + num_drafts, out.copies):
                out.scheduled.append(ScheduledSeq(seq, 1 + num_drafts, draft_token_ids=drafts, num_drafts=num_drafts))
                spent += 1 + num_drafts
                continue
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new, out.copies):
                if not may_preempt:
                    return None
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is group:
                    return None
            out.scheduled.append(ScheduledSeq(seq, num_new))
            spent += num_new
            if paced:
                self._pool_left -= num_new
        return spent

    def _drafts(self, group: SequenceGroup, seq: Sequence, budget: int) -> tuple[int, list[int]]:
        """How many guesses follow a decoding sequence's next token, when this step speculates (never past its
        max_tokens, the model's length or the step's budget), and the n-gram proposer's guesses. Beam search
        does not speculate."""
        if not self._speculating or group.beam is not None or seq.num_uncomputed_tokens != 1:
            return 0, []
        if seq.num_output_tokens == 0:
            return 0, []  # its prompt's last token: parallel samples fork from that row
        assert self.speculative is not None
        limit = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens, budget) - 1
        return self.speculative.propose(seq.token_ids, limit)

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
        self._release(seqs)
        for seq in seqs:
            seq.status = SequenceStatus.WAITING
        self._queue_of(group).appendleft(group)

    def _release(self, seqs: list[Sequence]) -> None:
        """Drop the sequences' KV: they will be computed again from the start."""
        for seq in seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            if seq.pool is not None:
                seq.pool.reset()

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0:
            group = self.swapped[0]
            ids = [seq.seq_id for seq in group.live_seqs()]
            # Room for its blocks plus one new block per sequence, so it can take its next step.
            if self.kv.blocks_to_swap_in(ids) + len(ids) > self.kv.pool.num_free:
                break
            if self.num_running_seqs + len(ids) > self.max_num_seqs or not self._adapter_fits(group):
                break
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(ids))
            for seq in group.live_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            mark = len(out.scheduled)
            self._schedule_group(group, out, budget, may_preempt=False)  # what is left runs next step
            budget -= sum(item.num_new_tokens for item in out.scheduled[mark:])
        return budget

    # ---- new and recomputed requests --------------------------------------------------------

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order, generation first, then pooling ones while none of the former waits;
        one whose adapter would be one too many waits (those behind it may still run: the base model's, and
        those of adapters already running)."""
        for queue in (self.waiting, self.waiting_pooled):
            if queue is self.waiting_pooled and self.waiting:
                return  # what blocked a generation request would block it again: pooling must not take its room
            passed: list[SequenceGroup] = []
            try:
                budget = self._admit_in_order(out, budget, passed, queue)
            finally:
                queue.extendleft(reversed(passed))

    def _admit_in_order(
        self, out: SchedulerOutput, budget: int, passed: list[SequenceGroup], queue: deque[SequenceGroup]
    ) -> int:
        """Admit from `queue` until the budget, the sequence slots or the pool run out; returns the budget left."""
        while queue and budget > 0:
            group = queue[0]
            if queue is self.waiting_pooled and self._pool_left == 0:
                return budget
            if not self._adapter_fits(group):
                passed.append(queue.popleft())
                continue
            seqs = group.live_seqs()
            if self.num_running_seqs + len(seqs) > self.max_num_seqs or not self._fits_whole(group, budget):
                return budget
            mark, copies = len(out.scheduled), len(out.copies)
            hits = [self._open(seq) for seq in seqs]
            spent = self._schedule_group(group, out, budget, may_preempt=False)
            if spent is None or not self._has_headroom(len(seqs)):
                self._release(seqs)
                del out.scheduled[mark:], out.copies[copies:]
                return budget
            for seq, hit in zip(seqs, hits, strict=True):
                self.kv.record_prefix_query(seq.num_tokens, hit)
                seq.status = SequenceStatus.RUNNING
            if group.num_cached_tokens is None:  # a preempted request readmitted keeps its first count, as vLLM
                group.num_cached_tokens = hits[0] if hits else 0
            queue.popleft()
            self.running.append(group)
            budget -= spent
        return budget

    def _fits_whole(self, group: SequenceGroup, budget: int) -> bool:
        """Whether the group may start in this step: an encoder's prompt (bidirectional attention: every position
        depends on the later ones) runs whole or waits for a step with room; any other prompt may be chunked."""
        seq = group.seqs[0]
        if seq.pool is None or not seq.pool.pooler.bidirectional:
            return True
        room = budget if self._pool_left is None else min(budget, self._pool_left)
        return seq.num_uncomputed_tokens <= room

    def _adapter_fits(self, group: SequenceGroup) -> bool:
        """Whether the group's adapter (if any) is running already or one more fits under max_loras."""
        lora = group.seqs[0].lora
        if lora is None:
            return True
        running = {g.seqs[0].lora.lora_int_id for g in self.running if g.seqs[0].lora is not None}
        return lora.lora_int_id in running or len(running) < self.max_loras

    def _has_headroom(self, num_new_seqs: int) -> bool:
        """Admit only while every running sequence could still grow by one block: filling the pool to
        the brim means preempting (and recomputing) the newcomer a step later, over and over."""
        if not self.running:
            return True
        return self.kv.pool.num_free >= self.num_running_seqs + num_new_seqs

    def _open(self, seq: Sequence) -> int:
        """Start the sequence's block table from the prefix cache; returns the tokens it covers. A sequence
        still owed prompt log-probabilities takes cached blocks only before the first position to score."""
        first_unscored = seq.num_prompt_tokens - 1 - seq.num_prompt_logprobs_missing
        lookup = seq.token_ids[: first_unscored + 1] if seq.num_prompt_logprobs_missing else seq.token_ids
        if seq.pool is not None and not seq.pool.pooler.takes_prefix_hits:
            lookup = []  # every position's hidden state is pooled (its blocks still fill the cache)
        lora_id = None if seq.lora is None else seq.lora.lora_int_id
        hit = self.kv.start_sequence(seq.seq_id, lookup, seq.block_salt, lora_id)
        seq.num_computed_tokens = hit
        return hit

    def _plan_samples(self, out: SchedulerOutput) -> None:
        """One row per sequence whose chunk completes it; a request's parallel samples fork from the
        sequence that ran the prompt, at its first token, and draw from the same logits row."""
        row = 0
        for item in out.scheduled:
            if not item.samples:
                continue
            seq = item.seq
            group = self._group_of(seq)
            if group.beam is not None:
                out.samples.append(SampleRow(seq, row, num_beam_candidates=group.beam.num_candidates))
            else:
                out.samples.append(
                    SampleRow(seq, row, draft_token_ids=item.draft_token_ids, num_drafts=item.num_drafts)
                )
                for index in range(1, group.pending_forks + 1):
                    out.samples.append(SampleRow(self.sequences.fork(seq, index), row, forked_from=seq))
            row += 1 + item.num_drafts

    def _group_of(self, seq: Sequence) -> SequenceGroup:
        return self.groups[seq.request_id]

    # ---- after the step ---------------------------------------------------------------------

    def update(self, out: SchedulerOutput, model_output: ModelOutput) -> tuple[StepUpdate, dict[str, Exception]]:
        """Account for the step: computed tokens and their cache entries, forks, the picked tokens,
        beams, and the stops that tokens and lengths decide (finished sequences free their blocks).
        A request whose grammar matcher raises on its token is left out of the update and returned with
        the error, for the caller to abort: its matchers' state is unknown."""
        for item in out.scheduled:
            # A draft's slot counts once the draft is accepted (`_settle_drafts`).
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_drafts
            self.kv.register_computed(item.seq.seq_id, item.seq.token_ids, item.seq.num_computed_tokens)
        touched = dict.fromkeys(item.seq.request_id for item in out.scheduled)
        update = StepUpdate(groups=[self.groups[request_id] for request_id in touched])
        for seq, entries in model_output.prompt_logprobs:
            seq.prompt_logprobs.extend(entries)
            update.prompt_logprobs.append((seq, entries))
        self._pool(out, model_output, update)
        # Forks first: each child must start from its parent's blocks before anyone appends or finishes.
        for sample in out.samples:
            if sample.forked_from is not None:
                self._join(sample.forked_from, sample.seq)
        beams: dict[str, SequenceGroup] = {}
        failed: dict[str, Exception] = {}
        for sample, row in zip(out.samples, model_output.rows, strict=True):
            if sample.num_beam_candidates:
                group = self._group_of(sample.seq)
                assert group.beam is not None and row.candidates is not None
                group.beam.rows[sample.seq.seq_id] = row.candidates
                beams[group.request_id] = group
                continue
            if sample.seq.request_id not in failed:
                self._take(sample, row, update, failed)
        for group in beams.values():
            self._advance_beams(group)
        if failed:
            update.new_tokens = [new for new in update.new_tokens if new.seq.request_id not in failed]
            update.groups = [group for group in update.groups if group.request_id not in failed]
        return update, failed

    def _pool(self, out: SchedulerOutput, model_output: ModelOutput, update: StepUpdate) -> None:
        """Add each pooling sequence's part of its vector; one whose prompt is computed is finished with its
        vector, and its blocks go back (full ones stay in the prefix cache)."""
        for seq, part in model_output.pooled:
            seq.pool.take(part)
        for item in out.scheduled:
            seq = item.seq  # its computed tokens have advanced: the prompt is done when they reach its end
            if seq.pool is not None and seq.num_computed_tokens == seq.num_tokens:
                self.num_pooled_requests += 1
                self.num_pooled_tokens += seq.num_tokens
                update.pooled.append((seq, seq.pool.result(seq.num_tokens)))
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _take(self, sample: SampleRow, row: RowOutput, update: StepUpdate, failed: dict[str, Exception]) -> None:
        """Append the row's picked tokens (one, or with drafts the accepted ones and the pick after them) until
        one stops the sequence; then account for the drafts."""
        seq = sample.seq
        for pick in row.tokens:
            try:
                grammar = grammar_stop(seq, pick.token_id)  # the matcher takes the token
            except Exception as error:
                failed[seq.request_id] = error
                return
            new = self._append(seq, pick, grammar)
            update.new_tokens.append(new)
            if new.stop is not None:
                break
        if sample.num_drafts:
            self._settle_drafts(seq, sample.num_drafts, len(row.following))

    def _settle_drafts(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """The accepted drafts' slots hold their K/V: they count as computed, and their full blocks enter the
        prefix cache; the rejected ones' slots are given back, and blocks left empty return to the pool."""
        self.spec.num_drafts += 1
        self.spec.num_draft_tokens += num_drafts
        self.spec.num_accepted_tokens += num_accepted
        if seq.status.finished:
            return  # its blocks are back already
        seq.num_computed_tokens += num_accepted
        self.kv.trim(seq.seq_id, seq.num_computed_tokens)
        self.kv.register_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def _join(self, parent: Sequence, child: Sequence) -> None:
        """The child enters its parent's request sharing every block (the first write copies)."""
        group = self._group_of(parent)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        group.pending_forks = 0

    def _append(self, seq: Sequence, row: RowOutput, grammar: StopDecision | None) -> NewToken:
        """Append the picked token; `grammar` is the stop the sequence's grammar decided on it."""
        seq.token_ids.append(row.token_id)
        logprob = 0.0
        if row.logprobs is not None:
            logprob = row.logprobs[row.token_id].logprob
        elif row.logprob is not None:
            logprob = row.logprob
        stop = grammar or token_stop(seq, row.token_id, self.eos_ids) or length_stop(seq, self.max_model_len)
        if stop is not None:
            self.finish(seq, stop.status)
        return NewToken(seq, row.logprobs, stop, seq.num_tokens, logprob)

    def _advance_beams(self, group: SequenceGroup) -> None:
        state = group.beam
        assert state is not None
        live = group.live_seqs()
        if not state.ready(live):
            return
        by_parent: dict[int, list[Candidate]] = defaultdict(list)
        for candidate in state.choose(live):
            by_parent[candidate.parent.seq_id].append(candidate)
        for parent in live:
            picks = by_parent.get(parent.seq_id, [])
            if not picks:
                self.finish(parent, SequenceStatus.FINISHED_ABORTED)  # a beam nobody continues gives its blocks back
                group.seqs.remove(parent)
                continue
            # Fork before appending, so each child starts from the parent's tokens as they were.
            children = [self.sequences.fork(parent, parent.index) for _ in picks[1:]]
            for child in children:
                self._join(parent, child)
            for member, pick in zip([parent, *children], picks, strict=True):
                member.token_ids.append(pick.token)
                member.cumulative_logprob = pick.cumulative_logprob
        live = group.live_seqs()
        if not live or state.steps >= state.params.max_tokens or live[0].num_tokens >= self.max_model_len:
            for seq in live:
                state.finished.append(FinishedBeam(list(seq.token_ids), seq.cumulative_logprob, False))
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def requests_moved(self, out: SchedulerOutput) -> list[str]:
        """The requests whose KV the step's block moves and forward pass write: the scheduled ones and the
        ones it swapped out."""
        scheduled = [item.seq.request_id for item in out.scheduled]
        swapped = [group.request_id for group in out.preempted if group in self.swapped]
        return list(dict.fromkeys(scheduled + swapped))

    def unrunnable(self, out: SchedulerOutput) -> SequenceGroup | None:
        """After a schedule that moved nothing although requests wait: the request at the head of the queue,
        which can never run. Nothing else holds blocks it could wait for (nothing runs), so it is either
        the one that just preempted itself, not fitting its next step in the whole pool, or the one that
        could not come back into an empty pool; every other request waits behind it."""
        if not out.is_empty or self.running:
            return None
        if out.preempted:
            return out.preempted[-1]  # what it preempted before itself was newer and is not to blame
        if self.swapped:
            return self.swapped[0]
        return self.waiting[0] if self.waiting else self.waiting_pooled[0]

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.kv.free(seq.seq_id)

    def remove(self, group: SequenceGroup) -> None:
        """Take a finished or aborted request out of whichever queue holds it; its blocks go back."""
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
        for queue in (self.running, self.waiting, self.waiting_pooled, self.swapped):
            if group in queue:
                queue.remove(group)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block; refused while any block is in use."""
        self.kv.reset_prefix_cache()

    def add_kv_event_sink(self, sink: KVEventSink) -> None:
        self.kv.add_event_sink(sink)

    def remove_kv_event_sink(self, sink: KVEventSink) -> None:
        self.kv.remove_event_sink(sink)

    # ---- numbers --------------------------------------------------------------------------

    def kv_snapshot(self, num_steps: int) -> KVSnapshot:
        """The pool and every live sequence's table, copied: call between steps, on the stepping thread."""
        pool = self.kv.snapshot()
        return KVSnapshot(
            step=num_steps,
            time=time.time(),
            block_size=pool.block_size,
            num_blocks=pool.num_blocks,
            kv_utilization=pool.kv_utilization,
            ref_counts=pool.ref_counts,
            cached=pool.cached,
            num_cpu_blocks=pool.num_cpu_blocks,
            swapped_out_blocks=pool.swapped_out_blocks,
            num_preemptions=self.num_preemptions,
            sequences=[self._sequence_kv(seq) for group in self.groups.values() for seq in group.live_seqs()],
            spec_num_drafts=self.spec.num_drafts,
            spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens,
        )

    def _sequence_kv(self, seq: Sequence) -> SequenceKV:
        record = self.kv.seqs.get(seq.seq_id)
        table = list(record.blocks) if record is not None else []
        swapped = record is not None and record.swapped
        slid_tokens = record.num_slid * self.kv.block_size if record is not None else 0
        return SequenceKV(
            request_id=seq.request_id,
            seq_id=seq.seq_id,
            status=seq.status.name.lower(),
            num_cached_tokens=max(seq.num_computed_tokens - slid_tokens, 0),
            block_table=[] if swapped else table,
            swapped_blocks=table if swapped else [],
        )

    def stats(self, num_steps: int, step_seconds: dict[str, float]) -> EngineStats:
        pool, kv = self.kv.pool, self.kv
        queries = kv.prefix_cache_queries
        return EngineStats(
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_peak=pool.peak_used,
            kv_utilization=kv.utilization(),
            num_preemptions=self.num_preemptions,
            num_running=self.num_running_seqs,
            num_waiting=sum(len(group.live_seqs()) for queue in (self.waiting, self.waiting_pooled) for group in queue),
            num_swapped=sum(len(group.live_seqs()) for group in self.swapped),
            num_swapped_out_blocks=kv.cpu_pool.num_used if kv.cpu_pool else 0,
            num_swap_preemptions=self.num_swap_preemptions,
            num_cow_copies=kv.num_cow_copies,
            blocks_saved_by_sharing=kv.blocks_saved_by_sharing(),
            prefix_cache_queries=queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_hit_rate=kv.prefix_cache_hits / queries if queries else 0.0,
            num_steps=num_steps,
            step_seconds=step_seconds,
            spec_num_drafts=self.spec.num_drafts,
            spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens,
            num_pooled_requests=self.num_pooled_requests,
            num_pooled_tokens=self.num_pooled_tokens,
        )
