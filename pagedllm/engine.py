"""The request lifecycle: add, step, abort. A step is one straight line: the scheduler says what to
run, the worker runs it, the scheduler accounts for it; that is the engine core's step (`step_core`), whose
output is each request's change (`RequestDelta`). The output processor turns the changes into outputs and
decides the stop strings, which the core applies (`stop_sequences`); `step` does both, and the server does
the second half in its own process.

A fault in a step fails the requests it belongs to, and only those: they are aborted (their blocks go
back) and reported in a `RequestsFailedError` that carries everyone else's outputs. Each error is a
`StageError` naming the stage that failed."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import weakref
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from pagedllm.beam_search import BeamSearchParams, BeamState
from pagedllm.config import EngineConfig
from pagedllm.heap import collection_paused
from pagedllm.kv.events import KVEventFile, KVEventSink
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.lora_request import LoRARequest
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import LoadedModel, load_model, reads_lean_folder, resolve_model_folder
from pagedllm.models.loader import load_tokenizer as load_tokenizer  # the server's process reads the same tokenizer
from pagedllm.output_processor import OutputProcessor, StringStop
from pagedllm.outputs import (
    EngineStats,
    FinishedBeamOutput,
    KVSnapshot,
    RequestDelta,
    RequestOutput,
    SequenceDelta,
)
from pagedllm.pacing import PoolingPace
from pagedllm.pooling import (
    EMBED,
    SCORE,
    Pooler,
    PoolState,
    generates,
    pooling_task,
    resolve_task,
    truncated_encoding,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import SequenceGroup
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.sequence import Sequence, SequenceFactory, SequenceStatus
from pagedllm.speculative import SpeculativeConfig
from pagedllm.step import ModelOutput, NewToken, SchedulerOutput, StepUpdate
from pagedllm.structured_output import StructuredOutputCompiler
from pagedllm.worker.cache_engine import KVShape
from pagedllm.worker.draft import DraftModel
from pagedllm.worker.group import TensorParallelGroup, pool_size, step_budget
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.worker import StageError, StepTimer, Worker

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict

# Stages that failed requests' errors name, beside the worker's own (`worker.py`).
SCHEDULING = "scheduling"
GRAMMAR = "the grammar matcher"
DETOKENIZATION = "detokenization"


class RequestsFailedError(RuntimeError):
    """Raised by `step` when some requests failed: those were aborted (their blocks are free), every other
    request advanced normally, and `outputs` is what `step` would have returned for them. `errors` maps
    each failed request to a `StageError` naming the stage that failed."""

    def __init__(self, errors: dict[str, Exception], outputs: list[RequestOutput]) -> None:
        super().__init__("; ".join(f"request {rid!r} failed: {error!r}" for rid, error in errors.items()))
        self.errors = errors
        self.outputs = outputs


class EngineDeadError(RuntimeError):
    """A tensor-parallel step failed: a rank died or stopped answering, and the ranks' state is no longer
    in step. The engine cannot continue; every request it holds is lost."""


@dataclasses.dataclass(slots=True)
class CoreStep:
    """The engine core's step: each moved request's change, and the requests that failed (already aborted)."""

    deltas: list[RequestDelta] = dataclasses.field(default_factory=list)
    failed: dict[str, Exception] = dataclasses.field(default_factory=dict)


class LLMEngine:
    @collection_paused()  # the model's load: see pagedllm/heap.py
    def __init__(self, config: EngineConfig, *, process_outputs: bool = True) -> None:
        """`process_outputs=False` makes an engine core only: it steps with `step_core` and its caller processes
        the deltas (the server's process does, holding its own `OutputProcessor`)."""
        started = time.perf_counter()
        self.config = config
        lean = reads_lean_folder(config.device, config.tensor_parallel_size, config.dequantize)
        folder = resolve_model_folder(config.model, lean)
        model_config = ModelConfig.from_folder(folder)
        raw_config = json.loads((folder / "config.json").read_text())  # the pooling settings are read from it
        self.task = resolve_task(config.task, model_config, raw_config)
        _check_task(self.task, model_config, config)
        settings = config.speculative_config
        speculative = None if settings is None else SpeculativeConfig.from_dict(settings)
        draft_config = None
        if speculative is not None and speculative.model is not None:
            draft_config = ModelConfig.from_folder(resolve_model_folder(speculative.model, lean))
        pool = pool_size(config, model_config, draft_config)
        num_blocks, num_cpu_blocks = pool.num_blocks, pool.num_cpu_blocks
        self._bytes_per_block = pool.bytes_per_block
        self._group = TensorParallelGroup.start(config, model_config, folder, pool)
        self.loaded: LoadedModel = load_model(
            config.model,
            config.torch_dtype,
            config.device,
            self._group.shard,
            config.dequantize,
            config.quantization,
            config.int16_activations,
        )
        self.tokenizer = self.loaded.tokenizer
        self.text_bound = TextBound.of(self.tokenizer)
        # How prompts become vectors, on an embed or score engine.
        pooling = pooling_task(self.task)
        vocab = self.tokenizer.get_vocab()
        self.pooler = None if pooling is None else Pooler.of(model_config, raw_config, pooling, vocab)
        model = self.loaded.model
        shape = KVShape.of(
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            config.block_size,
            config.torch_dtype,
            config.kv_cache_dtype,
        )
        window = _kv_window(self.loaded)
        self.max_model_len = _max_model_len(self.loaded, config, num_blocks, window)
        self.vocab_size = self.loaded.config.vocab_size
        eos_ids = _eos_ids(self.loaded)
        self.sequences = SequenceFactory(config.seed)
        # An encoder's blocks hold nothing a later prompt could reuse: every position depends on the whole prompt.
        caching = config.enable_prefix_caching and model_config.encoder is None
        self.scheduler = Scheduler(
            KVCacheManager(num_blocks, config.block_size, caching, num_cpu_blocks, window),
            config.max_num_seqs,
            step_budget(config, model_config),
            config.preemption_mode,
            self.sequences,
            eos_ids,
            self.max_model_len,
            speculative,
            config.max_loras if config.enable_lora else 0,
        )
        self._pace = PoolingPace(config.pooling_stretch)
        if self.pooler is not None:  # without one no step is paced (the budget stays None)
            self.scheduler.pooling_budget = self._pace.budget()
        draft = None if speculative is None or speculative.model is None else self._load_draft(speculative.model)
        self.worker = Worker(
            self.loaded.model,
            shape,
            num_blocks,
            num_cpu_blocks,
            config.device,
            eos_ids,
            self._group.shard is not None,
            draft,
            self._lora_manager(),
        )
        self._lora_removals: set[int] = set()  # adapters removed while requests still run under them
        self._finalizer = weakref.finalize(self, self._group.stop, self.worker)
        self.output_processor = OutputProcessor(self.tokenizer) if process_outputs else None
        self.structured_outputs = StructuredOutputCompiler(self.tokenizer, self.vocab_size, eos_ids)
        self.requests: dict[str, SequenceGroup] = {}
        self._num_steps = 0
        self._step_seconds: dict[str, float] = {}
        self._observers: list[Callable[[], None]] = []
        if config.kv_events_file:
            self.add_kv_event_sink(KVEventFile(config.kv_events_file))
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
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        if isinstance(text, str):
            self.text_bound.check(text, self.max_model_len)
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request: a generation (`SamplingParams`) on a generate engine, a vector
        (`PoolingParams`) on an embed or score one. A request that could never run is refused here, never left
        to hang. A prompt dict may carry `cache_salt`: requests with different salts never share cached blocks
        (nor do requests of different adapters, nor an adapter's and the base model's)."""
        if isinstance(params, PoolingParams):
            self._queue(self._new_pooling_group(request_id, prompt, params, lora_request))
            return
        self._check_generates()
        params = params or SamplingParams()
        group = self._new_group(request_id, prompt, params, params.max_tokens, params.num_samples, lora_request)
        group.pending_forks = params.num_samples - 1
        self._queue(group)

    def add_requests(self, requests: list[tuple]) -> None:
        """Queue every request, each `(request_id, prompt, params)` or `(request_id, prompt, params, lora_request)`,
        or none: if one is refused, those already queued are withdrawn, and with several the error says which
        prompt it was."""
        added: list[str] = []
        try:
            for request_id, prompt, params, *lora in requests:
                lora_request = lora[0] if lora else None
                if isinstance(params, BeamSearchParams):
                    self.add_beam_request(request_id, prompt, params, lora_request)
                else:
                    self.add_request(request_id, prompt, params, lora_request)
                added.append(request_id)
        except Exception as error:
            for request_id in added:
                self.abort_request(request_id)
            if len(requests) > 1 and isinstance(error, ValueError):
                raise ValueError(f"prompt {len(added)}: {error}") from error
            raise

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint into the cache, so that adding it later
        does not compile on the stepping thread (the server calls this on a thread of its own). ValueError
        naming the constraint when it does not compile."""
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)

    def add_beam_request(
        self, request_id: str, prompt: PromptInput, params: BeamSearchParams, lora_request: LoRARequest | None = None
    ) -> None:
        self._check_generates()
        greedy = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        group = self._new_group(request_id, prompt, greedy, params.max_tokens, params.beam_width, lora_request)
        group.beam = BeamState(params, self.scheduler.eos_ids)
        self._queue(group)

    def _new_group(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        max_tokens: int | None,
        num_seqs: int,
        lora_request: LoRARequest | None,
    ) -> SequenceGroup:
        """The request as its first sequence; `num_seqs` is how many it grows to (n samples, best_of, beams)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        self._check_logit_bias(params)
        if lora_request is not None:
            self.add_lora(lora_request)
        seq = self.sequences.new(request_id, token_ids, params, self._check_fits(token_ids, max_tokens, num_seqs))
        seq.cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        seq.lora = lora_request
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs.matcher(params.structured_outputs)
        return SequenceGroup(request_id, text, token_ids, [seq])

    def _check_generates(self) -> None:
        if not generates(self.task):
            raise ValueError(
                f"this engine's task is {self.task}: it gives {_TASK_GIVES[self.task]}, not generated text (start "
                "another with task generate, or generate,embed for both)"
            )

    def _new_pooling_group(
        self, request_id: str, prompt: PromptInput, params: PoolingParams, lora_request: LoRARequest | None
    ) -> SequenceGroup:
        """A pooling request: one sequence that runs its prompt, up to max_model_len tokens (or its last
        `truncate_prompt_tokens`), and is pooled into a vector."""
        if self.pooler is None:
            raise ValueError(
                "this engine's task is generate: it gives no embeddings or scores (start another with task embed "
                "or score, or generate,embed for both)"
            )
        self.pooler.check(params)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids, token_types = self._pooling_tokens(prompt, params)
        self._check_tokens(token_ids)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} (truncate_prompt_tokens "
                "keeps its last tokens instead)"
            )
        self.scheduler.check_fits(len(token_ids), len(token_ids), 1)
        if lora_request is not None:
            self.add_lora(lora_request)
        seq = self.sequences.new_pooled(request_id, token_ids, PoolState(self.pooler, params), token_types)
        seq.cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        seq.lora = lora_request
        return SequenceGroup(request_id, text, token_ids, [seq])

    def _pooling_tokens(
        self, prompt: PromptInput, params: PoolingParams
    ) -> tuple[str | None, list[int], list[int] | None]:
        """A pooling prompt's text, token ids and token types (a dict's `token_type_ids`, an encoder's text pair
        segments; None: all 0), cut as `truncate_prompt_tokens` asks: an encoder's text by its tokenizer, which
        keeps its CLS token; token ids to their last tokens."""
        limit = params.truncation_length(self.max_model_len)
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        if limit is not None and isinstance(text, str) and self.pooler is not None and self.pooler.bidirectional:
            encoded = truncated_encoding(self.tokenizer, text, limit)
            return text, encoded["input_ids"], self._token_types(encoded.get("token_type_ids"), encoded["input_ids"])
        # A prompt to truncate may be as long as it likes: the text bound does not refuse it.
        text, token_ids = tokenize_prompt(self.tokenizer, prompt) if limit is not None else self.tokenize(prompt)
        types = self._token_types(prompt.get("token_type_ids") if isinstance(prompt, dict) else None, token_ids)
        types = None if types is None else params.truncated(types, self.max_model_len)
        return text, params.truncated(token_ids, self.max_model_len), types

    def _token_types(self, types: list[int] | None, token_ids: list[int]) -> list[int] | None:
        """A prompt's token types, checked against the model's token-type embedding; dropped where an encoder has
        none (ModernBERT, as transformers' takes none), refused for a decoder."""
        encoder = self.loaded.config.encoder
        if types is None or (encoder is not None and encoder.type_vocab_size == 0):
            return None
        if encoder is None:
            raise ValueError(f"token_type_ids: {self.loaded.config.architecture} has no token-type embedding")
        if len(types) != len(token_ids):
            raise ValueError(f"token_type_ids has {len(types)} entries for {len(token_ids)} tokens")
        outside = next((t for t in types if not 0 <= t < encoder.type_vocab_size), None)
        if outside is not None:
            raise ValueError(f"token_type_ids: {outside} is outside [0, {encoder.type_vocab_size})")
        return list(types)

    # ---- LoRA adapters (vLLM's names) ----------------------------------------------------------

    def _lora_manager(self) -> LoRAManager | None:
        config = self.config
        if not config.enable_lora:
            return None
        cpu_loras = config.max_cpu_loras or config.max_loras
        return LoRAManager(self.loaded.model, config.max_loras, config.max_lora_rank, cpu_loras, config.torch_dtype)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into CPU memory (a request naming it loads it too); ValueError naming what is wrong
        with it, or that the engine was built without enable_lora."""
        if self.worker.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked for, but the engine has enable_lora off")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        self._lora_removals.discard(lora_request.lora_int_id)
        self.worker.lora.load(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter once no request runs under it (those running finish first); False if unknown."""
        if self.worker.lora is None or lora_int_id not in self.worker.lora.known_ids():
            return False
        self._lora_removals.add(lora_int_id)
        self._settle_lora_removals()
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (in CPU memory or in a slot), less those being removed."""
        if self.worker.lora is None:
            return set()
        return self.worker.lora.known_ids() - self._lora_removals

    def _settle_lora_removals(self) -> None:
        if not self._lora_removals:
            return
        in_use = {s.lora.lora_int_id for g in self.requests.values() for s in g.seqs if s.lora is not None}
        for lora_id in self._lora_removals - in_use:
            self.worker.lora.remove(lora_id)
            self._lora_removals.discard(lora_id)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """Token ids the sampler indexes the logits with must lie in the model's vocabulary."""
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def _queue(self, group: SequenceGroup) -> None:
        self.requests[group.request_id] = group
        if self.output_processor is not None:
            first = group.seqs[0]
            params = first.params if first.pool is None else first.pool.params
            params = group.beam.params if group.beam is not None else params
            self.output_processor.add(group.request_id, group.prompt, group.prompt_token_ids, params)
        self.scheduler.add(group)

    def _check_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def _check_fits(self, token_ids: list[int], max_tokens: int | None, num_seqs: int) -> int:
        self._check_tokens(token_ids)
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
        self.scheduler.check_fits(len(token_ids), len(token_ids) + max_tokens, num_seqs)
        return max_tokens

    def abort_request(self, request_id: str) -> None:
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        for seq in group.live_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
        group.pending_forks = 0
        self.scheduler.remove(group)
        if self.output_processor is not None:
            self.output_processor.abort(request_id)
        self._notify()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block; refused while any block is in use."""
        self.scheduler.reset_prefix_cache()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once on the flat batch, account for it, and report every request
        that moved. Raises `RequestsFailedError` when some requests failed (see the class)."""
        if self.output_processor is None:
            raise RuntimeError("this engine core's outputs are processed by its caller: call step_core")
        core = self.step_core()
        processed = self.output_processor.process(core.deltas)
        self.stop_sequences(processed.stops)
        failed = core.failed | {rid: StageError(DETOKENIZATION, error) for rid, error in processed.failed.items()}
        for request_id in processed.failed:
            self.abort_request(request_id)
        if failed:
            raise RequestsFailedError(failed, processed.outputs)
        return processed.outputs

    def step_core(self) -> CoreStep:
        """The engine core's step: schedule, run the model once on the flat batch, account for it, and return
        each moved request's change. Requests that failed are aborted and returned in `failed`."""
        timer = StepTimer(self._step_seconds)
        scheduler_output = self.scheduler.schedule()
        timer.lap("schedule")
        if scheduler_output.is_empty:
            if not self.scheduler.has_unfinished():
                return CoreStep()
            return CoreStep(failed=self._fail_unrunnable(scheduler_output))
        started = time.perf_counter()
        ran, model_output, failed = self._execute(scheduler_output, timer)
        self._pace_pooling(ran, time.perf_counter() - started)
        update, grammar_failed = self.scheduler.update(ran, model_output)
        failed |= {rid: StageError(GRAMMAR, error) for rid, error in grammar_failed.items()}
        deltas = _deltas(update)
        for delta in deltas:
            if delta.finished:
                self.scheduler.remove(self.requests.pop(delta.request_id))
        for request_id in failed:
            self.abort_request(request_id)
        self._settle_lora_removals()
        timer.lap("update")
        self._num_steps += 1
        self._notify()
        return CoreStep(deltas, failed)

    def _pace_pooling(self, ran: SchedulerOutput, seconds: float) -> None:
        """Learn from a step that decoded what pooled tokens cost it, and cap the next ones. (A step that also
        prefilled a generation prompt says nothing of either: its time is that prompt's.)"""
        if self.pooler is None:
            return
        generating = [item for item in ran.scheduled if item.seq.pool is None]
        if not generating:
            return
        if all(item.num_new_tokens - item.num_drafts == 1 for item in generating):
            pooled = sum(item.num_new_tokens for item in ran.scheduled if item.seq.pool is not None)
            self._pace.record(seconds, pooled)
        self.scheduler.pooling_budget = self._pace.budget()

    def stop_sequences(self, stops: list[StringStop]) -> None:
        """Finish the sequences the output processor stopped at a stop string (their blocks go back), and with
        them any request that has nothing left to run. A request gone already (finished, aborted) is skipped."""
        for stop in stops:
            group = self.requests.get(stop.request_id)
            if group is None:
                continue
            for seq in group.live_seqs():
                if seq.index == stop.index:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            if group.finished:
                self.scheduler.remove(self.requests.pop(stop.request_id))

    def _fail_unrunnable(self, scheduler_output: SchedulerOutput) -> dict[str, Exception]:
        """A schedule that moved nothing while requests wait names the one that can never run: fail it,
        rather than let it, and everyone queued behind it, wait forever."""
        group = self.scheduler.unrunnable(scheduler_output)
        if group is None:
            raise RuntimeError("scheduler could not schedule any work although requests are waiting")
        error = RuntimeError(
            f"its {len(group.live_seqs())} sequence(s) of up to {max(seq.num_tokens for seq in group.seqs)} "
            f"tokens cannot run in the whole KV pool of {self.scheduler.kv.num_blocks} blocks"
        )
        self.abort_request(group.request_id)
        return {group.request_id: StageError(SCHEDULING, error)}

    def _execute(
        self, scheduler_output: SchedulerOutput, timer: StepTimer
    ) -> tuple[SchedulerOutput, ModelOutput, dict[str, Exception]]:
        """The worker's step, and the part of it that ran: all of it, or without the requests that failed."""
        if self._group.shard is not None:
            return scheduler_output, self._execute_group(scheduler_output, timer), {}
        try:
            return scheduler_output, self.worker.execute(scheduler_output, timer), {}
        except StageError as error:
            logger.exception("a step failed: %s", error)
            if error.blocks_moved:
                return self._isolate(scheduler_output, error, timer)
            # The blocks the step moves may hold anything now: every request they belong to fails.
            failed = dict.fromkeys(self.scheduler.requests_moved(scheduler_output), error)
            return SchedulerOutput(), ModelOutput(), failed

    def _execute_group(self, scheduler_output: SchedulerOutput, timer: StepTimer) -> ModelOutput:
        if self._group.broken:
            raise EngineDeadError("a tensor-parallel rank failed earlier; this engine cannot run again")
        try:
            return self.worker.execute(scheduler_output, timer)
        except RuntimeError as error:  # a collective failed, or the step failed on this rank mid-way
            self._group.broken = True
            raise EngineDeadError(f"a tensor-parallel step failed, the ranks are out of step: {error}") from error

    def _isolate(
        self, scheduler_output: SchedulerOutput, error: StageError, timer: StepTimer
    ) -> tuple[SchedulerOutput, ModelOutput, dict[str, Exception]]:
        """The step's forward pass or sampling raised after its block moves: run each request alone (without
        the moves, which are done), so that only the requests whose own run fails are failed. Nothing has
        advanced yet, so a request run again computes what it would have; this costs a forward pass per
        request, on this failure path only. If every request fails alone, the fault is nobody's own: all
        fail, and later steps go on (failing in turn if the fault stays)."""
        parts = _parts_by_request(scheduler_output)
        if len(parts) == 1:
            return SchedulerOutput(), ModelOutput(), dict.fromkeys(parts, error)
        logger.warning("running the failed step's %d requests one at a time", len(parts))
        ran, output, failed = SchedulerOutput(), ModelOutput(), {}
        for request_id, part in parts.items():
            try:
                part_output = self.worker.execute(part, timer)
            except StageError as part_error:
                failed[request_id] = part_error
                continue
            ran.scheduled += part.scheduled
            ran.samples += part.samples
            output.rows += part_output.rows
            output.prompt_logprobs += part_output.prompt_logprobs
        if len(failed) == len(parts):
            logger.error("every request of the failed step failed alone too: the fault is not one request's")
        return ran, output, failed

    def _load_draft(self, path: str) -> DraftModel:
        """Speculative decoding's draft model, with a pool of the target's blocks; it must share the target's
        vocabulary, since its guesses are the target's token ids."""
        config = self.config
        loaded = load_model(
            path,
            config.torch_dtype,
            config.device,
            None,
            config.dequantize,
            config.quantization,
            config.int16_activations,
        )
        if loaded.tokenizer.get_vocab() != self.tokenizer.get_vocab() or loaded.config.vocab_size != self.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {path!r} has another vocabulary than the model "
                f"({loaded.config.vocab_size} ids against {self.vocab_size}, or other tokens): its guesses would be "
                "other tokens"
            )
        model = loaded.model
        dims = (model.num_layers, model.num_kv_heads, model.head_dim, config.block_size)
        shape = KVShape.of(*dims, config.torch_dtype, config.kv_cache_dtype)
        kv = self.scheduler.kv
        return DraftModel(model, shape, kv.num_blocks, kv.cpu_pool.num_blocks if kv.cpu_pool else 0, config.device)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks' processes (also done when the engine is collected or the
        interpreter exits)."""
        self._finalizer()

    # ---- numbers --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats(self._num_steps, dict(self._step_seconds))
        lora = self.worker.lora
        if lora is None:
            return stats
        return dataclasses.replace(
            stats,
            lora_resident=lora.num_resident,
            lora_loaded=len(lora.loaded()),
            lora_disk_loads=lora.num_disk_loads,
            lora_slot_writes=lora.num_slot_writes,
        )

    def kv_snapshot(self) -> KVSnapshot:
        """Every block's reference count, the cached blocks and every live sequence's block table, copied.
        O(num_blocks + table entries); not thread-safe, like every method here: call it where `step` is called."""
        return dataclasses.replace(self.scheduler.kv_snapshot(self._num_steps), bytes_per_block=self._bytes_per_block)

    # ---- listeners (all called on the thread that steps) ------------------------------------

    def add_kv_event_sink(self, sink: KVEventSink) -> None:
        """Send `BlockStored` / `BlockRemoved` / `AllBlocksCleared` (`kv/events.py`) to `sink` as they happen."""
        self.scheduler.add_kv_event_sink(sink)

    def remove_kv_event_sink(self, sink: KVEventSink) -> None:
        self.scheduler.remove_kv_event_sink(sink)

    def add_observer(self, observer: Callable[[], None]) -> None:
        """Call `observer` after every step and every abort: the moments the KV state may have changed, and
        the only ones at which `kv_snapshot` is consistent for a reader that does not step the engine itself."""
        self._observers.append(observer)

    def _notify(self) -> None:
        for observer in self._observers:
            observer()


@dataclasses.dataclass(frozen=True, slots=True)
class TextBound:
    """The fewest tokens a text can have, known before tokenizing it: no token covers more characters than
    the vocabulary's longest entry (a byte-level BPE entry spells one character per byte). A normalizer may
    shorten a text first (NFKC composes characters), so with one the bound allows 4x more. Tokenizing
    megabytes takes seconds (4 MiB: 3.4 s here), which a hostile prompt would otherwise cost every request
    sharing the engine; a text that passes is still checked by its tokens."""

    chars_per_token: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TextBound:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        may_shorten = backend is None or backend.normalizer is not None
        return cls(longest * (4 if may_shorten else 1))

    def check(self, text: str, max_model_len: int) -> None:
        """Refuse a text certainly too long for the model, without tokenizing it."""
        fewest = len(text) // self.chars_per_token
        if fewest >= max_model_len:
            raise ValueError(
                f"prompt has {len(text)} characters, at least {fewest} tokens; max_model_len is {max_model_len}"
            )


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as ids) and token ids."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return tokenize_prompt(tokenizer, prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _deltas(update: StepUpdate) -> list[RequestDelta]:
    """Each moved request's change in the step, leaving out those where nothing a caller sees changed (a
    prompt chunk computed, a beam step)."""
    deltas = {
        group.request_id: RequestDelta(
            group.request_id, finished=group.finished, num_cached_tokens=group.num_cached_tokens
        )
        for group in update.groups
    }
    by_seq: dict[int, SequenceDelta] = {}
    for new in update.new_tokens:
        seq_delta = by_seq.get(new.seq.seq_id)
        if seq_delta is None:
            seq_delta = by_seq[new.seq.seq_id] = _sequence_delta(new.seq)
            deltas[new.seq.request_id].seqs.append(seq_delta)
        _add_token(seq_delta, new)
    for seq, entries in update.prompt_logprobs:
        deltas[seq.request_id].prompt_logprobs.extend(entries)
    for seq, vector in update.pooled:
        deltas[seq.request_id].pooled = vector
    for group in update.groups:
        if group.beam is not None and group.finished:
            prompt_len = len(group.prompt_token_ids)
            deltas[group.request_id].beams = [
                FinishedBeamOutput(beam.token_ids[prompt_len:], beam.cumulative_logprob, beam.ended_with_eos)
                for beam in group.beam.ranked()
            ]
    return [delta for delta in deltas.values() if delta.seqs or delta.prompt_logprobs or delta.finished]


def _sequence_delta(seq: Sequence) -> SequenceDelta:
    params = seq.params
    keeps_cumulative = params.logprobs is not None or params.ranks_samples
    return SequenceDelta(seq.index, [], [] if params.logprobs is not None else None, [] if keeps_cumulative else None)


def _add_token(delta: SequenceDelta, new: NewToken) -> None:
    delta.token_ids.append(new.seq.token_ids[new.num_tokens - 1])
    if delta.logprobs is not None:
        assert new.logprobs is not None
        delta.logprobs.append(new.logprobs)
    if delta.token_logprobs is not None:
        delta.token_logprobs.append(new.logprob)
    if new.stop is not None:
        delta.finish_reason = new.stop.status.finish_reason
        delta.stop_reason = new.stop.reason
        delta.hide_last_token_text = new.stop.hide_last_token_text


def _parts_by_request(out: SchedulerOutput) -> dict[str, SchedulerOutput]:
    """The step split by request, in scheduled order, without its block moves. A sample row's logits row
    is renumbered to count the completing sequences of its own part."""
    parts: dict[str, SchedulerOutput] = {}
    for item in out.scheduled:
        parts.setdefault(item.seq.request_id, SchedulerOutput()).scheduled.append(item)
    for sample in out.samples:
        parts[sample.seq.request_id].samples.append(sample)
    for part in parts.values():
        rows = {row: index for index, row in enumerate(sorted({sample.logits_row for sample in part.samples}))}
        part.samples = [dataclasses.replace(sample, logits_row=rows[sample.logits_row]) for sample in part.samples]
    return parts


_TASK_GIVES = {EMBED: "embeddings", SCORE: "scores"}


def _check_task(task: str, model: ModelConfig, config: EngineConfig) -> None:
    """Refuse a task this checkpoint, or these options, cannot run."""
    if generates(task) and not model.has_lm_head:
        raise ValueError(
            f"{model.folder}: a {model.architecture} checkpoint has no LM head to generate with; run it with task "
            f"{'score' if model.num_labels else 'embed'}"
        )
    if pooling_task(task) == EMBED and model.num_labels:
        raise ValueError(f"{model.folder}: a {model.architecture} checkpoint scores; run it with task score")
    if pooling_task(task) is not None and config.tensor_parallel_size > 1:
        raise ValueError(f"task {task} runs on one rank; tensor_parallel_size is {config.tensor_parallel_size}")
    if model.encoder is not None and (config.enable_lora or config.speculative_config):
        option = "enable_lora" if config.enable_lora else "speculative_config"
        raise ValueError(f"{model.folder}: {model.architecture} (an encoder) does not run with {option}")


def _kv_window(loaded: LoadedModel) -> int:
    """The window past which no layer looks back, when every layer slides (Mistral, Mixtral); 0 when any
    layer is global (Gemma's global layers need every block)."""
    windows = loaded.model.sliding_windows
    return max(windows) if min(windows) > 0 else 0


def _max_model_len(loaded: LoadedModel, config: EngineConfig, num_blocks: int, window: int) -> int:
    """The model's own limit, or the user's if smaller. If the user asks for more than the pool
    holds, requests that need more than the pool are refused one by one when they arrive. Where every
    layer slides, a sequence holds only its window's blocks, and the pool sets no limit."""
    model_limit = loaded.config.max_position_embeddings
    if config.max_model_len is None:
        return model_limit if window else min(model_limit, num_blocks * config.block_size)
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
