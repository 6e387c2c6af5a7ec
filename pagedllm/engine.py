"""The request lifecycle: add, step, abort. Owns no tensors; asks the scheduler, runs the worker,
then appends tokens, detokenizes and decides who stops."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from pagedllm.beam_search import BeamSearchParams, BeamState, Candidate, FinishedBeam
from pagedllm.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from pagedllm.detokenizer import next_text, start_detokenizer
from pagedllm.kv.kv_cache_manager import KVCacheManager, blocks_needed
from pagedllm.models.loader import LoadedModel, load_model
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import ScheduledSeq, Scheduler
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.stopping import length_stop, string_stop, token_stop
from pagedllm.worker.cache_engine import CacheEngine, KVShape
from pagedllm.worker.model_runner import ModelRunner, build_batch
from pagedllm.worker.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


@dataclass(slots=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_peak: int
    kv_utilization: float
    num_preemptions: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_swapped_out_blocks: int
    num_swap_preemptions: int
    num_cow_copies: int
    blocks_saved_by_sharing: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_steps: int
    step_seconds: dict[str, float] = field(default_factory=dict)


class RequestsFailedError(RuntimeError):
    """Raised by `step` when updating some requests raised: those were aborted (their blocks are free),
    every other request advanced normally, and `outputs` is what `step` would have returned for them."""

    def __init__(self, errors: dict[str, Exception], outputs: list[RequestOutput]) -> None:
        super().__init__("; ".join(f"request {rid!r} failed: {error!r}" for rid, error in errors.items()))
        self.errors = errors
        self.outputs = outputs


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.loaded: LoadedModel = load_model(config.model, config.torch_dtype, config.device)
        self.tokenizer = self.loaded.tokenizer
        shape = _kv_shape(self.loaded, config)
        num_blocks = config.num_kv_blocks or shape.blocks_for_memory(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for one block of {shape.bytes_per_block} bytes")
        swap_bytes = int(config.swap_space * (1 << 30)) if config.preemption_mode == "swap" else 0
        num_cpu_blocks = shape.blocks_for_memory(swap_bytes)
        self.max_model_len = _max_model_len(self.loaded, config, num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            config.preemption_mode,
        )
        self.cache = CacheEngine(shape, num_blocks, num_cpu_blocks, config.device)
        self.runner = ModelRunner(self.loaded.model, self.cache.kv_caches, config.block_size)
        self.sampler = Sampler()
        self.eos_ids = _eos_ids(self.loaded)
        self.vocab_size = self.loaded.config.vocab_size
        self.requests: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._rng = torch.Generator().manual_seed(config.seed)
        self._num_steps = 0
        self._step_seconds: dict[str, float] = defaultdict(float)
        self._failed: dict[str, Exception] = {}
        self.startup_seconds = time.perf_counter() - started
        logger.info(
            "engine ready in %.2f s: %d KV blocks of %d tokens, max_model_len %d",
            self.startup_seconds,
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None) -> None:
        """Validate and queue a request. A request that could never run is refused here, never left to hang.
        A prompt dict may carry `cache_salt`: requests with different salts never share cached blocks."""
        params = params or SamplingParams()
        group = self._new_group(request_id, prompt, params, params.max_tokens)
        group.pending_forks = params.num_samples - 1
        self._queue(group)

    def add_beam_request(self, request_id: str, prompt: PromptInput, params: BeamSearchParams) -> None:
        greedy = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        group = self._new_group(request_id, prompt, greedy, params.max_tokens)
        group.beam = BeamState(params, self.eos_ids)
        self._queue(group)

    def _new_group(
        self, request_id: str, prompt: PromptInput, params: SamplingParams, max_tokens: int | None
    ) -> SequenceGroup:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        limit = self._check_fits(token_ids, max_tokens)
        seq = self._new_sequence(request_id, 0, token_ids, params, limit)
        seq.cache_salt = salt
        return SequenceGroup(request_id, text, token_ids, [seq])

    def _queue(self, group: SequenceGroup) -> None:
        self.requests[group.request_id] = group
        self.scheduler.add(group)

    def _check_fits(self, token_ids: list[int], max_tokens: int | None) -> int:
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "leaving no room to generate"
            )
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {len(token_ids) + max_tokens} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        if not self.kv.can_ever_fit(len(token_ids) + max_tokens):
            need = blocks_needed(len(token_ids) + max_tokens, self.kv.block_size)
            raise ValueError(f"request needs {need} KV blocks but the whole pool has {self.kv.num_blocks}")
        return max_tokens

    def _new_sequence(
        self, request_id: str, index: int, token_ids: list[int], params: SamplingParams, max_tokens: int
    ) -> Sequence:
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            index=index,
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids),
            params=params,
            max_tokens=max_tokens,
            generator=self._generator(params, index),
            logprobs=[] if params.logprobs is not None else None,
        )
        start_detokenizer(seq)
        return seq

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Each random sequence owns its RNG, so a seeded request samples the same tokens whatever
        else shares its batch."""
        if params.is_greedy:
            return None
        seed = params.sample_seed(index)
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)

    def abort_request(self, request_id: str) -> None:
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        for seq in group.live_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
        group.pending_forks = 0
        self.scheduler.remove(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block; refused while any block is in use."""
        self.kv.reset_prefix_cache()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, move blocks, run the model once on the flat batch, pick tokens, and report every
        request that moved."""
        timer = _StepTimer(self._step_seconds)
        plan = self.scheduler.schedule()
        timer.lap("schedule")
        if plan.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler could not schedule any work although requests are waiting")
            return []
        self.cache.swap_out(plan.swap_out)
        self.cache.copy(plan.copies)
        self.cache.swap_in(plan.swap_in)
        timer.lap("swap/copy")
        if plan.scheduled:
            self._run(plan.scheduled, timer)
        failed = self._abort_failed()
        outputs = self._collect_outputs(plan.scheduled)
        timer.lap("update")
        self._num_steps += 1
        if failed:
            raise RequestsFailedError(failed, outputs)
        return outputs

    def _abort_failed(self) -> dict[str, Exception]:
        failed, self._failed = self._failed, {}
        for request_id in failed:
            self.abort_request(request_id)
        return failed

    def _run(self, scheduled: list[ScheduledSeq], timer: _StepTimer) -> None:
        completing = [item.seq for item in scheduled if item.completes]
        tables = [self.kv.block_table(item.seq.seq_id) for item in scheduled]
        batch = build_batch(scheduled, tables, self.kv.block_size)
        timer.lap("prepare")
        logits = self.runner.run(batch)
        timer.lap("forward")
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        self.scheduler.register_computed(scheduled)
        with torch.inference_mode():
            self._pick_tokens(completing, logits)
        timer.lap("sample")

    def _pick_tokens(self, completing: list[Sequence], logits: torch.Tensor) -> None:
        """Beams record their distributions; sampled sequences fork any pending parallel samples
        (which share the parent's logits row) and draw their tokens."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        beam_groups: dict[str, SequenceGroup] = {}
        for row, seq in enumerate(completing):
            group = self.requests[seq.request_id]
            if group.beam is not None:
                group.beam.rows[seq.seq_id] = torch.log_softmax(logits[row], dim=-1)
                beam_groups[group.request_id] = group
                continue
            for member in [seq, *self._fork_samples(group, seq)]:
                rows.append(row)
                seqs.append(member)
        if seqs:
            self._sample(seqs, logits[rows] if rows != list(range(len(completing))) else logits)
        for group in beam_groups.values():
            self._advance_beams(group)

    def _fork_samples(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """At the first token, the request's other samples fork from the one that ran the prompt."""
        if not group.pending_forks:
            return []
        children = [self._fork(group, parent, index) for index in range(1, group.pending_forks + 1)]
        group.pending_forks = 0
        return children

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(next(self._seq_ids), index, self._generator(parent.params, index))
        self.scheduler.fork(group, parent, child)
        return child

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        needs_raw = [i for i, seq in enumerate(seqs) if _tracks_cumulative(seq)]
        raw = torch.log_softmax(logits[needs_raw], dim=-1) if needs_raw else None
        sampled = self.sampler(logits, [self._sampling_row(seq) for seq in seqs])
        raw_logprob = {}
        if raw is not None:
            tokens = torch.tensor([sampled.token_ids[i] for i in needs_raw])
            picked = raw.gather(1, tokens[:, None])[:, 0].tolist()
            raw_logprob = dict(zip(needs_raw, picked, strict=True))
        for i, (seq, token, logprobs) in enumerate(zip(seqs, sampled.token_ids, sampled.logprobs, strict=True)):
            if seq.request_id not in self._failed:
                self._append_token_isolated(seq, token, logprobs, raw_logprob.get(i))

    def _append_token_isolated(
        self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None, raw_logprob: float | None
    ) -> None:
        """One request's failure (a detokenizer error, say) must not cost the rest of the batch its tokens:
        it is recorded, and `step` aborts that request alone."""
        try:
            self._append_token(seq, token, logprobs, raw_logprob)
        except Exception as error:
            logger.exception("request %s failed while appending its token", seq.request_id)
            self._failed[seq.request_id] = error

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = tuple(seq.params.stop_token_ids) + (() if seq.params.ignore_eos else tuple(self.eos_ids))
        return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, banned)

    def _append_token(
        self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None, raw_logprob: float | None = None
    ) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[token].logprob
            for token_id, entry in logprobs.items():
                entry.decoded_token = self.tokenizer.decode([token_id])
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs)
        elif raw_logprob is not None:
            seq.cumulative_logprob += raw_logprob
        stop = token_stop(seq, token, self.eos_ids)
        at_length = length_stop(seq, self.max_model_len)
        if stop is None or not stop.hide_last_token_text:
            last = stop is not None or at_length is not None
            seq.text += next_text(self.tokenizer, seq, seq.params.skip_special_tokens, flush=last)
        stop = stop or string_stop(seq) or at_length
        if stop is not None:
            seq.stop_reason = stop.reason
            self.scheduler.finish(seq, stop.status)

    def _advance_beams(self, group: SequenceGroup) -> None:
        state = group.beam
        live = group.live_seqs()
        if not state.ready(live):
            return
        chosen = state.choose(live)
        by_parent: dict[int, list[Candidate]] = defaultdict(list)
        for candidate in chosen:
            by_parent[candidate.parent.seq_id].append(candidate)
        for parent in live:
            picks = by_parent.get(parent.seq_id, [])
            if not picks:
                self.scheduler.drop(group, parent)  # a beam nobody continues gives its blocks back
                continue
            # Fork before appending, so each child starts from the parent's tokens as they were.
            members = [parent, *(self._fork(group, parent, parent.index) for _ in picks[1:])]
            for member, pick in zip(members, picks, strict=True):
                member.token_ids.append(pick.token)
                member.cumulative_logprob = pick.cumulative_logprob
        live = group.live_seqs()
        if not live or state.steps >= state.params.max_tokens or live[0].num_tokens >= self.max_model_len:
            for seq in live:
                state.finished.append(FinishedBeam(list(seq.token_ids), seq.cumulative_logprob, False))
                self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def _collect_outputs(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        touched = dict.fromkeys(item.seq.request_id for item in scheduled)
        outputs = [self._request_output(self.requests[rid]) for rid in touched if rid in self.requests]
        for output in outputs:
            if output.finished:
                self.scheduler.remove(self.requests.pop(output.request_id))
        return outputs

    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        if group.beam is not None:
            completions = self._beam_completions(group) if group.finished else []
        else:
            completions = [_completion(seq) for seq in _returned(group)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, group.finished)

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        prompt_len = len(group.prompt_token_ids)
        return [
            CompletionOutput(
                index=index,
                text=self.tokenizer.decode(beam.token_ids[prompt_len:], skip_special_tokens=True),
                token_ids=beam.token_ids[prompt_len:],
                cumulative_logprob=beam.cumulative_logprob,
                logprobs=None,
                finish_reason="stop" if beam.ended_with_eos else "length",
            )
            for index, beam in enumerate(group.beam.ranked())
        ]

    # ---- numbers --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool, kv = self.kv.pool, self.kv
        queries = kv.prefix_cache_queries
        return EngineStats(
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_peak=pool.peak_used,
            kv_utilization=kv.utilization(),
            num_preemptions=self.scheduler.num_preemptions,
            num_running=self.scheduler.num_running_seqs,
            num_waiting=sum(len(group.live_seqs()) for group in self.scheduler.waiting),
            num_swapped=sum(len(group.live_seqs()) for group in self.scheduler.swapped),
            num_swapped_out_blocks=kv.cpu_pool.num_used if kv.cpu_pool else 0,
            num_swap_preemptions=self.scheduler.num_swap_preemptions,
            num_cow_copies=kv.num_cow_copies,
            blocks_saved_by_sharing=kv.blocks_saved_by_sharing(),
            prefix_cache_queries=queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_hit_rate=kv.prefix_cache_hits / queries if queries else 0.0,
            num_steps=self._num_steps,
            step_seconds=dict(self._step_seconds),
        )


def _tracks_cumulative(seq: Sequence) -> bool:
    """best_of ranks samples by cumulative logprob, needed even when no logprobs were asked for."""
    return seq.params.logprobs is None and seq.params.num_samples > seq.params.n


def _returned(group: SequenceGroup) -> list[Sequence]:
    """All samples, or with best_of the n best by cumulative logprob once the request is done."""
    params = group.seqs[0].params
    if params.num_samples == params.n:
        return group.seqs
    if not group.finished:
        return []
    best = sorted(group.seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[: params.n]
    return sorted(best, key=lambda seq: seq.index)


def _completion(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        text=seq.text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None or _tracks_cumulative(seq) else None,
        logprobs=seq.logprobs,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
    )


class _StepTimer:
    """Accumulates wall time per phase of a step, so a benchmark can say where the time goes."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now


def _kv_shape(loaded: LoadedModel, config: EngineConfig) -> KVShape:
    attn = loaded.model.layers[0].self_attn
    return KVShape(
        num_layers=len(loaded.model.layers),
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        block_size=config.block_size,
        dtype=config.torch_dtype,
    )


def _max_model_len(loaded: LoadedModel, config: EngineConfig, num_blocks: int) -> int:
    """The model's own limit, or the user's if smaller. If the user asks for more than the pool
    holds, requests that need more than the pool are refused one by one when they arrive."""
    model_limit = loaded.config.max_position_embeddings
    if config.max_model_len is None:
        return min(model_limit, num_blocks * config.block_size)
    if config.max_model_len > model_limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {model_limit}")
    return config.max_model_len


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    generation_config = loaded.folder / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)
