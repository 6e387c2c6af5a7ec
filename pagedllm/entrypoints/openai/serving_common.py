"""What the endpoints share: errors in OpenAI's shape, the model check (a base model's served name or a LoRA
adapter's, `LoRARegistry`), the server's limits on a request, the chat template, sampling (or beam search)
parameters and constraints from a request, adding requests to the engine, and their outputs as one response or
as a stream of server-sent events."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import ServeOptions
from pagedllm.domains import Texts
from pagedllm.entrypoints.openai import protocol, tool_parsers
from pagedllm.entrypoints.openai.async_engine import (
    AsyncLLMEngine,
    EngineStoppedError,
    Output,
    RequestFailedError,
    RequestGroup,
)
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.pooling import EMBED, GENERATE, SCORE, task_parts
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

_OWN_WAY = {"temperature", "max_tokens", "logprobs", "best_of", "prompt_logprobs", "structured_outputs"}
_SHARED_SAMPLING_FIELDS = [spec.name for spec in fields(SamplingParams) if spec.name not in _OWN_WAY]
Reply = TypeVar("Reply", bound=BaseModel)  # a whole response, or one chunk of a stream
# (conversation, add_generation_prompt, tools, chat_template, template_kwargs) -> the prompt with its token ids
RenderChat = Callable[[list[dict[str, Any]], bool, list[dict] | None, str | None, dict[str, Any] | None], dict]
EngineParams = SamplingParams | BeamSearchParams | PoolingParams
GenerateRequest = protocol.CompletionRequest | protocol.ChatCompletionRequest
# Fields beam search has no use for: given with use_beam_search, they would be ignored, so they are refused.
_NOT_WITH_BEAMS = (
    "best_of",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


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
class ServingLimits:
    """What one request may ask for beyond what its fields' types allow: each is the `pagedllm serve` flag of
    ServeOptions' field of the same name, and a request over one is refused naming the field and the flag."""

    max_n: int
    max_logprobs: int
    max_stop: int
    max_stop_len: int
    max_prompts: int

    @classmethod
    def from_options(cls, options: ServeOptions) -> ServingLimits:
        return cls(**{spec.name: getattr(options, spec.name) for spec in fields(cls)})

    def check(self, body: protocol.SamplingRequest) -> None:
        for param, count in body.sample_counts.items():
            self._at_most(param, count, "max_n")
        for param, count in body.logprob_counts.items():
            self._at_most(param, count, "max_logprobs")
        self._at_most("stop", len(body.stop_strings), "max_stop", "the number of stop strings")
        self._at_most("stop_token_ids", len(body.stop_token_ids or ()), "max_stop", "the number of stop_token_ids")
        longest = max(map(len, body.stop_strings), default=0)
        self._at_most("stop", longest, "max_stop_len", "the length of a stop string")
        self._at_most("prompt", body.num_prompts, "max_prompts", "the number of prompts")

    def _at_most(self, param: str, value: int | None, limit: str, what: str | None = None) -> None:
        at_most(param, value, getattr(self, limit), limit, what)


def at_most(param: str, value: int | None, bound: int, limit: str, what: str | None = None) -> None:
    """A 400 naming `param` and the flag of ServeOptions' field `limit` when `value` is over its `bound`."""
    if value is not None and value > bound:
        flag = "--" + limit.replace("_", "-")
        message = f"{what or param} must be less than or equal to {bound}, the server's limit ({flag}); got {value}"
        raise ApiError(400, message, param=param)


DEFAULT_LIMITS = ServingLimits.from_options(ServeOptions())
# What a server of each task answers, for the 400 of a route it does not serve.
_TASK_ROUTES = {
    GENERATE: "it generates text (/v1/completions, /v1/chat/completions, /v1/responses)",
    EMBED: "it gives embeddings (/v1/embeddings) and their cosine similarity (/v1/score, /v1/rerank)",
    SCORE: "it scores pairs of texts (/v1/score, /v1/rerank)",
}


_NAMES = Texts()


class LoRARegistry:
    """The LoRA adapters the server serves, by the name a request's `model` field gives (`--lora-modules`,
    `/v1/load_lora_adapter`). Each registration takes a fresh id, never reused: an adapter loaded again under an
    old name after an unload must not share the old one's weights or cached blocks in the engine core."""

    def __init__(self, enabled: bool = False, base_names: tuple[str, ...] = ()) -> None:
        self.enabled = enabled
        self.base_names = base_names
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._adapters.get(name) if name is not None else None

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for the adapter at `path` under `name`, with a fresh id; ApiError (400) naming the field
        when LoRA is off or the name is taken. `add` serves it once the engine has loaded it."""
        if not self.enabled:
            raise ApiError(400, "LoRA adapters need the server started with --enable-lora", param="lora_name")
        self.check_name(name)
        if not path:
            raise ApiError(400, "lora_path must name the adapter's folder", param="lora_path")
        try:
            return LoRARequest(name, next(self._ids), path)
        except ValueError as error:
            raise ApiError(400, str(error), param="lora_path") from error

    def check_name(self, name: str) -> None:
        if not _NAMES.admits(name):  # the rule --lora-modules' names follow
            raise ApiError(400, f"lora_name must be {_NAMES.describe()}, got {name!r}", param="lora_name")
        if name in self.base_names or name in self._adapters:
            message = f"lora_name {name!r} is already served: unload it first or pick another name"
            raise ApiError(400, message, param="lora_name")

    def add(self, request: LoRARequest) -> None:
        """Serve `request` by its name (checked again: another load may have taken it meanwhile)."""
        self.check_name(request.lora_name)
        self._adapters[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        """Stop serving `name` at once (new requests naming it get 404); ApiError 404 if it is not served."""
        request = self._adapters.pop(name, None)
        if request is None:
            raise ApiError(404, f"The LoRA adapter `{name}` is not loaded.", param="lora_name", code="model_not_found")
        return request


@dataclass(frozen=True, slots=True)
class Call:
    """What every response and chunk of one API call repeats."""

    id: str
    created: int
    model: str
    lora_request: LoRARequest | None = None  # the adapter `model` names, if it names one

    def wrap(self, kind: type[Reply], choices: list, usage: protocol.Usage | None = None) -> Reply:
        return kind(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


@dataclass(frozen=True)
class OpenAIServing:
    """A group of endpoints over the engine: completions, chat, and the rest in the app's module."""

    engine: AsyncLLMEngine
    render_chat: RenderChat
    names: tuple[str, ...]  # the served model names; the first is the default
    # Keyword-only, so that subclasses' own fields keep their places in the constructor's arguments.
    limits: ServingLimits = field(default=DEFAULT_LIMITS, kw_only=True)
    loras: LoRARegistry = field(default_factory=LoRARegistry, kw_only=True)
    trust_request_chat_template: bool = field(default=False, kw_only=True)

    def _call(self, prefix: str, model: str | None, tasks: tuple[str, ...] = (GENERATE,)) -> Call:
        """The call's id and model; a 400 unless the engine runs one of `tasks`, those the route serves (an engine's
        task may be two: generate,embed)."""
        name = self._model(model)
        runs = task_parts(self.engine.task)
        if not set(tasks) & set(runs):
            serves = "; ".join(_TASK_ROUTES[task] for task in runs)
            message = f"this server's task is {self.engine.task}: {serves}; this route needs --task {tasks[0]}"
            raise ApiError(400, message, param="model", code="wrong_task")
        return Call(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), name, self.loras.get(name))

    def _check(self, body: GenerateRequest) -> None:
        """Refuse, naming the field, what the server's limits or the model rule out before any prompt is read."""
        self.limits.check(body)
        for param, tokens in (body.max_output, ("min_tokens", body.min_tokens)):
            # Not the prompt's fault: even a one-token prompt would leave no room for this many.
            if tokens is not None and tokens >= self.engine.max_model_len:
                message = f"{param} must be less than max_model_len ({self.engine.max_model_len}); got {tokens}"
                raise ApiError(400, message, param=param)
        # The vocabulary is the tokenizer's: a stop token id past it would index the logits out of bounds.
        vocab = len(self.engine.tokenizer)
        outside = [token for token in body.stop_token_ids or () if token >= vocab]
        if outside:
            message = f"stop_token_ids: token id {outside[0]} is outside the vocabulary [0, {vocab})"
            raise ApiError(400, message, param="stop_token_ids")

    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.names[0]
        if requested not in self.names and self.loras.get(requested) is None:
            raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    async def _render(
        self,
        messages: list[protocol.ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        bounded: bool = True,
        rendering: Rendering | None = None,
    ) -> dict:
        """The chat through its template, with its token ids, rendered on a thread (the tokenizer releases the
        GIL, so the event loop keeps serving). `bounded`: messages certainly too long for the model are refused
        first, unrendered (`/tokenize` counts any length)."""
        if bounded:
            self._check_text_fits("".join(message.text for message in messages), "messages")
        rendering = rendering or Rendering(self.engine.tokenizer.chat_template)
        rendering.check()
        conversation, tools = tool_parsers.conversation(messages, tools, rendering.template)
        render = partial(self.render_chat, conversation, add_generation_prompt, tools)
        try:
            return await asyncio.to_thread(render, rendering.chat_template, rendering.kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as error:
            raise ApiError(400, f"cannot apply the chat template: {error}", param="messages") from error

    async def _tokenized(self, prompts: list[dict], param: str) -> list[dict]:
        """Every prompt with its token ids: a text is tokenized here, on a thread, so that the engine core's
        stepping thread never does it; one certainly too long for the model is refused first, untokenized."""
        out = []
        for prompt in prompts:
            if "prompt_token_ids" not in prompt:
                self._check_text_fits(prompt["prompt"], param)
                ids = await asyncio.to_thread(self.engine.tokenizer.encode, prompt["prompt"])
                prompt = {**prompt, "prompt_token_ids": ids}
            out.append(prompt)
        return out

    def _check_text_fits(self, text: str, param: str) -> None:
        try:
            self.engine.text_bound.check(text, self.engine.max_model_len)
        except ValueError as error:
            raise ApiError(400, str(error), param=param) from error

    async def _add(
        self,
        prompts: list[dict],
        cache_salt: str | None,
        params: EngineParams,
        param: str,
        constraint: Constraint | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestGroup:
        if constraint is not None:
            await self._compile(params, constraint)
        if cache_salt is not None:
            prompts = [{**prompt, "cache_salt": cache_salt} for prompt in prompts]
        try:
            return await self.engine.add_requests(prompts, params, lora_request)
        except ValueError as error:  # refused by the engine: too long, empty, outside the vocabulary
            param = "logit_bias" if "logit_bias token id" in str(error) else param
            raise ApiError(400, str(error), param=param) from error
        except EngineStoppedError as error:
            raise ApiError(503, str(error), kind="server_error") from error

    async def _compile(self, params: EngineParams, constraint: Constraint) -> None:
        try:
            await self.engine.compile_constraint(params)
        except ValueError as error:  # fail closed: never run a constraint that does not compile unconstrained
            raise ApiError(400, f"{constraint.param}: {error}", param=constraint.param) from error

    def _room(self, prompts: list[dict]) -> int:
        """The most tokens every prompt (tokenized: `_tokenized`, `_render`) leaves room for (at least 1: a prompt
        that fills the context is refused by the engine, with its length)."""
        longest = max(len(prompt["prompt_token_ids"]) for prompt in prompts)
        return max(self.engine.max_model_len - longest, 1)


# apply_chat_template's own arguments: a template kwarg of one of these names would replace what the server passes.
_RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True, slots=True)
class Rendering:
    """How one request's chat is rendered: the template in force (the model's, or the request's own
    `chat_template`) and the request's `chat_template_kwargs`."""

    template: str | None
    chat_template: str | None = None  # the request's own, if any
    kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        reserved = sorted(_RESERVED_TEMPLATE_ARGS & set(self.kwargs or ()))
        if reserved:
            message = f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do"
            raise ApiError(400, message, param="chat_template_kwargs")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A structured-output constraint and the request field it came from, which its errors name."""

    param: str
    spec: StructuredOutputsParams


def constraint(body: protocol.SamplingRequest, *more: Constraint) -> Constraint | None:
    """The one constraint the request asks for, from whichever field it used; 400 if several."""
    given = [*_requested_constraints(body), *more]
    if len(given) > 1:
        names = ", ".join(c.param for c in given)
        raise ApiError(400, f"give at most one output constraint, got {names}", param=given[1].param)
    return given[0] if given else None


def _requested_constraints(body: protocol.SamplingRequest) -> list[Constraint]:
    found = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(_constraint("response_format", _format_spec(body.response_format)))
    if body.structured_outputs is not None:
        found.append(
            _constraint("structured_outputs", body.structured_outputs.model_dump(by_alias=True, exclude_none=True))
        )
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    for param, kind in guided.items():
        if getattr(body, param) is not None:
            found.append(_constraint(param, {kind: getattr(body, param)}))
    return found


def _format_spec(response_format: protocol.ResponseFormat) -> dict:
    """json_schema's schema; json_object's own schema where the client gave one; else any JSON object."""
    if response_format.json_schema is not None:
        return {"json": response_format.json_schema.schema_}
    if response_format.schema_ is not None:
        return {"json": response_format.schema_}
    return {"json_object": True}


def _constraint(param: str, spec: dict) -> Constraint:
    try:
        return Constraint(param, StructuredOutputsParams(**spec))
    except ValueError as error:
        raise ApiError(400, f"{param}: {error}", param=param) from error


def sampling_params(
    body: protocol.SamplingRequest,
    constraint: Constraint | None,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    best_of: int | None = None,
) -> SamplingParams:
    """The request's sampling fields that SamplingParams shares by name, plus those each endpoint reads its
    own way."""
    shared = {name: getattr(body, name) for name in _SHARED_SAMPLING_FIELDS if name in type(body).model_fields}
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        return SamplingParams(
            **shared,
            temperature=temperature,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            best_of=best_of,
            structured_outputs=constraint.spec if constraint is not None else None,
        )
    except ValueError as error:  # rules across fields, e.g. min_tokens <= max_tokens; messages start with the field
        field_name = str(error).split(" ", 1)[0]
        raise ApiError(400, str(error), param=field_name if field_name in type(body).model_fields else None) from error


def beam_params(body: protocol.SamplingRequest, constraint: Constraint | None, max_tokens: int) -> BeamSearchParams:
    """vLLM's `use_beam_search`: `n` beams, best first. Fields that sampling alone uses are refused."""
    if constraint is not None:
        raise ApiError(400, f"{constraint.param} cannot be combined with use_beam_search", param=constraint.param)
    fields_ = type(body).model_fields
    for name in _NOT_WITH_BEAMS:
        if name in fields_ and getattr(body, name) != fields_[name].default:
            raise ApiError(400, f"{name} cannot be combined with use_beam_search", param=name)
    try:
        return BeamSearchParams(body.n, max_tokens, body.ignore_eos, body.length_penalty)
    except ValueError as error:
        raise ApiError(400, str(error), param=str(error).split(" ", 1)[0]) from error


def usage(finals: list[RequestOutput]) -> protocol.Usage:
    prompt = sum(len(output.prompt_token_ids) for output in finals)
    completion = sum(len(c.token_ids) for output in finals for c in output.outputs)
    cached = protocol.PromptTokensDetails(cached_tokens=sum(output.num_cached_tokens or 0 for output in finals))
    return protocol.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=cached,
    )


def sampled_logprob(completion: CompletionOutput, position: int) -> Logprob:
    return completion.logprobs[position][completion.token_ids[position]]


def most_likely(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens; the entry also holds the sampled (or prompt) token, which may rank below them."""
    return sorted(entry.values(), key=lambda lp: lp.rank)[:k]


def prompt_logprobs(output: RequestOutput, k: int) -> protocol.PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: each prompt token's entry (its own token and the k most likely), the first
    null. The engine may have computed more than k when echo asked for more."""
    if output.prompt_logprobs is None:
        return None
    return [
        None if entry is None else _prompt_entry(entry, token, k)
        for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True)
    ]


def _prompt_entry(entry: dict[int, Logprob], token: int, k: int) -> dict[str, protocol.PromptLogprob]:
    kept = {token_id for token_id, lp in entry.items() if token_id == token or lp.rank <= k}
    return {
        str(token_id): protocol.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
        for token_id, lp in entry.items()
        if token_id in kept
    }


# ---- one response ---------------------------------------------------------------------------


async def finals_or_abort(group: RequestGroup, request: Request) -> list[Output]:
    """The final output of each request, in prompt order. A client that disconnects first has its requests
    aborted at once, rather than left generating for nobody."""
    collecting = asyncio.ensure_future(_finals(group))
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([collecting, watching], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        # Decided before cancelling: a task asked to cancel is not cancelled (nor done) until it runs
        # again, and reading its result then raises InvalidStateError.
        left_first = not collecting.done()
        if left_first:
            collecting.cancel()
            group.abort()
    if left_first:
        raise ApiError(499, "the client closed the connection")
    return collecting.result()


async def _finals(group: RequestGroup) -> list[Output]:
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


def event_stream(
    chunks: AsyncIterator[BaseModel], group: RequestGroup, headers: dict[str, str] | None = None
) -> StreamingResponse:
    # The background abort covers a client that leaves before the first chunk, when `_sse` never starts;
    # aborting a finished group does nothing.
    events = _sse(chunks, group)
    abort = BackgroundTask(group.abort)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers, background=abort)


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


# None: the piece is not worth a choice; several: the first in this chunk, each next one in a chunk of its own
MakeChoice = Callable[[Piece], BaseModel | list[BaseModel] | None]


async def stream_chunks(
    call: Call, kind: type[Reply], group: RequestGroup, holdback: int, include_usage: bool, choice: MakeChoice
) -> AsyncIterator[Reply]:
    """A chunk of `kind` for each output that moved a completion, with the choices `choice` makes of the
    pieces; then, when asked for, a last chunk with the usage only. `holdback`: see `_Cursor`."""
    cursors: dict[tuple[int, int], _Cursor] = {}
    finals: dict[int, RequestOutput] = {}
    async for prompt_index, output in group:
        rounds: list[list[BaseModel]] = []  # the chunks this output makes: each completion's choices in turn
        for completion in output.outputs:
            cursor = cursors.setdefault((prompt_index, completion.index), _Cursor(holdback))
            moved = cursor.advance(completion)
            made = None if moved is None else choice(Piece(prompt_index, output, completion, *moved, not cursor.shown))
            if made is not None:
                cursor.shown = True
                for number, one in enumerate(made if isinstance(made, list) else [made]):
                    if number == len(rounds):
                        rounds.append([])
                    rounds[number].append(one)
        for choices in rounds:
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


def holdback(params: EngineParams) -> int:
    """How many characters of unfinished text a stream holds back: a stop string could still cut them."""
    if isinstance(params, BeamSearchParams) or not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1
