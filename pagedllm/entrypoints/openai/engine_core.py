"""The engine core: an `LLMEngine` stepped in a process of its own, beside the HTTP server's process.

Torch's compute threads spin between operators and the engine's Python holds the GIL between them; in the
server's process they would compete with the event loop for both, and every parallel operator would wait
for the thread the event loop preempted. In a process of its own the engine owns every core and its GIL,
and the HTTP side costs it only the messages below, pickled over one pipe (as vLLM v1's engine core does
over a socket).

The server's process sends `AddRequests` (one call's requests, under one LoRA adapter or none), `LoadLoRA`
(an adapter read and checked against the model before the server serves its name), `RemoveLoRA` (an adapter
unloaded: forgotten once no request runs under it), `Compile`, `Abort`, `StopSequences` (what stop
strings ended, found by the server's output processor), `StatsRequest`, `KVWatch` and `Stop`; the core
answers with `Ready` once, then `Added` and `Compiled` (a refusal carries its message), `StepDeltas` after
every step that changed a request (only the new token ids, log-probabilities where asked, and the core's own
stops: never text, never a whole output, so a step's message does not grow with the sequences' lengths),
`Stats` (throttled while busy, always when it falls idle or after an abort, and in answer to a
`StatsRequest`), `KVUpdate` (snapshots and KV events for the /kv page, see `kv_page.KVPublisher`) and
`Fatal` when the engine cannot go on. The core exits when told to stop, when the engine dies, or when its
pipe closes (the server's process is gone).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.engine import CoreStep, EngineDeadError, LLMEngine, PromptInput
from pagedllm.entrypoints.openai.kv_page import KVPublisher, KVWatch
from pagedllm.heap import freeze_long_lived
from pagedllm.lora_request import LoRARequest
from pagedllm.output_processor import StringStop
from pagedllm.outputs import EngineStats, RequestDelta
from pagedllm.pooling import Pooler
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import SequenceStatus

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 0.05
_PR_SET_PDEATHSIG = 1  # prctl(2)
EngineParams = SamplingParams | BeamSearchParams | PoolingParams


# ---- messages to the core ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequests:
    key: int  # echoed in the `Added` answer
    request_ids: list[str]
    prompts: list[PromptInput]
    params: EngineParams
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class LoadLoRA:
    key: int  # echoed in the `Added` answer
    lora_request: LoRARequest


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    lora_int_id: int


@dataclass(frozen=True, slots=True)
class Compile:
    key: int
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class StopSequences:
    stops: list[StringStop]


@dataclass(frozen=True, slots=True)
class StatsRequest:
    key: int  # echoed in the `Stats` answer


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# ---- messages from the core ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """An error raised in the core, as the server's process re-raises it: a ValueError is the request's (or the
    options') fault and becomes a 400 (or the CLI's error line), a FileNotFoundError names a missing model."""

    message: str
    kind: str  # "ValueError", "FileNotFoundError" or "RuntimeError"

    @staticmethod
    def of(error: Exception) -> Refusal:
        kind = next((k.__name__ for k in (ValueError, FileNotFoundError) if isinstance(error, k)), "RuntimeError")
        return Refusal(str(error), kind)

    def error(self) -> Exception:
        return {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(self.kind, RuntimeError)(
            self.message
        )


@dataclass(frozen=True, slots=True)
class Ready:
    max_model_len: int
    model_folder: str  # where the server's process reads the same tokenizer
    startup_seconds: float
    task: str  # what the engine runs: generate, embed, score, or generate and one of them (generate,embed)
    pooler: Pooler | None  # an embed or score engine's: the routes check a request against it before adding it


@dataclass(frozen=True, slots=True)
class Added:
    key: int
    refusal: Refusal | None


@dataclass(frozen=True, slots=True)
class Compiled:
    key: int
    refusal: Refusal | None


@dataclass(frozen=True, slots=True)
class StepDeltas:
    deltas: list[RequestDelta]
    failures: dict[str, str]  # request id -> why serving it failed; the core has aborted it
    time: float  # time.perf_counter() after the step: on Linux one clock for every process


@dataclass(frozen=True, slots=True)
class Stats:
    stats: EngineStats
    key: int | None = None  # the `StatsRequest` answered, if any


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine cannot go on (or could not start); the core exits after sending it."""

    refusal: Refusal


# ---- the core process ----------------------------------------------------------------------------


def run_engine_core(conn: Connection, engine_options: dict[str, Any], loras: list[LoRARequest], log_level: int) -> None:
    """The core process's entry: build the engine, load `loras` (the server's `--lora-modules`), say `Ready`,
    serve until stopped."""
    # Ctrl-C, and SIGTERM from a supervisor that signals the whole group (systemd does), reach this process too;
    # the server's process decides how in-flight requests end, and stops the core (or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        engine = LLMEngine(EngineConfig(**engine_options), process_outputs=False)
        for lora in loras:
            engine.add_lora(lora)
    except Exception as error:
        conn.send(Fatal(Refusal.of(error)))
        return
    core = EngineCore(engine, conn)
    freeze_long_lived()
    elapsed = time.perf_counter() - started
    core.send(Ready(engine.max_model_len, str(engine.loaded.folder), elapsed, engine.task, engine.pooler))
    try:
        core.run()
    finally:
        engine.shutdown()


def _die_with_parent() -> None:
    """Have Linux kill this process when the server's process dies: a core that is stopped (SIGSTOP, a debugger)
    never reads the closed pipe, and a supervisor that replaces the server must not leave it behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EngineCore:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self._engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()  # the compile thread answers too
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-compile")
        self._kv = KVPublisher(engine, self.send)
        self._stopping = False
        self._stats_published = 0.0

    def send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def run(self) -> None:
        try:
            while not self._stopping:
                self._serve_once()
        except (EOFError, OSError):
            logger.warning("the server's process is gone; the engine core stops")
        finally:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def _serve_once(self) -> None:
        self._receive(block=False)
        busy = self._engine.has_unfinished_requests() and not self._stopping
        if busy:
            self._step()
        self._publish_stats(force=not busy)
        if not busy and not self._stopping:
            self._receive(block=True)
            self._stats_published = 0.0  # publish the first step after a pause at once

    def _receive(self, block: bool) -> None:
        """Handle every message waiting; with `block`, wait for the first."""
        if block:
            self._conn.poll(None)
        while self._conn.poll():
            self._handle(self._conn.recv())

    def _handle(self, message: object) -> None:
        match message:
            case AddRequests():
                self._add(message)
            case Abort(request_ids):
                for request_id in request_ids:
                    self._engine.abort_request(request_id)
                self._stats_published = 0.0  # gauges right after an abort are exact
            case StopSequences(stops):
                self._engine.stop_sequences(stops)
            case LoadLoRA(key, lora_request):
                self.send(Added(key, _attempt(self._engine.add_lora, lora_request)))
            case RemoveLoRA(lora_int_id):
                # Unknown here when no request ever loaded it: nothing to forget, the server's registry is the list.
                self._engine.remove_lora(lora_int_id)
            case Compile(key, params):
                self._compiler.submit(self._engine.compile_constraint, params).add_done_callback(
                    lambda done, key=key: self.send(Compiled(key, _refusal(done)))
                )
            case StatsRequest(key):
                self.send(Stats(self._engine.stats(), key))
            case KVWatch():
                self._kv.watch(message)
            case Stop():
                self._stopping = True
            case _:
                raise TypeError(f"the engine core got an unknown message: {message!r}")

    def _add(self, message: AddRequests) -> None:
        pairs = zip(message.request_ids, message.prompts, strict=True)
        requests = [(request_id, prompt, message.params, message.lora_request) for request_id, prompt in pairs]
        self.send(Added(message.key, _attempt(self._engine.add_requests, requests)))

    def _publish_stats(self, force: bool) -> None:
        """At most every _STATS_INTERVAL_S while busy (stats() walks every block table), and always before
        waiting, so an idle server's gauges are exact."""
        now = time.perf_counter()
        if force or now - self._stats_published >= _STATS_INTERVAL_S:
            self.send(Stats(self._engine.stats()))
            self._stats_published = now

    def _step(self) -> None:
        try:
            step = self._engine.step_core()
        except EngineDeadError as error:
            logger.error("the engine cannot continue: %s", error)
            self.send(Fatal(Refusal.of(error)))
            self._stopping = True
            return
        except Exception as error:
            logger.exception("an engine step failed; failing the requests it was running")
            failed = self._requests_in_failed_step()
            for request_id in failed:
                self._engine.abort_request(request_id)
            step = CoreStep(failed=dict.fromkeys(failed, error))
        if step.deltas or step.failed:
            failures = {request_id: repr(error) for request_id, error in step.failed.items()}
            self.send(StepDeltas(step.deltas, failures, time.perf_counter()))

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


def _attempt(call: Callable[[Any], object], argument: Any) -> Refusal | None:
    """Run one command of the server's; what it raises is the refusal the server's process re-raises."""
    try:
        call(argument)
    except Exception as error:
        return Refusal.of(error)
    return None


def _refusal(done: Future[None]) -> Refusal | None:
    if done.cancelled():  # the core is stopping
        return Refusal("the server is shutting down", "RuntimeError")
    error = done.exception()
    return None if error is None else Refusal.of(error)
