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

from pagedllm.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from pagedllm.detokenizer import next_text, start_detokenizer
from pagedllm.kv.kv_cache_manager import KVCacheManager, blocks_needed
from pagedllm.models.loader import LoadedModel, load_model
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import ScheduledSeq, Scheduler
from pagedllm.sequence import Sequence, SequenceStatus
from pagedllm.stopping import StopDecision, length_stop, string_stop, token_stop
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
    num_steps: int
    step_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(seq.status.finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.loaded: LoadedModel = load_model(config.model, config.torch_dtype)
        self.tokenizer = self.loaded.tokenizer
        shape = _kv_shape(self.loaded, config)
        num_blocks = config.num_kv_blocks or shape.blocks_for_memory(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for one block of {shape.bytes_per_block} bytes")
        self.max_model_len = _max_model_len(self.loaded, config, num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        )
        self.cache = CacheEngine(shape, num_blocks)
        self.runner = ModelRunner(self.loaded.model, self.cache.kv_caches, config.block_size)
        self.sampler = Sampler()
        self.eos_ids = _eos_ids(self.loaded)
        self.vocab_size = self.loaded.config.vocab_size
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._rng = torch.Generator().manual_seed(config.seed)
        self._num_steps = 0
        self._step_seconds: dict[str, float] = defaultdict(float)
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
        """Validate and queue a request. A request that could never run is refused here, never left to hang."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._check_fits(token_ids, params)
        seqs = [self._new_sequence(request_id, i, token_ids, params, max_tokens) for i in range(params.n)]
        self.requests[request_id] = Request(request_id, text, token_ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> int:
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
        max_tokens = room if params.max_tokens is None else params.max_tokens
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
        seed = params.seed + index if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        return torch.Generator().manual_seed(seed)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once on the flat batch, sample, and report every request that moved."""
        timer = _StepTimer(self._step_seconds)
        plan = self.scheduler.schedule()
        timer.lap("schedule")
        if plan.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler could not schedule any work although requests are waiting")
            return []
        sampling = [item for item in plan.scheduled if item.samples]
        tables = [self.kv.block_table(item.seq.seq_id) for item in plan.scheduled]
        batch = build_batch(plan.scheduled, tables, self.kv.block_size)
        timer.lap("prepare")
        logits = self.runner.run(batch)
        timer.lap("forward")
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        with torch.inference_mode():
            sampled = self.sampler(logits, [self._sampling_row(item) for item in sampling])
        timer.lap("sample")
        for item, token, logprobs in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            self._append_token(item.seq, token, logprobs)
        outputs = self._collect_outputs(plan.scheduled)
        timer.lap("update")
        self._num_steps += 1
        return outputs

    def _sampling_row(self, item: ScheduledSeq) -> SamplingRow:
        seq = item.seq
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = tuple(seq.params.stop_token_ids) + (() if seq.params.ignore_eos else tuple(self.eos_ids))
        return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, banned)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[token].logprob
            for token_id, entry in logprobs.items():
                entry.decoded_token = self.tokenizer.decode([token_id])
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs)
        stop = token_stop(seq, token, self.eos_ids)
        at_length = length_stop(seq, self.max_model_len)
        if stop is None or not stop.hide_last_token_text:
            last = stop is not None or at_length is not None
            seq.text += next_text(self.tokenizer, seq, seq.params.skip_special_tokens, flush=last)
        stop = stop or string_stop(seq) or at_length
        if stop is not None:
            self._finish(seq, stop)

    def _finish(self, seq: Sequence, stop: StopDecision) -> None:
        seq.stop_reason = stop.reason
        self.scheduler.finish(seq, stop.status)

    def _collect_outputs(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        touched = dict.fromkeys(item.seq.request_id for item in scheduled)
        outputs = [self._request_output(self.requests[rid]) for rid in touched if rid in self.requests]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs

    def _request_output(self, request: Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, completions, request.finished
        )

    # ---- numbers --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_peak=pool.peak_used,
            kv_utilization=self.kv.utilization(),
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_steps=self._num_steps,
            step_seconds=dict(self._step_seconds),
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
