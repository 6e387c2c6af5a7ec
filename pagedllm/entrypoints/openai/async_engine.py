"""`AsyncLLMEngine`: the server's handle on the engine core (`engine_core.py`), a process of its own.

The event loop sends commands (add, abort, compile, stop) through a sender thread, so a large prompt never
blocks it on a full pipe; a reader thread hands every message from the core to the loop
(call_soon_threadsafe). The core sends each step's changes; this process's `OutputProcessor` turns them into
text and cumulative outputs (a pooling request's one output, its vector), decides the stop strings (sending them
back to the core as `StopSequences`), and each request's outputs go into the queue of the API call that made it,
the request's timings into the metrics. Everything here but those two threads runs on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedllm.beam_search import BeamSearchParams
from pagedllm.engine import PromptInput, TextBound, load_tokenizer, tokenize_prompt
from pagedllm.entrypoints.openai.engine_core import (
    Abort,
    Added,
    AddRequests,
    Compile,
    Compiled,
    Fatal,
    LoadLoRA,
    Ready,
    Refusal,
    RemoveLoRA,
    Stats,
    StatsRequest,
    StepDeltas,
    Stop,
    StopSequences,
    run_engine_core,
)
from pagedllm.entrypoints.openai.kv_page import KVMonitor, KVUpdate
from pagedllm.entrypoints.openai.metrics import RequestTiming, ServerMetrics
from pagedllm.lora_request import LoRARequest
from pagedllm.output_processor import OutputProcessor
from pagedllm.outputs import CompletionOutput, PoolingRequestOutput, RequestDelta, RequestOutput
from pagedllm.pooling import Pooler
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
_STATS_TIMEOUT_S = 5.0

Output = RequestOutput | PoolingRequestOutput
Item = Output | BaseException
EngineParams = SamplingParams | BeamSearchParams | PoolingParams


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its thread died) and takes no new requests."""


class RequestFailedError(RuntimeError):
    """Serving this request raised inside the engine; the request was aborted, the engine kept serving."""


class RequestGroup:
    """The requests of one API call (one per prompt), whose outputs arrive as the engine produces them.

    Iterating yields `(prompt index, cumulative RequestOutput)` (a pooling request's one `PoolingRequestOutput`); a
    request that failed raises `RequestFailedError` and aborts the rest of the group.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self._queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._abort = abort

    async def __aiter__(self) -> AsyncIterator[tuple[int, Output]]:
        while self._unfinished:
            for index, item in await self._latest():
                if isinstance(item, BaseException):
                    self.abort()
                    raise item
                if item.finished:
                    self._unfinished.discard(index)
                yield index, item

    async def _latest(self) -> list[tuple[int, Item]]:
        """Wait for news, then take all that is queued. Outputs are cumulative, so only each request's newest
        matters: a reader that fell behind catches up in one go instead of replaying every step."""
        latest = dict([await self._queue.get()])
        while not self._queue.empty():
            index, item = self._queue.get_nowait()
            latest[index] = item
        return sorted(latest.items())

    def abort(self) -> None:
        """Abort every unfinished request of the group; harmless when called again or after the end."""
        if self._unfinished:
            self._abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()

    def deliver(self, index: int, item: Item) -> None:
        """Called on the event loop, scheduled by the engine thread."""
        self._queue.put_nowait((index, item))


@dataclass(slots=True)
class _Live:
    """The bookkeeping of one request that a client is waiting for."""

    group: RequestGroup
    index: int
    n: int  # completions (0 for a pooling request, which has none)
    arrival: float
    first_token: float | None = None
    num_tokens: int = 0  # over all its completions
    longest: int = 0  # tokens of its longest completion
    last: RequestOutput | None = None


class EngineStartError(RuntimeError):
    """The engine core exited before it was ready."""


class AsyncLLMEngine:
    def __init__(
        self,
        engine_options: dict[str, Any],
        metrics: ServerMetrics,
        max_waiting: int,
        loras: Sequence[LoRARequest] = (),
        start_method: str = "fork",
    ) -> None:
        """Start the engine core and wait until it is ready, with `loras` loaded. Raises what building the
        engine or loading an adapter raises (ValueError for bad options or a bad adapter, FileNotFoundError for a
        missing model), or EngineStartError. `max_waiting`: requests waiting for their first token at which the
        server is `overloaded`. `start_method`: the core's process is forked unless threads already run here (a
        Ray actor's), where only a spawned one is safe."""
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.num_waiting = 0  # requests accepted here whose first token has not arrived
        self.kv_monitor = KVMonitor(self._send)
        # Called on the event loop when the engine cannot continue: the server exits non-zero so that a
        # supervisor restarts it.
        self.on_fatal: Callable[[], None] = lambda: None
        self._live: dict[str, _Live] = {}
        self._pending: dict[int, asyncio.Future[Refusal | None]] = {}
        self._ids = itertools.count()
        self._keys = itertools.count()
        self._accepting = True
        self._stopping = False
        self._dead = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # Forked by `pagedllm serve`: the core starts with this process's imports (torch, transformers) done
        # instead of importing them again, seconds of start-up. Safe there: nothing has started a thread yet (the
        # reader, the writer, uvicorn's loop and the tokenizer's pool all start after), so no lock is copied held.
        context = multiprocessing.get_context(start_method)
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_engine_core,
            args=(child_conn, engine_options, list(loras), logging.getLogger().getEffectiveLevel()),
            name="pagedllm-engine-core",
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # the core's end: once the core exits, reads here see EOF
        ready = self._await_ready()
        self.max_model_len = ready.max_model_len
        self.task = ready.task
        self.pooler: Pooler | None = ready.pooler
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(ready.model_folder)
        self.text_bound = TextBound.of(self.tokenizer)  # the core's own, so both refuse the same texts
        self.output_processor = OutputProcessor(self.tokenizer)
        logger.info("engine core ready in %.2f s (pid %d)", ready.startup_seconds, self._process.pid)

    def _await_ready(self) -> Ready:
        """Read the core's first messages on this thread (the loop does not run yet) until `Ready`."""
        while True:
            try:
                message = self._conn.recv()
            except EOFError:
                self._process.join()
                raise EngineStartError(f"the engine core exited with code {self._process.exitcode}") from None
            if isinstance(message, Ready):
                return message
            if isinstance(message, Fatal):
                self._process.join(_JOIN_TIMEOUT_S)
                raise message.refusal.error()
            self._on_message(message)

    # ---- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        """Start the threads that talk to the core; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="pagedllm-core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="pagedllm-core-writer", daemon=True).start()

    @property
    def is_running(self) -> bool:
        return not self._dead and self._process.is_alive()

    @property
    def overloaded(self) -> bool:
        """New requests would queue behind `max_waiting` others: the server refuses them (503, Retry-After)
        rather than let the queue, and every waiting client's latency, grow without bound."""
        return self.num_waiting >= self.max_waiting

    async def compile_constraint(self, params: EngineParams) -> None:
        """Compile the request's structured-output constraint (if any) on the core's compile thread, so that a
        slow grammar never stalls its steps and one that does not compile is refused (ValueError) before the
        request is added."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            key = next(self._keys)
            self._raise(await self._ask(key, Compile(key, params)))

    async def add_requests(
        self, prompts: list[PromptInput], params: EngineParams, lora_request: LoRARequest | None = None
    ) -> RequestGroup:
        """Queue one request per prompt (under `lora_request`'s adapter, if given), all or none. Raises what
        `LLMEngine.add_request` raises (ValueError for a request that could never run), or EngineStoppedError
        while shutting down."""
        if not (self._accepting and self.is_running):
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        tokenized = [tokenize_prompt(self.tokenizer, prompt) for prompt in prompts]
        group = RequestGroup([str(next(self._ids)) for _ in prompts], self._abort)
        n = _num_completions(params)
        arrival = time.perf_counter()
        for index, (request_id, (text, token_ids)) in enumerate(zip(group.request_ids, tokenized, strict=True)):
            self._live[request_id] = _Live(group, index, n, arrival)
            self.output_processor.add(request_id, text, token_ids, params)
        self.num_waiting += len(prompts)
        key = next(self._keys)
        try:
            refusal = await self._ask(key, AddRequests(key, group.request_ids, prompts, params, lora_request))
        except asyncio.CancelledError:
            group.abort()  # the add may still land: this abort follows it down the pipe
            raise
        if refusal is not None:
            for request_id in group.request_ids:
                self.output_processor.abort(request_id)
                if self._live.pop(request_id, None) is not None:
                    self.num_waiting -= 1
            self._raise(refusal)
        return group

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Have the core read the adapter and check it against the model (ValueError naming what is wrong), so
        that a name is served only once its weights load."""
        if not (self._accepting and self.is_running):
            raise EngineStoppedError("the server is shutting down and takes no new adapters")
        key = next(self._keys)
        self._raise(await self._ask(key, LoadLoRA(key, lora_request)))

    def remove_lora(self, lora_int_id: int) -> None:
        """Tell the core to forget an adapter: requests already sent under it (the pipe keeps their order) finish
        first; no answer is awaited, since the server's registry has dropped the name already."""
        self._send(RemoveLoRA(lora_int_id))

    @property
    def core_pid(self) -> int:
        return self._process.pid

    @property
    def num_unfinished(self) -> int:
        """Requests accepted here that have not finished."""
        return len(self._live)

    async def refresh_stats(self) -> None:
        """Bring the engine gauges up to date: the core answers after the commands sent before this one (an
        abort the server just sent is in them), at most a step from now. A dead core leaves them as they are."""
        if self.is_running and not await self.responsive(_STATS_TIMEOUT_S):
            logger.warning("the engine core did not report its stats within %.0f s", _STATS_TIMEOUT_S)

    async def responsive(self, timeout_s: float) -> bool:
        """Whether the core answers a stats request within `timeout_s`: false for a core that is dead, or alive but
        stalled (its stepping thread stuck, the process stopped)."""
        if not self.is_running:
            return False
        key = next(self._keys)
        try:
            await asyncio.wait_for(self._ask(key, StatsRequest(key)), timeout_s)
        except TimeoutError:
            return False
        return True

    def drain(self, grace_seconds: float) -> None:
        """Refuse new requests, let running ones finish for `grace_seconds`, then abort what is left (their
        clients get a last output with finish reason "abort"). Safe to call from a signal handler."""
        self._accepting = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_seconds, self._abort_all)

    async def shutdown(self) -> None:
        """Abort everything still running and stop the engine core."""
        self._accepting = False
        self._stopping = True
        self._abort_all()
        self._send(Stop())
        await asyncio.to_thread(self._process.join, _JOIN_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine core did not stop in %.0f s; killing it", _JOIN_TIMEOUT_S)
            self._process.kill()
        self._outbox.put(None)

    async def _ask(self, key: int, message: object) -> Refusal | None:
        answer = self._loop.create_future()
        self._pending[key] = answer
        self._send(message)
        try:
            return await answer
        finally:
            self._pending.pop(key, None)

    def _raise(self, refusal: Refusal | None) -> None:
        if refusal is None:
            return
        error = refusal.error()
        if isinstance(error, ValueError):
            raise error
        if self._stopping or self._dead:
            raise EngineStoppedError(refusal.message)
        raise RequestFailedError(refusal.message)

    def _send(self, message: object) -> None:
        self._outbox.put(message)

    def _abort(self, request_ids: list[str]) -> None:
        """Its client left: free the blocks now; nobody is listening for a last output."""
        for request_id in request_ids:
            self.output_processor.abort(request_id)
            live = self._live.pop(request_id, None)
            if live is not None:
                self._end(live, "abort")
        self._send(Abort(request_ids))

    def _abort_all(self) -> None:
        aborted = list(self._live.items())
        self._live.clear()
        for request_id, live in aborted:
            self.output_processor.abort(request_id)
            self._end(live, "abort")
            live.group.deliver(live.index, _aborted_output(request_id, live) if live.n else _aborted_pooling())
        if aborted:
            self._send(Abort([request_id for request_id, _ in aborted]))

    def _fail_all(self, why: str) -> None:
        failed = list(self._live.values())
        self._live.clear()
        self.output_processor.requests.clear()
        for live in failed:
            self._end(live, "error")
            live.group.deliver(live.index, RequestFailedError(why))
        for answer in self._pending.values():
            if not answer.done():
                answer.set_result(Refusal(why, "RuntimeError"))

    # ---- the threads ----------------------------------------------------------------------

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:  # the core is gone; the reader reports it
                return

    def _read(self) -> None:
        try:
            while True:
                self._loop.call_soon_threadsafe(self._on_message, self._conn.recv())
        except (EOFError, OSError):
            self._loop.call_soon_threadsafe(self._on_core_exit)

    # ---- messages from the core, on the event loop ----------------------------------------

    def _on_message(self, message: object) -> None:
        match message:
            case StepDeltas(deltas, failures, when):
                self._on_step(deltas, failures, when)
            case Stats(stats, key):
                self.metrics.observe_engine(stats)
                self._answer(key, None)
            case KVUpdate():
                self.kv_monitor.on_update(message)
            case Added(key, refusal) | Compiled(key, refusal):
                self._answer(key, refusal)
            case Fatal(refusal):
                logger.error("the engine cannot continue: %s", refusal.message)
                self._die(f"the engine cannot continue: {refusal.message}")
            case _:
                logger.error("unexpected message from the engine core: %r", message)

    def _on_step(self, deltas: list[RequestDelta], failures: dict[str, str], when: float) -> None:
        """The core's step, made text and outputs here; stop strings found go back to the core, and a request
        whose processing failed is aborted there (the core goes on serving the rest)."""
        processed = self.output_processor.process(deltas)
        if processed.stops:
            self._send(StopSequences(processed.stops))
        if processed.failed:
            self._send(Abort(list(processed.failed)))
        for output in processed.outputs:
            self._dispatch(output, when)
        for request_id, error in processed.failed.items():
            self._fail(request_id, repr(error))
        for request_id, why in failures.items():
            self.output_processor.abort(request_id)
            self._fail(request_id, why)

    def _answer(self, key: int | None, refusal: Refusal | None) -> None:
        answer = self._pending.get(key) if key is not None else None
        if answer is not None and not answer.done():
            answer.set_result(refusal)

    def _on_core_exit(self) -> None:
        if self._stopping or self._dead:
            return
        self._process.join(_JOIN_TIMEOUT_S)
        logger.error("the engine core exited unexpectedly (exit code %s)", self._process.exitcode)
        self._die(f"the engine core exited unexpectedly (exit code {self._process.exitcode})")

    def _die(self, why: str) -> None:
        self._dead = True
        self._accepting = False
        self._fail_all(why)
        self.on_fatal()

    def _fail(self, request_id: str, why: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._end(live, "error")
            live.group.deliver(live.index, RequestFailedError(f"serving the request failed: {why}"))

    def _dispatch(self, output: Output, when: float) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        if isinstance(output, PoolingRequestOutput):
            # Its one output is its vector: no token was generated, so no TTFT or TPOT is observed.
            del self._live[output.request_id]
            self._end(live, "stop")
            live.group.deliver(live.index, output)
            return
        self._count_tokens(live, output, when)
        live.last = output
        if output.finished:
            del self._live[output.request_id]
            self._end(live, output.outputs[0].finish_reason if output.outputs else "stop")
        live.group.deliver(live.index, output)

    def _count_tokens(self, live: _Live, output: RequestOutput, when: float) -> None:
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens <= live.num_tokens:
            return
        if live.first_token is None:
            live.first_token = when
            self.num_waiting -= 1
            self.metrics.observe_first_token(when - live.arrival, len(output.prompt_token_ids))
        self.metrics.observe_generated(num_tokens - live.num_tokens)
        live.num_tokens = num_tokens
        live.longest = max(len(completion.token_ids) for completion in output.outputs)

    def _end(self, live: _Live, finish_reason: str) -> None:
        if live.first_token is None:
            self.num_waiting -= 1
        timing = RequestTiming(live.arrival, live.first_token, time.perf_counter(), live.longest)
        self.metrics.observe_end(finish_reason, timing)


def _num_completions(params: EngineParams) -> int:
    if isinstance(params, PoolingParams):
        return 0
    return params.n if isinstance(params, SamplingParams) else params.beam_width


def _aborted_pooling() -> RequestFailedError:
    """A pooling request cut short has no partial vector to return, unlike a generation's text so far."""
    return RequestFailedError("the request was aborted: the server is shutting down")


def _aborted_output(request_id: str, live: _Live) -> RequestOutput:
    last = live.last
    if last is None or not last.outputs:
        completions = [CompletionOutput(i, "", [], None, None, "abort") for i in range(live.n)]
        prompt_token_ids = last.prompt_token_ids if last is not None else []
        return RequestOutput(request_id, None, prompt_token_ids, completions, finished=True)
    completions = [replace(c, finish_reason=c.finish_reason or "abort") for c in last.outputs]
    return replace(last, outputs=completions, finished=True)
