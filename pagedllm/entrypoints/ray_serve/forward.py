"""An HTTP request carried to a replica as a value, and run there through the replica's own ASGI app.

The front receives every HTTP request; a replica runs pagedllm's whole server app in-process (every route,
error and stream exactly as `pagedllm serve` answers them) and streams the answer back through Ray Serve as
`ResponseStart` then the body's chunks. When the front's client goes away, Serve cancels the replica's
generator; the app is then told the client disconnected, so it aborts the request and its blocks go back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

_APP_EXIT_S = 5.0  # after a disconnect, how long the app gets to abort its request and return


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str  # the replica's id, which the front names in errors and remembers when it failed


@dataclass(frozen=True, slots=True)
class ResponseEnd:
    engine_alive: bool  # false: the replica's engine died, and a failed answer may be tried elsewhere


async def run_asgi(
    app: ASGIApp, request: ForwardedRequest, replica: str, batch_s: float = 0.0
) -> AsyncIterator[ResponseStart | bytes]:
    """Call `app` with `request` and yield its answer: the start, then its body. The first body chunk goes at once;
    later ones are gathered for `batch_s` and go together (each item crosses two Ray hops, which costs more than
    a token's bytes: Ray Serve LLM batches its streams the same way)."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    body = _Body(messages)
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])), replica)
            elif message["type"] == "http.response.body":
                chunk = await body.gather(message, batch_s if body.started else 0.0)
                if chunk:
                    yield chunk
                if body.ended:
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        disconnected.set()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), _APP_EXIT_S)


class _Body:
    """The body messages of one answer, gathered into chunks."""

    def __init__(self, messages: asyncio.Queue[Message | None]) -> None:
        self._messages = messages
        self.started = False
        self.ended = False

    async def gather(self, first: Message, window_s: float) -> bytes:
        """`first`'s bytes and those of the body messages that arrive within `window_s` of it (up to the end)."""
        parts = [first.get("body", b"")]
        self.ended = not first.get("more_body", False)
        deadline = asyncio.get_running_loop().time() + window_s
        while not self.ended and (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                message = await asyncio.wait_for(self._messages.get(), left)
            except TimeoutError:
                break
            if message is None:  # the app returned: let the caller see it
                self._messages.put_nowait(None)
                break
            parts.append(message.get("body", b""))
            self.ended = not message.get("more_body", False)
        chunk = b"".join(parts)
        self.started = self.started or bool(chunk)
        return chunk


def _scope(request: ForwardedRequest) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("pagedllm-replica", 0),
    }
