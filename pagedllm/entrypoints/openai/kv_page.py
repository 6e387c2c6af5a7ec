"""The live KV-cache page: `GET /kv` (one self-contained HTML page), `GET /kv/snapshot` (JSON) and `GET /kv/events`
(server-sent events: compact snapshots at most 10 a second, the KV events, and the recent history).

The engine runs in the engine core's process, so the page has two halves. `KVPublisher`, there, is an engine
observer: after each step and abort it takes a snapshot when someone is watching (throttled) and always when
the engine falls idle, and sends it with the KV events gathered meanwhile (only while a stream is open).
`KVMonitor`, in the server's process, keeps the latest snapshot and the history, and tells the core what is
watched. KV events go into a bounded queue per stream: a client that reads slowly or not at all loses the
oldest events (each message says how many were dropped) and never slows the engine.

Browsers' EventSource cannot send an `Authorization` header, so under `--api-key` the /kv paths also take the
key as `?api_key=KEY`: `QueryKeyMiddleware` moves it into the header (and out of the logged URL) before the
server's API-key check runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import astuple, dataclass
from importlib import resources
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine import LLMEngine
from pagedllm.kv.events import KVEvent
from pagedllm.outputs import KVSnapshot

MIN_INTERVAL_S = 0.1  # at most 10 snapshots a second while someone watches
_COST_FACTOR = 25  # and at most 1/25 of the engine thread's time spent taking them, however big the pool
_IDLE_INTERVAL_S = 1.0  # unwatched, a snapshot a second keeps the history and /kv/snapshot current
_FRESH_TIMEOUT_S = 2.0  # how long GET /kv/snapshot waits for a busy engine's next snapshot
STREAM_QUEUE = 4096  # KV events held per stream client; beyond this the oldest are dropped
_EVENTS_PER_MESSAGE = 1024
_HISTORY_POINTS = 1200  # ten minutes at one point per _HISTORY_STEP_S
_HISTORY_STEP_S = 0.5
_STATIC = resources.files("pagedllm.entrypoints.openai") / "static"


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    time: float  # Unix seconds
    kv_utilization: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int

    def as_list(self) -> list[float]:
        return list(astuple(self))


@dataclass(frozen=True, slots=True)
class _Published:
    snapshot: KVSnapshot
    taken_at: float  # time.monotonic()


class _Stream:
    """One /kv/events client's queue of KV events, bounded: a client that reads slowly loses the oldest."""

    def __init__(self) -> None:
        self.events: deque[KVEvent] = deque(maxlen=STREAM_QUEUE)
        self.dropped = 0
        self.reported = 0

    def push(self, event: KVEvent) -> None:
        if len(self.events) == STREAM_QUEUE:
            self.dropped += 1
        self.events.append(event)

    def take(self) -> tuple[list[KVEvent], int]:
        """Up to _EVENTS_PER_MESSAGE queued events, and how many were dropped since the last call."""
        taken = []
        while self.events and len(taken) < _EVENTS_PER_MESSAGE:
            taken.append(self.events.popleft())
        dropped, self.reported = self.dropped - self.reported, self.dropped
        return taken, dropped


@dataclass(frozen=True, slots=True)
class KVWatch:
    """The server's process to the engine core: what the /kv clients want now."""

    streams_open: bool  # an event stream is open: send KV events and a snapshot at most every MIN_INTERVAL_S
    wanted_until: float  # time.monotonic(): until then, snapshots at that rate for GET /kv/snapshot


@dataclass(frozen=True, slots=True)
class KVUpdate:
    """The engine core to the server's process: a new snapshot (or None), and the KV events since the last."""

    snapshot: KVSnapshot | None
    taken_at: float  # time.monotonic(), one clock for every process on Linux
    idle: bool
    events: list[KVEvent]


class KVPublisher:
    """The engine's half, in the engine core: after every step and abort (an engine observer) it takes a
    snapshot, throttled, and sends it with the KV events gathered meanwhile. Events are gathered only while a
    stream is open, so an unwatched engine builds none."""

    def __init__(self, engine: LLMEngine, send: Callable[[KVUpdate], None]) -> None:
        self._engine = engine
        self._send = send
        self._watch = KVWatch(streams_open=False, wanted_until=0.0)
        self._events: list[KVEvent] = []
        self._sink_installed = False
        self._cost = 0.0
        self._taken_at = time.monotonic()
        self._idle = True
        send(KVUpdate(engine.kv_snapshot(), self._taken_at, True, []))
        engine.add_observer(self._after_change)

    def watch(self, watch: KVWatch) -> None:
        self._watch = watch
        if watch.streams_open and not self._sink_installed:
            self._engine.add_kv_event_sink(self._on_event)
        elif self._sink_installed and not watch.streams_open:
            self._engine.remove_kv_event_sink(self._on_event)
        self._sink_installed = watch.streams_open

    def _on_event(self, event: KVEvent) -> None:
        self._events.append(event)

    def _after_change(self) -> None:
        now = time.monotonic()
        idle = not self._engine.has_unfinished_requests()
        watched = self._watch.streams_open or now < self._watch.wanted_until
        interval = max(MIN_INTERVAL_S if watched else _IDLE_INTERVAL_S, self._cost * _COST_FACTOR)
        snapshot = None
        if idle or now - self._taken_at >= interval:
            snapshot = self._engine.kv_snapshot()
            self._cost = time.monotonic() - now
            self._taken_at = now
        if snapshot is not None or self._events or idle != self._idle:
            events, self._events = self._events, []
            self._send(KVUpdate(snapshot, self._taken_at, idle, events))
        self._idle = idle


class KVMonitor:
    """The HTTP half, in the server's process, on its event loop: the latest snapshot, the history, the
    streams' queues; it tells the engine core what is watched through `watch`."""

    def __init__(self, watch: Callable[[KVWatch], None]) -> None:
        self._watch = watch
        self.latest: _Published | None = None  # the core's first update arrives before it says it is ready
        self.history: deque[HistoryPoint] = deque(maxlen=_HISTORY_POINTS)
        self.idle = True
        self._streams: list[_Stream] = []
        self._wanted_until = 0.0
        self._frame_cache: tuple[KVSnapshot, str] | None = None

    def on_update(self, update: KVUpdate) -> None:
        self.idle = update.idle
        if update.snapshot is not None:
            self.latest = _Published(update.snapshot, update.taken_at)
            self._record(update.snapshot)
        for stream in self._streams:
            for event in update.events:
                stream.push(event)

    def _record(self, snapshot: KVSnapshot) -> None:
        if self.history and snapshot.time - self.history[-1].time < _HISTORY_STEP_S:
            return
        counts = _status_counts(snapshot)
        self.history.append(
            HistoryPoint(
                snapshot.time,
                snapshot.kv_utilization,
                counts.get("running", 0),
                counts.get("waiting", 0),
                counts.get("swapped", 0),
                snapshot.num_preemptions,
            )
        )

    def open_stream(self) -> _Stream:
        stream = _Stream()
        self._streams.append(stream)
        self._tell()
        return stream

    def close_stream(self, stream: _Stream) -> None:
        self._streams.remove(stream)
        self._tell()

    def _tell(self) -> None:
        self._watch(KVWatch(streams_open=bool(self._streams), wanted_until=self._wanted_until))

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def fresh(self) -> KVSnapshot:
        """The state as of now: the latest snapshot if the engine is idle (nothing changes), else the first one
        the engine takes after this call (or the latest, if none comes within _FRESH_TIMEOUT_S)."""
        asked = time.monotonic()
        self._wanted_until = asked + _FRESH_TIMEOUT_S
        self._tell()
        while not self.idle and self.latest.taken_at < asked and time.monotonic() - asked < _FRESH_TIMEOUT_S:
            await asyncio.sleep(MIN_INTERVAL_S / 5)
        return self.latest.snapshot

    async def frame(self, snapshot: KVSnapshot) -> str:
        """The page's compact encoding of a snapshot, built once however many streams send it, off the loop."""
        cached = self._frame_cache
        if cached is not None and cached[0] is snapshot:
            return cached[1]
        encoded = await asyncio.to_thread(encode_frame, snapshot)
        self._frame_cache = (snapshot, encoded)
        return encoded


def _status_counts(snapshot: KVSnapshot) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in snapshot.sequences:
        counts[seq.status] = counts.get(seq.status, 0) + 1
    return counts


def encode_frame(snapshot: KVSnapshot) -> str:
    """A snapshot as the page reads it, compact because a pool may have 100,000s of blocks: `blocks` is base64
    of one byte per block (its reference count, capped at 127, plus 128 when the prefix cache can find it), and
    each sequence's tables are base64 of little-endian int32 ids. JSON lists of that size take 10x longer."""
    counts = snapshot.ref_counts
    states = bytearray(counts) if max(counts) < 128 else bytearray(min(count, 127) for count in counts)
    for block in snapshot.cached:
        states[block] |= 0x80
    statuses = _status_counts(snapshot)
    return json.dumps(
        {
            "step": snapshot.step,
            "time": snapshot.time,
            "block_size": snapshot.block_size,
            "num_blocks": snapshot.num_blocks,
            "bytes_per_block": snapshot.bytes_per_block,
            "kv_utilization": snapshot.kv_utilization,
            "num_cpu_blocks": snapshot.num_cpu_blocks,
            "swapped_out_blocks": snapshot.swapped_out_blocks,
            "num_preemptions": snapshot.num_preemptions,
            "spec_num_drafts": snapshot.spec_num_drafts,
            "spec_num_draft_tokens": snapshot.spec_num_draft_tokens,
            "spec_num_accepted_tokens": snapshot.spec_num_accepted_tokens,
            "num_running": statuses.get("running", 0),
            "num_waiting": statuses.get("waiting", 0),
            "num_swapped": statuses.get("swapped", 0),
            "blocks": base64.b64encode(states).decode(),
            "sequences": [
                {
                    "request_id": seq.request_id,
                    "seq_id": seq.seq_id,
                    "status": seq.status,
                    "num_cached_tokens": seq.num_cached_tokens,
                    "block_table": _int32_base64(seq.block_table),
                    "swapped_blocks": _int32_base64(seq.swapped_blocks),
                }
                for seq in snapshot.sequences
            ],
        }
    )


def _int32_base64(ids: list[int]) -> str:
    table = array("i", ids)
    if table.itemsize != 4:
        raise RuntimeError("this platform's C int is not 32 bits")
    return base64.b64encode(table.tobytes()).decode()


def _sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


# ---- HTTP -------------------------------------------------------------------------------------


def kv_router(monitor: KVMonitor) -> APIRouter:
    router = APIRouter(prefix="/kv")
    page = _inline_page()

    # Each answer's media type declared, so that the OpenAPI schema says what comes back.
    @router.get("", response_class=HTMLResponse)
    async def kv_page() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get("/snapshot")
    async def kv_snapshot() -> JSONResponse:
        snapshot = await monitor.fresh()
        return JSONResponse(await asyncio.to_thread(KVSnapshot.as_dict, snapshot))

    @router.get("/events", response_class=StreamingResponse, responses={200: {"content": {"text/event-stream": {}}}})
    async def kv_events() -> StreamingResponse:
        return StreamingResponse(_event_stream(monitor), media_type="text/event-stream", headers=_NO_CACHE)

    return router


_NO_CACHE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _event_stream(monitor: KVMonitor) -> AsyncIterator[bytes]:
    """History first, then the newest snapshot whenever there is a new one and the KV events since the last
    message, at most every MIN_INTERVAL_S. Against a client that stopped reading, the send below waits (the
    server's transport applies back-pressure) while the engine goes on and this stream's queue drops events."""
    stream = monitor.open_stream()
    try:
        yield _sse("history", json.dumps([point.as_list() for point in monitor.history]))
        sent: KVSnapshot | None = None
        while True:
            snapshot = monitor.latest.snapshot
            if snapshot is not sent:
                yield _sse("snapshot", await monitor.frame(snapshot))
                sent = snapshot
            events, dropped = stream.take()
            if events or dropped:
                yield _sse("kv_events", json.dumps({"events": [e.as_dict() for e in events], "dropped": dropped}))
            await asyncio.sleep(MIN_INTERVAL_S)
    finally:
        monitor.close_stream(stream)


def _inline_page() -> str:
    """kv.html with kv.css and kv.js inlined: one request, so the key in its URL is the only one it needs."""
    html = (_STATIC / "kv.html").read_text()
    css = (_STATIC / "kv.css").read_text()
    js = (_STATIC / "kv.js").read_text()
    return html.replace("/*KV_CSS*/", css).replace("/*KV_JS*/", js)


class QueryKeyMiddleware:
    """For /kv paths only: `?api_key=KEY` becomes `Authorization: Bearer KEY` (unless the request has one), and
    leaves the query string, so the key never reaches the access log. A pure ASGI middleware, like the
    API-key check, so streams and disconnects pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_kv_path(scope["path"]):
            _move_query_key(scope)
        await self.app(scope, receive, send)


def _is_kv_path(path: str) -> bool:
    return path == "/kv" or path.startswith("/kv/")


def _move_query_key(scope: Scope) -> None:
    """In place: uvicorn logs from this same scope object."""
    # A query string is percent-encoded ASCII; parse_qsl decodes the escapes as UTF-8, as the header check encodes.
    query = parse_qsl(scope.get("query_string", b"").decode("ascii", errors="replace"), keep_blank_values=True)
    keys = [value for name, value in query if name == "api_key"]
    if not keys:
        return
    scope["query_string"] = urlencode([(name, value) for name, value in query if name != "api_key"]).encode()
    if not any(name == b"authorization" for name, _ in scope["headers"]):
        scope["headers"] = [*scope["headers"], (b"authorization", f"Bearer {keys[0]}".encode())]


def mount_kv_page(app: FastAPI, monitor: KVMonitor) -> None:
    """Serve the /kv paths from `app`. Call after every other middleware is added: the query-key middleware
    must run before the API-key check."""
    app.include_router(kv_router(monitor))
    app.add_middleware(QueryKeyMiddleware)
