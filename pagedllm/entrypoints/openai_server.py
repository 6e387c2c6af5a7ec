"""`pagedllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLMEngine`.

`/v1/completions` and `/v1/chat/completions` (server-sent events when `stream` is true), `/v1/models`,
`/tokenize`, `/detokenize`, `/health` and `/metrics`. Every error has OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the offending field.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jinja2
import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.async_engine import AsyncLLMEngine, EngineStoppedError, RequestFailedError, RequestGroup
from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagedllm.metrics import METRICS_CONTENT_TYPE, ServerMetrics
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # open even with an API key: probes and scrapers carry none
_SHUTDOWN_BACKSTOP_S = 3.0  # after the grace period and the aborts, uvicorn cancels whatever still runs


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = (DEFAULT_SERVED_NAME,)
    shutdown_grace_s: float = 5.0
    fault_injection_text: str | None = None  # test-only: see async_engine._FaultInjectingTokenizer
    log_level: str = "warning"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))


def serve(llm: LLM, options: ServeOptions) -> int:
    """Serve until SIGTERM or SIGINT; then finish or abort in-flight requests and return 0."""
    _leave_a_core_to_http()
    metrics = ServerMetrics()
    engine = AsyncLLMEngine(llm.engine, metrics, options.fault_injection_text)
    api = OpenAIServing(engine, llm.render_chat, metrics, options.served_model_names)
    config = uvicorn.Config(
        build_app(api, options.api_key),
        host=options.host,
        port=options.port,
        log_level=options.log_level.lower(),
        timeout_graceful_shutdown=math.ceil(options.shutdown_grace_s + _SHUTDOWN_BACKSTOP_S),
    )
    banner = f"pagedllm: serving {options.served_model_names[0]} on http://{options.host}:{options.port}"
    _Server(config, on_exit=partial(engine.drain, options.shutdown_grace_s), banner=banner).run()
    return 0


def _leave_a_core_to_http() -> None:
    """Torch's threads spin between ops; with one per core, the event loop thread preempts one of them and
    each parallel op then waits a scheduler slice for it (streaming to 16 clients measured up to 10x slower on
    2 cores). As vLLM's CPU backend does, leave a core to the HTTP side, unless the user chose the count."""
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        torch.set_num_threads(torch.get_num_threads() - 1)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], banner: str) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._banner = banner

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


def build_app(api: OpenAIServing, api_key: str | None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        api.engine.start()
        yield
        await api.engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.get("/v1/models")(api.models)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics_text)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    return app


# ---- the endpoints --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Call:
    """What every response and chunk of one API call repeats."""

    id: str
    created: int
    model: str


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        render_chat: Callable[[list[dict[str, str]], bool], dict],
        metrics: ServerMetrics,
        served_model_names: tuple[str, ...],
    ) -> None:
        self.engine = engine
        self.render_chat = render_chat
        self.metrics = metrics
        self.names = served_model_names
        self.tokenizer = engine.tokenizer

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        call = self._call("cmpl", body.model)
        prompts = [_with_salt(prompt, body.cache_salt) for prompt in _prompt_list(body.prompt)]
        params = _sampling_params(body, body.max_tokens, body.logprobs, body.best_of)
        group = await self._add(prompts, params, param="prompt")
        shape = _CompletionShape(call, body.n, body.echo, body.logprobs, self._prompt_text)
        if body.stream:
            return _event_stream(_completion_chunks(shape, group, params, body.include_usage), group)
        finals = await _finals_or_abort(group, request)
        return JSONResponse(shape.response(finals).model_dump())

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        call = self._call("chatcmpl", body.model)
        prompt = _with_salt(self._chat_prompt(body), body.cache_salt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, max_tokens, top_logprobs, None)
        group = await self._add([prompt], params, param="messages")
        if body.stream:
            return _event_stream(_chat_chunks(call, group, params, body.include_usage), group)
        (final,) = await _finals_or_abort(group, request)
        return JSONResponse(_chat_response(call, final, top_logprobs).model_dump())

    async def models(self) -> ModelList:
        created = int(time.time())
        cards = [ModelCard(id=name, created=created, max_model_len=self.engine.max_model_len) for name in self.names]
        return ModelList(data=cards)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._model(body.model)
        if body.messages is not None:
            tokens = self._render([m.for_template() for m in body.messages], body.add_generation_prompt)
            tokens = tokens["prompt_token_ids"]
        else:
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._model(body.model)
        vocab = len(self.tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    async def health(self) -> Response:
        if not self.engine.is_running:
            raise ApiError(503, "the engine is not running", kind="server_error")
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def _call(self, prefix: str, model: str | None) -> _Call:
        return _Call(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self._model(model))

    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    def _chat_prompt(self, body: ChatCompletionRequest) -> dict:
        return self._render([m.for_template() for m in body.messages], body.add_generation_prompt)

    def _render(self, conversation: list[dict[str, str]], add_generation_prompt: bool) -> dict:
        try:
            return self.render_chat(conversation, add_generation_prompt)
        except (ValueError, TypeError, jinja2.TemplateError) as error:
            raise ApiError(400, f"cannot apply the chat template: {error}", param="messages") from error

    def _prompt_text(self, output: RequestOutput) -> str:
        return output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)

    async def _add(self, prompts: list[dict], params: SamplingParams, param: str) -> RequestGroup:
        try:
            return await self.engine.add_requests(prompts, params)
        except ValueError as error:  # refused by the engine: too long, empty, outside the vocabulary
            raise ApiError(400, str(error), param=param) from error
        except EngineStoppedError as error:
            raise ApiError(503, str(error), kind="server_error") from error


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _with_salt(prompt: dict, cache_salt: str | None) -> dict:
    return prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None, best_of: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            best_of=best_of,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as error:  # rules across fields, e.g. min_tokens <= max_tokens; messages start with the field
        field_name = str(error).split(" ", 1)[0]
        raise ApiError(400, str(error), param=field_name if field_name in type(body).model_fields else None) from error


# ---- collecting and streaming ---------------------------------------------------------------


async def _finals_or_abort(group: RequestGroup, request: Request) -> list[RequestOutput]:
    """The final output of each request, in prompt order. A client that disconnects first has its requests
    aborted at once, rather than left generating for nobody."""
    collecting = asyncio.ensure_future(_finals(group))
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([collecting, watching], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            group.abort()
    if collecting.cancelled():
        raise ApiError(499, "the client closed the connection")
    return _result_or_server_error(collecting)


async def _finals(group: RequestGroup) -> list[RequestOutput]:
    finals = {index: output async for index, output in group if output.finished}
    return [finals[index] for index in sorted(finals)]


def _result_or_server_error(task: asyncio.Future[list[RequestOutput]]) -> list[RequestOutput]:
    try:
        return task.result()
    except RequestFailedError as error:
        raise ApiError(500, str(error), kind="server_error") from error


async def _disconnected(request: Request) -> None:
    # Once the body is read, the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event_stream(chunks: AsyncIterator[BaseModel], group: RequestGroup) -> StreamingResponse:
    # The background abort covers a client that leaves before the first chunk, when `_sse` never starts;
    # aborting a finished group does nothing.
    events = _sse(chunks, group)
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(group.abort))


async def _sse(chunks: AsyncIterator[BaseModel], group: RequestGroup) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except RequestFailedError as error:
        failure = ApiError(500, str(error), kind="server_error")
        yield f"data: {failure.body.model_dump_json()}\n\n"
    finally:
        group.abort()  # a disconnect cancels us mid-stream: give the blocks back now
    yield "data: [DONE]\n\n"


@dataclass(slots=True)
class _Cursor:
    """How much of one completion a stream has sent. While a stop string could still cut the text, its last
    `holdback` characters wait, so that the streamed text always adds up to the final text."""

    holdback: int
    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False

    def advance(self, completion: CompletionOutput) -> tuple[str, range] | None:
        """The text and token positions not sent yet, or None when nothing moved."""
        if self.finished:
            return None
        self.finished = completion.finish_reason is not None
        text_end = len(completion.text)
        if not self.finished:
            text_end = max(text_end - self.holdback, self.text_sent)
        text = completion.text[self.text_sent : text_end]
        tokens = range(self.tokens_sent, len(completion.token_ids))
        self.text_sent, self.tokens_sent = text_end, len(completion.token_ids)
        if not (text or tokens or self.finished):
            return None
        return text, tokens


def _holdback(params: SamplingParams) -> int:
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1


def _usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(output.prompt_token_ids) for output in finals)
    completion = sum(len(c.token_ids) for output in finals for c in output.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ---- completions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _CompletionShape:
    """How one completions call turns engine outputs into choices."""

    call: _Call
    n: int
    echo: bool
    logprobs: int | None
    prompt_text: Callable[[RequestOutput], str]

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = [
            self.choice(index, completion, self._echoed(output), completion.text, range(len(completion.token_ids)))
            for index, output in enumerate(finals)
            for completion in output.outputs
        ]
        return CompletionResponse(
            id=self.call.id, created=self.call.created, model=self.call.model, choices=choices, usage=_usage(finals)
        )

    def choice(
        self, prompt_index: int, completion: CompletionOutput, echoed: str, text: str, tokens: range
    ) -> CompletionChoice:
        """The choice for `tokens` of `completion`, whose text is `text`, after `echoed` (the prompt, or '')."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = _completion_logprobs(completion, tokens, self.logprobs)
        return CompletionChoice(
            index=prompt_index * self.n + completion.index,
            text=echoed + text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        call = self.call
        return CompletionResponse(id=call.id, created=call.created, model=call.model, choices=choices, usage=usage)

    def _echoed(self, output: RequestOutput) -> str:
        return self.prompt_text(output) if self.echo else ""


async def _completion_chunks(
    shape: _CompletionShape, group: RequestGroup, params: SamplingParams, include_usage: bool
) -> AsyncIterator[CompletionResponse]:
    cursors: dict[tuple[int, int], _Cursor] = {}
    finals: dict[int, RequestOutput] = {}
    async for prompt_index, output in group:
        choices = []
        for completion in output.outputs:
            key = (prompt_index, completion.index)
            first = key not in cursors
            cursor = cursors.setdefault(key, _Cursor(_holdback(params)))
            moved = cursor.advance(completion)
            if moved is None:
                continue
            text, tokens = moved
            echoed = shape.prompt_text(output) if first and shape.echo else ""
            if echoed or text or cursor.finished or (tokens and shape.logprobs is not None):
                choices.append(shape.choice(prompt_index, completion, echoed, text, tokens))
        if choices:
            yield shape.chunk(choices)
        if output.finished:
            finals[prompt_index] = output
    if include_usage:
        yield shape.chunk([], _usage(list(finals.values())))


def _completion_logprobs(completion: CompletionOutput, tokens: range, k: int) -> CompletionLogprobs:
    """`text_offset` counts from the start of the completion (never echoed: echo excludes logprobs), so in a
    stream it starts after the tokens sent before."""
    offset = sum(len(completion.logprobs[p][completion.token_ids[p]].decoded_token or "") for p in range(tokens.start))
    result = CompletionLogprobs()
    for position in tokens:
        entry = completion.logprobs[position]
        sampled = entry[completion.token_ids[position]]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in _top(entry, k)})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens; the entry also holds the sampled token, which may rank below them."""
    return sorted(entry.values(), key=lambda lp: lp.rank)[:k]


# ---- chat completions -----------------------------------------------------------------------


def _chat_response(call: _Call, final: RequestOutput, top_logprobs: int | None) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=completion.index,
            message=AssistantMessage(content=completion.text),
            logprobs=_chat_logprobs(completion, range(len(completion.token_ids)), top_logprobs),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        for completion in final.outputs
    ]
    return ChatCompletionResponse(
        id=call.id, created=call.created, model=call.model, choices=choices, usage=_usage([final])
    )


@dataclass(slots=True)
class _ChatStream:
    call: _Call
    params: SamplingParams
    cursors: dict[int, _Cursor] = field(default_factory=dict)

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        call = self.call
        return ChatCompletionChunk(id=call.id, created=call.created, model=call.model, choices=choices, usage=usage)

    def choice(self, completion: CompletionOutput) -> ChatChunkChoice | None:
        cursor = self.cursors.setdefault(completion.index, _Cursor(_holdback(self.params)))
        moved = cursor.advance(completion)
        if moved is None:
            return None
        text, tokens = moved
        logprobs = _chat_logprobs(completion, tokens, self.params.logprobs)
        if not (text or cursor.finished or (tokens and logprobs is not None)):
            return None
        return ChatChunkChoice(
            index=completion.index,
            delta=Delta(content=text),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


async def _chat_chunks(
    call: _Call, group: RequestGroup, params: SamplingParams, include_usage: bool
) -> AsyncIterator[ChatCompletionChunk]:
    stream = _ChatStream(call, params)
    # OpenAI opens every choice with the role, before any content.
    yield stream.chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(params.n)])
    final = None
    async for _, output in group:
        choices = [choice for completion in output.outputs if (choice := stream.choice(completion)) is not None]
        if choices:
            yield stream.chunk(choices)
        final = output if output.finished else final
    if include_usage and final is not None:
        yield stream.chunk([], _usage([final]))


def _chat_logprobs(completion: CompletionOutput, tokens: range, k: int | None) -> ChatLogprobs | None:
    if k is None:
        return None
    content = []
    for position in tokens:
        entry = completion.logprobs[position]
        sampled = entry[completion.token_ids[position]]
        top = [_top_logprob(lp) for lp in _top(entry, k)]
        content.append(TokenLogprob(**_top_logprob(sampled).model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_logprob(logprob: Logprob) -> TopLogprob:
    token = logprob.decoded_token or ""
    return TopLogprob(token=token, logprob=logprob.logprob, bytes=list(token.encode()))


# ---- errors and the API key -----------------------------------------------------------------


def _error_response(status: int, body: ErrorResponse) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status)


async def _api_error(_: Request, error: ApiError) -> JSONResponse:
    return _error_response(error.status, error.body)


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    problems = error.errors()
    first = problems[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return _error_response(400, ApiError(400, f"malformed JSON body: {detail}").body)
    param = _param(first["loc"])
    messages = [_problem(problem) for problem in problems[:3]]
    return _error_response(400, ApiError(400, "; ".join(messages), param=param).body)


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
    return _error_response(error.status_code, ApiError(error.status_code, str(error.detail)).body)


async def _internal_error(_: Request, error: Exception) -> JSONResponse:
    body = ApiError(500, f"internal server error: {error!r}", kind="server_error").body
    return _error_response(500, body)


class _ApiKeyMiddleware:
    """A pure ASGI middleware: unlike BaseHTTPMiddleware, it leaves streaming and disconnects untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = ApiError(401, "invalid or missing API key", code="invalid_api_key").body
        await _error_response(401, body)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = Headers(scope=scope).get("authorization", "").encode()
        return secrets.compare_digest(given, self.expected)
