"""`POST /v1/chat/completions`: the messages (and tools) through the chat template, `n` replies (or `n` beams),
optionally constrained, with the tool calls found in them, optionally streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai import protocol, tool_parsers
from pagedllm.entrypoints.openai import serving_common as common
from pagedllm.entrypoints.openai.async_engine import RequestGroup
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class _ToolUse:
    """What a request's tools and tool_choice ask of the prompt, the decoding and the reply."""

    offered: list[dict] | None  # the tools the template gets
    constraint: common.Constraint | None  # a named or required choice is enforced
    parser: tool_parsers.ToolParser | None  # how tool calls are read from the reply; None: a plain reply


@dataclass(frozen=True)
class OpenAIServingChat(common.OpenAIServing):
    tool_call_parser: str = "auto"

    async def create(self, body: protocol.ChatCompletionRequest, request: Request) -> Response:
        call = self._call("chatcmpl", body.model)
        self._check(body)
        tools = self._tool_use(body)
        prompt = await self._render(body.messages, body.add_generation_prompt, tools.offered)
        constraint = common.constraint(body, *filter(None, [tools.constraint]))
        _, max_tokens = body.max_output
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.use_beam_search:
            params = common.beam_params(body, constraint, max_tokens or self._room([prompt]))
        else:
            params = common.sampling_params(
                body, constraint, max_tokens=max_tokens, logprobs=top_logprobs, prompt_logprobs=body.prompt_logprobs
            )
        group = await self._add(
            [prompt], body.cache_salt, params, param="messages", constraint=constraint, lora_request=call.lora_request
        )
        shape = _ChatShape(call, top_logprobs, tools.parser)
        if body.stream:
            chunks = _chat_chunks(shape, group, body.n, common.holdback(params), body.include_usage)
            return common.event_stream(chunks, group)
        (final,) = await common.finals_or_abort(group, request)
        return JSONResponse(shape.response(final, body.prompt_logprobs).model_dump())

    def _tool_use(self, body: protocol.ChatCompletionRequest) -> _ToolUse:
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if choice == "none":
            return _ToolUse(None, None, None)
        if not body.tools:
            raise common.ApiError(400, f"tool_choice {_choice_name(choice)} needs tools", param="tool_choice")
        offered = [tool.model_dump(exclude_none=True) for tool in body.tools]
        template = self.engine.tokenizer.chat_template
        if choice == "auto":
            return _ToolUse(offered, None, tool_parsers.auto_parser(self.tool_call_parser, template))
        if choice == "required":
            schema = tool_parsers.required_schema(body.tools, body.parallel_tool_calls)
            return _ToolUse(offered, _json_constraint(schema), tool_parsers.RequiredCallsParser())
        named = next((tool for tool in body.tools if tool.function.name == choice.function.name), None)
        if named is None:
            known = ", ".join(tool.function.name for tool in body.tools)
            message = f"tool_choice names {choice.function.name!r}, which is not among the tools ({known})"
            raise common.ApiError(400, message, param="tool_choice")
        schema = tool_parsers.arguments_schema(named)
        return _ToolUse(offered, _json_constraint(schema), tool_parsers.NamedCallParser(named.function.name))


def _choice_name(choice: str | protocol.NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"


def _json_constraint(schema: dict) -> common.Constraint:
    return common.Constraint("tool_choice", StructuredOutputsParams(json=schema))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class _Reply:
    """A finished completion's text as the client sees it: content and tool calls."""

    parsed: tool_parsers.Parsed
    finish_reason: str | None

    @classmethod
    def of(cls, completion: CompletionOutput, parser: tool_parsers.ToolParser | None) -> _Reply:
        parsed = parser.parse(completion.text) if parser is not None else tool_parsers.Parsed(completion.text)
        # A reply the length limit cut says so, calls or not: the calls given are those completed before the cut.
        called = parsed.calls and completion.finish_reason != "length"
        return cls(parsed, "tool_calls" if called else completion.finish_reason)


@dataclass(frozen=True, slots=True)
class _ChatShape:
    """How one chat call turns engine outputs into choices."""

    call: common.Call
    k: int | None  # top_logprobs, when logprobs are asked for
    parser: tool_parsers.ToolParser | None

    def response(self, final: RequestOutput, prompt_logprobs: int | None) -> protocol.ChatCompletionResponse:
        choices = [self._choice(completion) for completion in final.outputs]
        response = self.call.wrap(protocol.ChatCompletionResponse, choices, common.usage([final]))
        if prompt_logprobs is not None:
            response.prompt_logprobs = common.prompt_logprobs(final, prompt_logprobs)
        return response

    def _choice(self, completion: CompletionOutput) -> protocol.ChatChoice:
        reply = _Reply.of(completion, self.parser)
        calls = [
            protocol.ToolCall(id=_call_id(), function=protocol.FunctionCall(name=c.name, arguments=c.arguments))
            for c in reply.parsed.calls
        ]
        return protocol.ChatChoice(
            index=completion.index,
            message=protocol.AssistantMessage(content=reply.parsed.content, tool_calls=calls or None),
            logprobs=_chat_logprobs(completion, range(len(completion.token_ids)), self.k),
            finish_reason=reply.finish_reason,
            stop_reason=completion.stop_reason,
        )


async def _chat_chunks(
    shape: _ChatShape, group: RequestGroup, n: int, holdback: int, include_usage: bool
) -> AsyncIterator[protocol.ChatCompletionChunk]:
    # OpenAI opens every choice with the role, before any content.
    role = protocol.Delta(role="assistant", content="")
    roles = [protocol.ChatChunkChoice(index=i, delta=role) for i in range(n)]
    yield shape.call.wrap(protocol.ChatCompletionChunk, roles)
    chunk_choice = _ChunkChoices(shape.k, shape.parser)
    kind = protocol.ChatCompletionChunk
    async for chunk in common.stream_chunks(shape.call, kind, group, holdback, include_usage, chunk_choice):
        yield chunk


@dataclass(slots=True)
class _ChunkChoices:
    """Makes the stream's choices. Without tools, each piece's text goes out as it comes. With them, content
    goes out only up to where a tool call may begin (`ToolParser.settled`); when the reply finishes, it is
    parsed as the whole reply is, and the rest of the content and every tool call go out with the finish
    reason, so that the stream adds up to the non-streamed reply."""

    k: int | None
    parser: tool_parsers.ToolParser | None
    held: dict[int, _Held] = field(default_factory=dict)  # per completion index

    def __call__(self, piece: common.Piece) -> protocol.ChatChunkChoice | None:
        completion = piece.completion
        delta, finish_reason = self._delta(piece)
        moved = delta.content or delta.tool_calls or finish_reason is not None
        if not (moved or (piece.tokens and self.k is not None)):
            return None
        return protocol.ChatChunkChoice(
            index=completion.index,
            delta=delta,
            logprobs=_chat_logprobs(completion, piece.tokens, self.k),
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _delta(self, piece: common.Piece) -> tuple[protocol.Delta, str | None]:
        completion = piece.completion
        if self.parser is None:
            return protocol.Delta(content=piece.text), completion.finish_reason
        held = self.held.setdefault(completion.index, _Held())
        held.text += piece.text
        if completion.finish_reason is None:
            return protocol.Delta(content=held.release(self.parser.settled(held.text))), None
        reply = _Reply.of(completion, self.parser)
        content = (reply.parsed.content or "")[held.sent :]
        calls = [
            protocol.DeltaToolCall(
                index=i,
                id=_call_id(),
                type="function",
                function=protocol.DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(reply.parsed.calls)
        ]
        return protocol.Delta(content=content or None, tool_calls=calls or None), reply.finish_reason


@dataclass(slots=True)
class _Held:
    """A streamed reply's text so far, and how much of it went out as content."""

    text: str = ""
    sent: int = 0

    def release(self, settled: int) -> str:
        released = self.text[self.sent : settled]
        self.sent = max(self.sent, settled)
        return released


def _chat_logprobs(completion: CompletionOutput, tokens: range, k: int | None) -> protocol.ChatLogprobs | None:
    if k is None:
        return None
    content = []
    for position in tokens:
        top = [_top_logprob(lp) for lp in common.most_likely(completion.logprobs[position], k)]
        sampled = _top_logprob(common.sampled_logprob(completion, position))
        content.append(protocol.TokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return protocol.ChatLogprobs(content=content)


def _top_logprob(logprob: Logprob) -> protocol.TopLogprob:
    token = logprob.decoded_token or ""
    return protocol.TopLogprob(token=token, logprob=logprob.logprob, bytes=list(token.encode()))
