"""`pagedllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLMEngine`.

`/v1/completions`, `/v1/chat/completions` and `/v1/responses` (server-sent events when `stream` is true; their own
modules; stored responses read, deleted and cancelled at `/v1/responses/{id}`) on a generate server,
`/v1/embeddings`, `/v1/score` and `/v1/rerank` on an embed or score one (`serving_pooling.py`),
`/v1/models` (base names and LoRA adapters, with the engine's task), `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (with `--enable-lora`), `/tokenize`, `/detokenize`, `/health` and `/metrics`. Every error
has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with `param` naming the offending field.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.config import ServeOptions
from pagedllm.entrypoints.llm import render_chat
from pagedllm.entrypoints.openai import protocol
from pagedllm.entrypoints.openai.async_engine import AsyncLLMEngine, EngineStoppedError
from pagedllm.entrypoints.openai.kv_page import mount_kv_page
from pagedllm.entrypoints.openai.metrics import METRICS_CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_common import (
    ApiError,
    LoRARegistry,
    OpenAIServing,
    RenderChat,
    ServingLimits,
)
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.heap import freeze_long_lived

# vLLM's routes under their other names; the schema lists each route once, under its first.
_SCORE_PATHS = ("/v1/score", "/score")
_RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
# The routes that queue engine requests: refused while the engine is overloaded.
_ENGINE_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", *_SCORE_PATHS, *_RERANK_PATHS}
)
_SHUTDOWN_BACKSTOP_S = 3.0  # after the grace period and the aborts, uvicorn cancels whatever still runs


def serve(engine_options: dict[str, Any], options: ServeOptions) -> int:
    """Start the engine core (its own process, see `engine_core.py`) and serve until SIGTERM or SIGINT; then
    finish or abort in-flight requests and return 0. If the engine cannot continue (a tensor-parallel rank
    died, or the core process did), fail its requests, stop, and return 1."""
    server = build_server(engine_options, options)
    freeze_long_lived()
    options = server.options
    config = uvicorn.Config(
        server.app,
        host=options.host,
        port=options.port,
        log_level=options.log_level.lower(),
        timeout_graceful_shutdown=math.ceil(options.shutdown_grace_s + _SHUTDOWN_BACKSTOP_S),
    )
    banner = f"pagedllm: serving {options.served_model_names[0]} on http://{options.host}:{options.port}"
    engine = server.engine
    uvicorn_server = UvicornServer(config, on_exit=partial(engine.drain, options.shutdown_grace_s), banner=banner)
    engine.on_fatal = uvicorn_server.fail
    uvicorn_server.run()
    return uvicorn_server.exit_code


@dataclass(frozen=True, slots=True)
class EngineApp:
    """One engine behind its app: what `pagedllm serve` runs under uvicorn, and each Ray Serve replica in-process."""

    app: FastAPI
    engine: AsyncLLMEngine
    options: ServeOptions  # with the served model names filled in


def build_server(engine_options: dict[str, Any], options: ServeOptions, start_method: str = "fork") -> EngineApp:
    """Start the engine core (loading `--lora-modules` in it) and build the app over it. `start_method`: how the
    core's process starts (`fork` unless threads already run in this process)."""
    options = replace(options, served_model_names=options.model_names(engine_options.get("model")))
    loras = LoRARegistry(bool(engine_options.get("enable_lora")), options.served_model_names)
    try:
        modules = [loras.new(name, path) for name, path in options.lora_module_paths()]
    except ApiError as error:
        raise ValueError(f"--lora-modules: {error}") from error
    engine = AsyncLLMEngine(engine_options, ServerMetrics(), options.max_waiting_requests, modules, start_method)
    for module in modules:
        loras.add(module)
    app = build_app(engine, partial(render_chat, engine.tokenizer), options, loras)
    mount_kv_page(app, engine.kv_monitor)  # after build_app: its query-key middleware runs before the key check
    return EngineApp(app, engine, options)


class UvicornServer(uvicorn.Server):
    """uvicorn's server that exits 0 after a signal it handled, prints a banner once listening, and calls `on_exit`
    when told to stop."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], banner: str) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._banner = banner
        self.exit_code = 0

    def fail(self) -> None:
        self.exit_code = 1
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the caught signal after shutting down, so the default handler kills the process
        # with status -15; a server that stopped cleanly on request exits 0 instead.
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self._on_exit()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self._banner, file=sys.stderr, flush=True)


def build_app(
    engine: AsyncLLMEngine, render_chat: RenderChat, options: ServeOptions, loras: LoRARegistry | None = None
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()  # the core is running already: the loop starts taking its messages
        yield
        await engine.shutdown()

    names = options.served_model_names
    limits = ServingLimits.from_options(options)
    loras = loras or LoRARegistry(base_names=names)
    completion = OpenAIServingCompletion(engine, render_chat, names, limits=limits, loras=loras)
    chat = OpenAIServingChat(
        engine,
        render_chat,
        names,
        options.tool_call_parser,
        options.reasoning_parser,
        limits=limits,
        loras=loras,
        trust_request_chat_template=options.trust_request_chat_template,
    )
    store = ResponseStore(options.max_stored_responses, options.max_stored_response_bytes)
    engine.metrics.watch_responses(lambda: store.count, lambda: store.bytes)
    responses = OpenAIServingResponses(chat, store)
    pooling = OpenAIServingPooling(engine, render_chat, names, options.max_score_documents, limits=limits, loras=loras)
    info = _ServingInfo(engine, render_chat, names, loras=loras)
    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.post("/v1/completions")(completion.create)
    app.post("/v1/chat/completions")(chat.create)
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.retrieve)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    app.post("/v1/responses/{response_id}/cancel")(responses.cancel)
    app.post("/v1/embeddings")(pooling.embeddings)
    for paths, route in ((_SCORE_PATHS, pooling.score), (_RERANK_PATHS, pooling.rerank)):
        for path in paths:
            app.post(path, include_in_schema=path == paths[0])(route)
    app.get("/v1/models")(info.models)
    app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)(info.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)(info.unload_lora_adapter)
    app.post("/tokenize")(info.tokenize)
    app.post("/detokenize")(info.detokenize)
    # Answers declared with their shapes, so that the OpenAPI schema (and Schemathesis, fuzzing from it) knows them.
    dead = {503: {"model": protocol.HealthResponse, "description": "the engine is not running"}}
    app.get("/health", response_model=protocol.HealthResponse, responses=dead)(info.health)
    app.get("/metrics", response_class=PlainTextResponse)(info.metrics)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if options.api_key is not None:
        # Probes carry no key; scrapers may (Prometheus sends it as a bearer token) when asked to.
        open_paths = frozenset({"/health"} if options.metrics_need_key else {"/health", "/metrics"})
        app.add_middleware(_ApiKeyMiddleware, api_key=options.api_key, open_paths=open_paths)
    app.add_middleware(_BackpressureMiddleware, engine=engine)
    app.add_middleware(_BodyLimitMiddleware, limit=options.max_body_bytes)  # added last: runs first
    return app


class _ServingInfo(OpenAIServing):
    """The endpoints that generate nothing: the models and their LoRA adapters, the tokenizer, health and
    metrics."""

    async def models(self) -> protocol.ModelList:
        created, max_model_len, task = int(time.time()), self.engine.max_model_len, self.engine.task
        cards = [
            protocol.ModelCard(id=name, created=created, max_model_len=max_model_len, task=task) for name in self.names
        ]
        cards += [
            protocol.ModelCard(
                id=lora.lora_name,
                created=created,
                max_model_len=max_model_len,
                task=task,
                root=lora.lora_path,
                parent=self.names[0],
            )
            for lora in self.loras.adapters()
        ]
        return protocol.ModelList(data=cards)

    async def load_lora_adapter(self, body: protocol.LoadLoRAAdapterRequest) -> str:
        """vLLM's: the core reads the adapter and checks it against the model before its name is served; a bad
        folder, a rank over --max-lora-rank or a weight of the wrong shape is a 400 naming lora_path."""
        lora = self.loras.new(body.lora_name, body.lora_path)
        try:
            await self.engine.add_lora(lora)
        except ValueError as error:
            raise ApiError(400, str(error), param="lora_path") from error
        except EngineStoppedError as error:
            raise ApiError(503, str(error), kind="server_error") from error
        try:
            self.loras.add(lora)
        except ApiError:
            self.engine.remove_lora(lora.lora_int_id)  # another load took the name while this one was read
            raise
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: protocol.UnloadLoRAAdapterRequest) -> str:
        """vLLM's: the name stops being served at once; requests already running under it finish first."""
        lora = self.loras.remove(body.lora_name)
        self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."

    async def tokenize(self, body: protocol.TokenizeRequest) -> protocol.TokenizeResponse:
        self._model(body.model)
        if body.messages is not None:
            tokens = (await self._render(body.messages, body.add_generation_prompt, bounded=False))["prompt_token_ids"]
        else:  # on a thread, as every tokenization in this process: the tokenizer releases the GIL
            encode = partial(self.engine.tokenizer.encode, add_special_tokens=body.add_special_tokens)
            tokens = await asyncio.to_thread(encode, body.prompt)
        return protocol.TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    async def detokenize(self, body: protocol.DetokenizeRequest) -> protocol.DetokenizeResponse:
        self._model(body.model)
        vocab = len(self.engine.tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return protocol.DetokenizeResponse(prompt=self.engine.tokenizer.decode(body.tokens))

    async def health(self) -> JSONResponse:
        """503 when the engine is dead (restart the server); 200 otherwise, the body saying whether it is
        overloaded (new requests get 503 with Retry-After until the queue shrinks), which is no reason to
        restart it."""
        engine = self.engine
        if not engine.is_running:
            dead = protocol.HealthResponse(status="dead", message="the engine is not running")
            return JSONResponse(dead.model_dump(exclude_none=True), status_code=503)
        status = "overloaded" if engine.overloaded else "ok"
        alive = protocol.HealthResponse(status=status, num_waiting=engine.num_waiting, max_waiting=engine.max_waiting)
        return JSONResponse(alive.model_dump(exclude_none=True))

    async def metrics(self) -> Response:
        await self.engine.refresh_stats()
        return Response(self.engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)


# ---- errors and the API key -----------------------------------------------------------------


async def _api_error(_: Request, error: ApiError) -> JSONResponse:
    return error.response()


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    problems = error.errors()
    first = problems[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return ApiError(400, f"malformed JSON body: {detail}").response()
    param = _param(first["loc"])
    messages = [_problem(problem) for problem in problems[:3]]
    return ApiError(400, "; ".join(messages), param=param).response()


def _problem(problem: dict) -> str:
    param = _param(problem["loc"])
    if problem["type"] == "extra_forbidden":
        return f"unknown field: {param}"
    message = problem["msg"].removeprefix("Value error, ")
    return f"{param}: {message}" if param else message


def _param(loc: tuple) -> str | None:
    """'messages.0.role' from ('body', 'messages', 0, 'role'), without pydantic's union tags ('list[int]')."""
    parts = [str(part) for part in loc[1:] if not _is_union_tag(part)]
    return ".".join(parts) or None


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    return ApiError(error.status_code, str(error.detail)).response()


async def _internal_error(_: Request, error: Exception) -> JSONResponse:
    return ApiError(500, f"internal server error: {error!r}", kind="server_error").response()


class _BodyLimitMiddleware:
    """Refuse a request body over `limit` bytes with a 413 before it is read whole: by its Content-Length,
    or, for a chunked body, as soon as the chunks pass the limit (the app is then told the client left)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        received, over, started = 0, False, False

        async def counting() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                over = True
                return {"type": "http.disconnect"}
            return message

        async def watching(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the app answers a client it believes gone; the 413 below answers instead
            started = True
            await send(message)

        try:
            await self.app(scope, counting, watching)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over the server's limit of {self.limit} bytes (--max-body-bytes)"
        await ApiError(413, message, code="request_too_large").response()(scope, receive, send)


class _BackpressureMiddleware:
    """While the engine is overloaded, a request that would add engine requests is refused before its body is read:
    503 with Retry-After, so that well-behaved clients back off instead of queueing without bound."""

    def __init__(self, app: ASGIApp, engine: AsyncLLMEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in _ENGINE_PATHS and self.engine.overloaded:
            message = (
                f"the server is overloaded: {self.engine.num_waiting} requests are waiting for their first token "
                f"(--max-waiting-requests {self.engine.max_waiting}); retry later"
            )
            refusal = ApiError(503, message, kind="server_error", code="server_overloaded").response()
            refusal.headers["Retry-After"] = "1"
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _ApiKeyMiddleware:
    """A pure ASGI middleware: unlike BaseHTTPMiddleware, it leaves streaming and disconnects untouched. The
    key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        refusal = ApiError(401, "invalid or missing API key", code="invalid_api_key").response()
        await refusal(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = Headers(scope=scope).get("authorization", "").encode()
        return secrets.compare_digest(given, self.expected)
