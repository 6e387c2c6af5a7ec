"""The worker: carries out one `SchedulerOutput` on the tensors and returns one `ModelOutput`.

It moves and copies blocks, runs the model once over the step's flat batch, and picks a token (or a
beam's candidates) for every sample row. Every path from logits to tokens and log-probabilities goes
through the sampler here; nothing above the worker touches logits.

A stage that raises is reported as a `StageError` naming it. Once the block moves are done, the step's
tokens may be executed again, in parts and without the moves: nothing the worker did changes what they
compute (a forward pass only writes the slots of the tokens it computes, each time the same values).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.distributed import parallel
from pagedllm.kv.kv_cache_manager import BlockPair
from pagedllm.models.decoder import CausalLM
from pagedllm.models.encoder import Encoder
from pagedllm.outputs import Logprob
from pagedllm.sequence import Sequence
from pagedllm.step import ModelOutput, RowOutput, SampleRow, SchedulerOutput
from pagedllm.worker.allocator import keep_freed_memory
from pagedllm.worker.cache_engine import CacheEngine, KVShape
from pagedllm.worker.draft import DraftModel
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.model_runner import FlatBatch, ModelRunner, PoolRows, PromptRows, build_batch
from pagedllm.worker.sampler import Sampler, SamplingRow, token_logprobs, top_logprobs
from pagedllm.worker.threads import ThreadChooser

if TYPE_CHECKING:
    import xgrammar as xgr

# The stages of `Worker.execute`, as errors name them.
PREPARING = "preparing the batch"
MOVING_BLOCKS = "moving KV blocks (swap, copy-on-write)"
FORWARD = "the forward pass"
SAMPLING = "sampling"
SCORING_PROMPT = "scoring the prompt"
PROPOSING = "the draft model's guesses"
POOLING = "pooling"
LOADING_ADAPTERS = "loading LoRA adapters"
PREPARING_AFTER_MOVES = "preparing the batch after the block moves"


class StageError(RuntimeError):
    """A stage of a step raised (the original error is the cause); the message names the stage."""

    def __init__(self, stage: str, error: Exception) -> None:
        super().__init__(f"{stage} failed: {error!r}")
        self.stage = stage
        self.__cause__ = error

    @property
    def blocks_moved(self) -> bool:
        """Whether the step's block moves were done before this stage failed: if so, its tokens may run
        again without them; if not, the KV of the blocks they move is unknown."""
        return self.stage not in (PREPARING, MOVING_BLOCKS)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Report what the block raises as a `StageError` of stage `name`."""
    try:
        yield
    except Exception as error:
        raise StageError(name, error) from error


@dataclass(slots=True)
class StepInputs:
    """What every rank of a tensor-parallel group does in one step, sent once by rank 0: the block moves
    (in order: swap out, copies, swap in) and the flat batch (None when only blocks move)."""

    swap_out: list[BlockPair]
    copies: list[BlockPair]
    swap_in: list[BlockPair]
    batch: FlatBatch | None

    def for_other_ranks(self) -> StepInputs:
        """Without the sequences the prompt rows name: only rank 0 reads them, and they do not pickle. (Pooling
        engines run on one rank.)"""
        if self.batch is None or self.batch.prompt is None:
            return self
        prompt = dataclasses.replace(self.batch.prompt, spans=[])
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, prompt=prompt))


@dataclass(frozen=True, slots=True)
class ReportShards:
    """Rank 0's message, in place of a step's inputs: every rank answers with its `ShardReport`."""


@dataclass(frozen=True, slots=True)
class ShardReport:
    """What one rank holds and has done, to see that the model is really split across processes."""

    # Of its parameters as loaded and sharded; a prepacked weight counts as its plain shape (the parameter
    # stays, on the meta device, with that shape and dtype).
    parameter_bytes: int
    kv_heads: int  # of its KV cache
    collectives: parallel.CollectiveCounts  # this process's, since it joined its group (none outside one)


class StepTimer:
    """Accumulates wall time per phase of a step, so a benchmark can say where the time goes."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


class Worker:
    def __init__(
        self,
        model: CausalLM | Encoder,
        shape: KVShape,
        num_blocks: int,
        num_cpu_blocks: int,
        device: str,
        eos_ids: frozenset[int],
        leads_group: bool = False,
        draft: DraftModel | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        if device == "cpu":
            keep_freed_memory()
        self.block_size = shape.block_size
        self.lora = lora  # the LoRA adapters' slots, when the engine serves them (never in a tensor-parallel group)
        # Rank 0 of a tensor-parallel group: its steps' inputs go to the other ranks. (A process holds one
        # group at most, but may also run single-process engines beside it, which must not send.)
        self.leads_group = leads_group
        self.cache = CacheEngine(shape, num_blocks, num_cpu_blocks, device)
        self.runner = ModelRunner(model, self.cache.kv_caches, shape.block_size, device)
        self.sampler = Sampler()
        self.eos_ids = eos_ids
        self.draft = draft  # speculative decoding's draft model, which never runs in a tensor-parallel group
        # On the CPU, each step runs on as many of torch's threads as measurement says pays for its size.
        self.threads = ThreadChooser(torch.get_num_threads() if device == "cpu" else 1)

    def execute(self, out: SchedulerOutput, timer: StepTimer) -> ModelOutput:
        """Rank 0's step: the inputs go to the other ranks first, then every rank runs the same model
        call (their collectives meet), and rank 0 alone samples. A stage that raises raises `StageError`."""
        with stage(PREPARING):
            # A draft model's guesses are picked after the block moves (they write into the moved blocks), and
            # adapters are written into their slots after them (so one that fails to load fails its requests
            # alone: the engine runs each request again without the moves).
            ready = out.scheduled and self.draft is None and self.lora is None
            batch = build_batch(out.scheduled, self.block_size) if ready else None
        inputs = StepInputs(out.swap_out, out.copies, out.swap_in, batch)
        if self.leads_group:
            parallel.broadcast_from_first(inputs.for_other_ranks())
        timer.lap("prepare")
        with stage(MOVING_BLOCKS):
            self._move_blocks(inputs)
        timer.lap("swap/copy")
        lora_slots = None
        if self.lora is not None and out.scheduled:
            with stage(LOADING_ADAPTERS):
                lora_slots = self._lora_slots(out)
        if self.draft is not None and out.scheduled:
            with stage(PROPOSING):
                self.draft.propose(out.scheduled)
            timer.lap("propose")
        if batch is None and out.scheduled:
            with stage(PREPARING_AFTER_MOVES):
                batch = build_batch(out.scheduled, self.block_size, lora_slots)
        if batch is None:
            return ModelOutput()
        with self.threads.step(len(batch.input_ids)):
            with stage(FORWARD):
                if self.draft is not None:
                    self.draft.fill(batch)
                ran = self.runner.run(batch)
            timer.lap("forward")
            with torch.inference_mode():
                with stage(SAMPLING):
                    rows = self._pick(ran.logits, out.samples)
                with stage(SCORING_PROMPT):
                    prompt = [] if batch.prompt is None else self._prompt_logprobs(ran.prompt_hidden, batch.prompt)
                with stage(POOLING):
                    pooled = [] if batch.pool is None else self._pooled(ran.pool_hidden, batch.pool)
            timer.lap("sample")
        return ModelOutput(rows, prompt, pooled)

    def _lora_slots(self, out: SchedulerOutput) -> dict[int, int] | None:
        """The slot of each adapter the step runs, written into a slot first where it is not resident."""
        if self.lora is None:
            return None
        return self.lora.activate([item.seq.lora for item in out.scheduled if item.seq.lora is not None])

    def follow(self) -> None:
        """The loop of every rank but 0: carry out rank 0's steps (and answer its `ReportShards`) until it
        sends None."""
        while (message := parallel.broadcast_from_first(None)) is not None:
            if isinstance(message, ReportShards):
                parallel.gather_objects(self.shard_report())
            else:
                self._follow_step(message)

    def _follow_step(self, inputs: StepInputs) -> None:
        self._move_blocks(inputs)
        if inputs.batch is not None:
            prompt_hidden = self.runner.run(inputs.batch).prompt_hidden
            if prompt_hidden is not None:
                for _ in self.runner.prompt_logits(prompt_hidden):
                    pass  # the logits gather is a collective: every rank takes part

    def stop_followers(self) -> None:
        parallel.broadcast_from_first(None)

    def shard_report(self) -> ShardReport:
        """This process's report."""
        parameter_bytes = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
        return ShardReport(parameter_bytes, self.cache.shape.num_kv_heads, parallel.counts())

    def shard_reports(self) -> list[ShardReport]:
        """Every rank's report, in rank order (rank 0 asks the others, between steps); this process's alone
        outside a group."""
        if not self.leads_group:
            return [self.shard_report()]
        parallel.broadcast_from_first(ReportShards())
        return parallel.gather_objects(self.shard_report())

    def _move_blocks(self, inputs: StepInputs) -> None:
        for cache in (self.cache,) if self.draft is None else (self.cache, self.draft.cache):
            cache.swap_out(inputs.swap_out)
            cache.copy(inputs.copies)
            cache.swap_in(inputs.swap_in)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt: PromptRows
    ) -> list[tuple[Sequence, list[dict[int, Logprob]]]]:
        ks = [seq.params.prompt_logprobs for seq, count in prompt.spans for _ in range(count)]
        entries: list[dict[int, Logprob] | None] = []
        for start, logits in self.runner.prompt_logits(hidden):
            end = start + len(logits)
            entries.extend(token_logprobs(logits, prompt.targets[start:end], ks[start:end])[1])
        result, at = [], 0
        for seq, count in prompt.spans:
            result.append((seq, entries[at : at + count]))
            at += count
        return result

    def _pooled(self, hidden: torch.Tensor, pool: PoolRows) -> list[tuple[Sequence, torch.Tensor]]:
        """Each pooling sequence's part of its vector from this step's rows, on the CPU; a score engine's head
        reads the last row of a completed prompt (its pooling is last-token or CLS: no other row is pooled), or an
        encoder's mean row."""
        parts: list[tuple[Sequence, torch.Tensor]] = []
        at = 0
        model = self.runner.model
        for seq, count, completes in pool.spans:
            rows = hidden[at : at + count]
            at += count
            pooler = seq.pool.pooler
            if pooler.head == "score" and completes:
                # A mean-pooling classifier is an encoder's, whose whole prompt is this step's rows.
                pooled = (
                    rows.float().mean(0, keepdim=True).to(rows.dtype) if pooler.pooling_type == "mean" else rows[-1:]
                )
                part = model.classify(pooled)[0]
            elif pooler.head == "tokens" and completes:
                no, yes = model.compute_logits(rows[-1:])[0, list(pooler.label_token_ids)]
                part = (yes - no).reshape(1)
            else:
                part = pooler.part(rows)
            parts.append((seq, part.cpu()))
        return parts

    def _pick(self, logits: torch.Tensor, samples: list[SampleRow]) -> list[RowOutput]:
        """Beams first: the sampler overwrites the logits it is given, and beams read them unchanged."""
        rows = [RowOutput() for _ in samples]
        beams = [i for i, sample in enumerate(samples) if sample.num_beam_candidates]
        if beams:
            k = max(samples[i].num_beam_candidates for i in beams)
            for i, top in zip(beams, top_logprobs(logits[[samples[i].logits_row for i in beams]], k), strict=True):
                rows[i].candidates = top[: samples[i].num_beam_candidates]
        drawn = [i for i, sample in enumerate(samples) if not sample.num_beam_candidates]
        if drawn:
            logit_rows: list[int] = []
            sampling_rows: list[SamplingRow] = []
            spans: list[tuple[int, int, int]] = []  # (sample, its first sampling row, how many)
            for i in drawn:
                positions = self._sampling_rows(samples[i])
                spans.append((i, len(sampling_rows), len(positions)))
                logit_rows.extend(range(samples[i].logits_row, samples[i].logits_row + len(positions)))
                sampling_rows.extend(positions)
            # Parallel samples share their parent's row: they need copies, since sampling works in place.
            own = logits if logit_rows == list(range(len(logits))) else logits[logit_rows]
            result = self.sampler(own, sampling_rows)
            for i, first, count in spans:
                picks = [
                    RowOutput(result.token_ids[j], result.logprobs[j], result.sampled_logprobs[j])
                    for j in range(first, first + count)
                ]
                rows[i] = _accept_drafts(picks, samples[i].draft_token_ids)
        return rows

    def _sampling_rows(self, sample: SampleRow) -> list[SamplingRow]:
        """The sample's row, and with drafts one more per draft: row i picks as if drafts[:i] had been picked
        (its penalties count them, its grammar has taken them, min_tokens sees them)."""
        seq, drafts = sample.seq, sample.draft_token_ids
        grammars = _grammar_states(seq.grammar, drafts)
        output = seq.output_token_ids
        # Row 0's history is the output itself: no second copy of it on every step of every sequence.
        histories = [output] + [output + drafts[:i] for i in range(1, len(drafts) + 1)]
        return [self._sampling_row(seq, history, grammar) for history, grammar in zip(histories, grammars, strict=True)]

    def _sampling_row(self, seq: Sequence, output: list[int], grammar: xgr.GrammarMatcher | None) -> SamplingRow:
        params = seq.params
        banned: tuple[int, ...] = ()
        # A complete structure may only stop: min_tokens cannot lengthen it.
        if len(output) < params.min_tokens and (grammar is None or not grammar.is_completed()):
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_ids))
        return SamplingRow(params, seq.prompt_token_ids, output, seq.seed, banned, grammar)


def _grammar_states(grammar: xgr.GrammarMatcher | None, drafts: list[int]) -> list[xgr.GrammarMatcher | None]:
    """The matcher as it is, then a fork of it after each draft. A draft the grammar refuses cannot be picked
    at its place (the mask rules it out), so the rows after it are never read: they keep the last state."""
    states = [grammar]
    for token in drafts:
        current = states[-1]
        if current is not None:
            forked = current.fork()
            current = forked if forked.accept_token(token) else current
        states.append(current)
    return states


def _accept_drafts(picks: list[RowOutput], drafts: list[int]) -> RowOutput:
    """The first pick, followed by the next picks while each pick before them equalled its draft: pick i was
    made after drafts[:i], which is the sequence's real history only while the picks agree with the drafts.
    Picking each token by the target's own rule and keeping it is rejection sampling with a draft that puts
    all its probability on one token (accepted with the target's probability of it; else a token from the
    rest, renormalized), so the output is distributed as without speculation, and with the same seed equal."""
    accepted = 0
    while accepted < len(drafts) and picks[accepted].token_id == drafts[accepted]:
        accepted += 1
    head = picks[0]
    head.following = picks[1 : accepted + 1]
    return head
