"""`AsyncLLMEngine`: an LLMEngine stepped by its own thread beside an asyncio event loop.

LLMEngine is not thread-safe, so every call into it happens on the engine thread: the event loop submits
commands (add, abort, stop) that the thread drains before each step, and the thread hands each request's
outputs back to the loop (call_soon_threadsafe) into the queue of the API call that made the request.
The thread steps while work exists and sleeps on an event otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial

from pagedllm.beam_search import BeamSearchParams
from pagedllm.engine import EngineDeadError, LLMEngine, PromptInput, RequestsFailedError
from pagedllm.entrypoints.openai.metrics import RequestTiming, ServerMetrics
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import SequenceStatus

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
_STATS_INTERVAL_S = 0.05

Item = RequestOutput | BaseException
EngineParams = SamplingParams | BeamSearchParams


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its thread died) and takes no new requests."""


class RequestFailedError(RuntimeError):
    """Serving this request raised inside the engine; the request was aborted, the engine kept serving."""


class RequestGroup:
    """The requests of one API call (one per prompt), whose outputs arrive as the engine produces them.

    Iterating yields `(prompt index, cumulative RequestOutput)`; a request that failed raises
    `RequestFailedError` and aborts the rest of the group.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self._queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._abort = abort

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
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
    """Engine-thread bookkeeping of one request that a client is waiting for."""

    group: RequestGroup
    index: int
    n: int
    arrival: float
    first_token: float | None = None
    num_tokens: int = 0  # over all its completions
    longest: int = 0  # tokens of its longest completion
    last: RequestOutput | None = None


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.metrics = metrics
        self._engine = engine  # touched by the engine thread only, but for the thread-safe compile_constraint
        self._live: dict[str, _Live] = {}  # engine thread only
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._accepting = True
        self._stopping = False
        self._stats_published = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Called on the event loop when the engine cannot continue (a tensor-parallel rank died): the server
        # exits non-zero so that a supervisor restarts it.
        self.on_fatal: Callable[[], None] = lambda: None

    # ---- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def compile_constraint(self, params: EngineParams) -> None:
        """Compile the request's structured-output constraint (if any) on a thread of its own, so that a slow
        grammar never stalls the engine thread and one that does not compile is refused (ValueError) before
        the request is added."""
        if isinstance(params, SamplingParams):
            await asyncio.to_thread(self._engine.compile_constraint, params)

    async def add_requests(self, prompts: list[PromptInput], params: EngineParams) -> RequestGroup:
        """Queue one request per prompt, all or none. Raises what `LLMEngine.add_request` raises (ValueError for
        a request that could never run), or EngineStoppedError while shutting down."""
        if not (self._accepting and self.is_running):
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        group = RequestGroup([str(next(self._ids)) for _ in prompts], self._submit_abort)
        accepted = self._loop.create_future()
        self._submit(partial(self._add, group, prompts, params, time.perf_counter(), accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            group.abort()  # the add may still land: this abort is queued behind it
            raise
        return group

    def drain(self, grace_seconds: float) -> None:
        """Refuse new requests, let running ones finish for `grace_seconds`, then abort what is left (their
        clients get a last output with finish reason "abort"). Safe to call from a signal handler."""
        self._accepting = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_seconds, self._submit, self._abort_all)

    async def shutdown(self) -> None:
        """Abort everything still running and stop the engine thread."""
        self._accepting = False
        if self._thread is None:
            return
        self._submit(self._stop)
        await asyncio.to_thread(self._thread.join, _JOIN_TIMEOUT_S)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _submit_abort(self, request_ids: list[str]) -> None:
        self._submit(partial(self._abort, request_ids))

    def _to_loop(self, callback: Callable[..., None], *args: object) -> None:
        self._loop.call_soon_threadsafe(callback, *args)

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._serve_once()
        except Exception:
            logger.exception("the engine thread crashed")
        finally:
            self._accepting = False
            self._abort_all()
            self._publish_stats(force=True)

    def _serve_once(self) -> None:
        # Cleared before draining: a command submitted after the drain sets it again, so wait() cannot miss it.
        self._wake.clear()
        self._drain_commands()
        busy = self._engine.has_unfinished_requests() and not self._stopping
        if busy:
            self._step()
        self._publish_stats(force=not busy)
        if not busy and not self._stopping:
            self._wake.wait()
            self._stats_published = 0.0  # publish the first step after a pause at once

    def _publish_stats(self, force: bool) -> None:
        """At most every _STATS_INTERVAL_S while busy (stats() walks every block table), and always before
        sleeping, so an idle server's gauges are exact."""
        now = time.perf_counter()
        if force or now - self._stats_published >= _STATS_INTERVAL_S:
            self.metrics.observe_engine(self._engine.stats())
            self._stats_published = now

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # one failed abort must not stop the engine serving everyone else
                logger.exception("an engine command failed")

    def _stop(self) -> None:
        self._stopping = True

    def _add(
        self,
        group: RequestGroup,
        prompts: list[PromptInput],
        params: EngineParams,
        arrival: float,
        accepted: asyncio.Future[None],
    ) -> None:
        try:
            self._engine.add_requests(
                [(request_id, prompt, params) for request_id, prompt in zip(group.request_ids, prompts, strict=True)]
            )
        except Exception as error:
            self._to_loop(_settle, accepted, error)
            return
        n = params.n if isinstance(params, SamplingParams) else params.beam_width
        for index, request_id in enumerate(group.request_ids):
            self._live[request_id] = _Live(group, index, n, arrival)
        self._to_loop(_settle, accepted, None)

    def _abort(self, request_ids: list[str]) -> None:
        """Its client left: free the blocks now; nobody is listening for a last output."""
        for request_id in request_ids:
            self._drop(request_id, "abort")

    def _abort_all(self) -> None:
        for request_id in list(self._live):
            live = self._drop(request_id, "abort")
            self._to_loop(live.group.deliver, live.index, _aborted_output(request_id, live))

    def _fail(self, request_id: str, error: Exception) -> None:
        live = self._drop(request_id, "error")
        if live is not None:
            failure = RequestFailedError(f"serving the request failed: {error!r}")
            self._to_loop(live.group.deliver, live.index, failure)

    def _drop(self, request_id: str, finish_reason: str) -> _Live | None:
        """Abort the request in the engine and end its bookkeeping, if a client was waiting for it."""
        self._engine.abort_request(request_id)
        live = self._live.pop(request_id, None)
        if live is not None:
            self._end(live, finish_reason)
        return live

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except EngineDeadError as error:
            logger.error("the engine cannot continue: %s", error)
            for request_id in list(self._live):
                self._fail(request_id, error)
            self._stopping = True
            self._to_loop(self.on_fatal)
            return
        except RequestsFailedError as failure:
            for request_id, error in failure.errors.items():
                self._fail(request_id, error)
            outputs = failure.outputs
        except Exception as error:
            logger.exception("an engine step failed; failing the requests it was running")
            for request_id in self._requests_in_failed_step():
                self._fail(request_id, error)
            return
        now = time.perf_counter()
        for output in outputs:
            self._dispatch(output, now)

    def _requests_in_failed_step(self) -> list[str]:
        """The running requests: their state is unknown after the failure. Waiting ones did not take part. If
        none was running, the failure was in scheduling itself, and failing everything prevents a busy loop."""
        requests = self._engine.requests
        running = [
            request_id
            for request_id, group in requests.items()
            if any(seq.status is SequenceStatus.RUNNING for seq in group.seqs)
        ]
        return running or list(requests)

    def _dispatch(self, output: RequestOutput, now: float) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        self._count_tokens(live, output, now)
        live.last = output
        if output.finished:
            del self._live[output.request_id]
            self._end(live, output.outputs[0].finish_reason if output.outputs else "stop")
        self._to_loop(live.group.deliver, live.index, output)

    def _count_tokens(self, live: _Live, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens <= live.num_tokens:
            return
        if live.first_token is None:
            live.first_token = now
            self.metrics.observe_first_token(now - live.arrival, len(output.prompt_token_ids))
        self.metrics.observe_generated(num_tokens - live.num_tokens)
        live.num_tokens = num_tokens
        live.longest = max(len(completion.token_ids) for completion in output.outputs)

    def _end(self, live: _Live, finish_reason: str) -> None:
        timing = RequestTiming(live.arrival, live.first_token, time.perf_counter(), live.longest)
        self.metrics.observe_end(finish_reason, timing)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # its client left while the add was queued
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _aborted_output(request_id: str, live: _Live) -> RequestOutput:
    last = live.last
    if last is None or not last.outputs:
        completions = [CompletionOutput(i, "", [], None, None, "abort") for i in range(live.n)]
        prompt_token_ids = last.prompt_token_ids if last is not None else []
        return RequestOutput(request_id, None, prompt_token_ids, completions, finished=True)
    completions = [replace(c, finish_reason=c.finish_reason or "abort") for c in last.outputs]
    return replace(last, outputs=completions, finished=True)
