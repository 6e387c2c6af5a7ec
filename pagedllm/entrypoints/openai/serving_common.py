"""What the endpoints share: errors in OpenAI's shape, the model check, the chat template, sampling
parameters from a request, adding requests to the engine, and their outputs as one response or as a stream
of server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagedllm.entrypoints.openai import protocol
from pagedllm.entrypoints.openai.async_engine import (
    AsyncLLMEngine,
    EngineStoppedError,
    RequestFailedError,
    RequestGroup,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

_OWN_WAY = {"temperature", "max_tokens", "logprobs", "best_of"}
_SHARED_SAMPLING_FIELDS = [spec.name for spec in fields(SamplingParams) if spec.name not in _OWN_WAY]
Reply = TypeVar("Reply", bound=BaseModel)  # a whole response, or one chunk of a stream
RenderChat = Callable[[list[dict[str, str]], bool], dict]


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
        self.body = protocol.ErrorResponse(error=protocol.ErrorInfo(message=message, type=kind, param=param, code=code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status)


@dataclass(frozen=True, slots=True)
class Call:
    """What every response and chunk of one API call repeats."""

    id: str
    created: int
    model: str

    def wrap(self, kind: type[Reply], choices: list, usage: protocol.Usage | None = None) -> Reply:
        return kind(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


@dataclass(frozen=True)
class OpenAIServing:
    """A group of endpoints over the engine: completions, chat, and the rest in the app's module."""

    engine: AsyncLLMEngine
    render_chat: RenderChat
    names: tuple[str, ...]  # the served model names; the first is the default

    def _call(self, prefix: str, model: str | None) -> Call:
        return Call(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self._model(model))

    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    def _render(self, messages: list[protocol.ChatMessage], add_generation_prompt: bool) -> dict:
        try:
            return self.render_chat([m.for_template() for m in messages], add_generation_prompt)
        except (ValueError, TypeError, jinja2.TemplateError) as error:
            raise ApiError(400, f"cannot apply the chat template: {error}", param="messages") from error

    async def _add(
        self, prompts: list[dict], cache_salt: str | None, params: SamplingParams, param: str
    ) -> RequestGroup:
        if cache_salt is not None:
            prompts = [{**prompt, "cache_salt": cache_salt} for prompt in prompts]
        try:
            return await self.engine.add_requests(prompts, params)
        except ValueError as error:  # refused by the engine: too long, empty, outside the vocabulary
            raise ApiError(400, str(error), param=param) from error
        except EngineStoppedError as error:
            raise ApiError(503, str(error), kind="server_error") from error


def sampling_params(
    body: protocol.SamplingRequest, max_tokens: int | None, logprobs: int | None, best_of: int | None
) -> SamplingParams:
    """The request's sampling fields that SamplingParams shares by name, plus the four each endpoint
    reads its own way."""
    shared = {name: getattr(body, name) for name in _SHARED_SAMPLING_FIELDS if name in type(body).model_fields}
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        return SamplingParams(
            **shared, temperature=temperature, max_tokens=max_tokens, logprobs=logprobs, best_of=best_of
        )
    except ValueError as error:  # rules across fields, e.g. min_tokens <= max_tokens; messages start with the field
        field_name = str(error).split(" ", 1)[0]
        raise ApiError(400, str(error), param=field_name if field_name in type(body).model_fields else None) from error


def usage(finals: list[RequestOutput]) -> protocol.Usage:
    prompt = sum(len(output.prompt_token_ids) for output in finals)
    completion = sum(len(c.token_ids) for output in finals for c in output.outputs)
    return protocol.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def sampled_logprob(completion: CompletionOutput, position: int) -> Logprob:
    return completion.logprobs[position][completion.token_ids[position]]


def most_likely(completion: CompletionOutput, position: int, k: int) -> list[Logprob]:
    """The k most likely tokens; the entry also holds the sampled token, which may rank below them."""
    return sorted(completion.logprobs[position].values(), key=lambda lp: lp.rank)[:k]


# ---- one response ---------------------------------------------------------------------------


async def finals_or_abort(group: RequestGroup, request: Request) -> list[RequestOutput]:
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
    return collecting.result()


async def _finals(group: RequestGroup) -> list[RequestOutput]:
    try:
        finals = {index: output async for index, output in group if output.finished}
    except RequestFailedError as error:
        raise _server_error(error) from error
    return [finals[index] for index in sorted(finals)]


def _server_error(error: RequestFailedError) -> ApiError:
    return ApiError(500, str(error), kind="server_error")


async def _disconnected(request: Request) -> None:
    # Once the body is read, the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- a stream -------------------------------------------------------------------------------


def event_stream(chunks: AsyncIterator[BaseModel], group: RequestGroup) -> StreamingResponse:
    # The background abort covers a client that leaves before the first chunk, when `_sse` never starts;
    # aborting a finished group does nothing.
    events = _sse(chunks, group)
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(group.abort))


async def _sse(chunks: AsyncIterator[BaseModel], group: RequestGroup) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except RequestFailedError as error:
        yield f"data: {_server_error(error).body.model_dump_json()}\n\n"
    finally:
        group.abort()  # a disconnect cancels us mid-stream: give the blocks back now
    yield "data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Piece:
    """What a stream sends next of one completion: `text` and the positions of `tokens` not sent before."""

    prompt_index: int
    output: RequestOutput
    completion: CompletionOutput
    text: str
    tokens: range
    first: bool  # the first piece the client gets of this completion

    @classmethod
    def whole(cls, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> Piece:
        return cls(prompt_index, output, completion, completion.text, range(len(completion.token_ids)), first=True)

    def worth_sending(self, logprobs: int | None) -> bool:
        """Whether it tells the client anything: text, the end, or tokens whose logprobs were asked for."""
        return bool(self.text or self.completion.finish_reason is not None or (self.tokens and logprobs is not None))


MakeChoice = Callable[[Piece], BaseModel | None]  # None: the piece is not worth a choice


async def stream_chunks(
    call: Call, kind: type[Reply], group: RequestGroup, params: SamplingParams, include_usage: bool, choice: MakeChoice
) -> AsyncIterator[Reply]:
    """A chunk of `kind` for each output that moved a completion, with the choices `choice` makes of the
    pieces; then, when asked for, a last chunk with the usage only."""
    holdback = _holdback(params)
    cursors: dict[tuple[int, int], _Cursor] = {}
    finals: dict[int, RequestOutput] = {}
    async for prompt_index, output in group:
        choices = []
        for completion in output.outputs:
            cursor = cursors.setdefault((prompt_index, completion.index), _Cursor(holdback))
            moved = cursor.advance(completion)
            made = None if moved is None else choice(Piece(prompt_index, output, completion, *moved, not cursor.shown))
            if made is not None:
                cursor.shown = True
                choices.append(made)
        if choices:
            yield call.wrap(kind, choices)
        if output.finished:
            finals[prompt_index] = output
    if include_usage:
        yield call.wrap(kind, [], usage(list(finals.values())))


@dataclass(slots=True)
class _Cursor:
    """How much of one completion a stream has sent. While a stop string could still cut the text, its last
    `holdback` characters wait, so that the streamed text always adds up to the final text."""

    holdback: int
    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False
    # Whether a choice went out yet: the first one carries the echoed prompt. Outputs of a prompt still
    # being prefilled in chunks move nothing, and must not count as the first.
    shown: bool = False

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
