"""`POST /v1/chat/completions`: the messages (and tools) through the chat template, `n` replies (or `n` beams),
optionally constrained, with the tool calls found in them, optionally streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai import field_policy, protocol, reasoning_parsers, replies, tool_parsers
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


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat call's requests in the engine, and how their replies are read."""

    group: RequestGroup
    params: common.EngineParams
    reader: replies.ReplyReader


@dataclass(frozen=True)
class OpenAIServingChat(common.OpenAIServing):
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"

    async def create(self, body: protocol.ChatCompletionRequest, request: Request) -> Response:
        ignored = field_policy.ignored_fields(body, field_policy.CHAT)
        call = self._call("chatcmpl", body.model)
        run = await self.start(body, call)
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        shape = _ChatShape(call, top_logprobs, run.reader)
        headers = field_policy.header(ignored)
        if body.stream:
            chunks = _chat_chunks(shape, run.group, body.n, common.holdback(run.params), body.include_usage)
            return common.event_stream(chunks, run.group, headers)
        (final,) = await common.finals_or_abort(run.group, request)
        return JSONResponse(shape.response(final, body.prompt_logprobs).model_dump(), headers=headers)

    async def start(self, body: protocol.ChatCompletionRequest, call: common.Call) -> ChatRun:
        """Check, render and add the call's request: the path every chat-shaped call takes (the Responses API's
        too)."""
        self._check(body)
        template = self._template(body)
        tools = self._tool_use(body, template)
        rendering = common.Rendering(template, body.chat_template, body.chat_template_kwargs)
        prompt = await self._render(body.messages, body.add_generation_prompt, tools.offered, rendering=rendering)
        reasoning = reasoning_parsers.get_reasoning_parser(self.reasoning_parser, template)
        if reasoning_parsers.closed_in_prompt(prompt["prompt"]):
            reasoning = None  # thinking off: the template closed an empty block, so the reply is all answer
        constraint = common.constraint(body, *filter(None, [tools.constraint]))
        if constraint is not None and reasoning is not None:
            # As vLLM: the constraint holds what follows the thinking, which stays free.
            constraint = replace(constraint, spec=replace(constraint.spec, reasoning=reasoning.grammar_block))
        if tools.parser is not None and self._markers_are_special(tools.parser):
            body = body.model_copy(update={"skip_special_tokens": False})  # as vLLM: the parser must see them
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
        return ChatRun(group, params, replies.ReplyReader(reasoning, tools.parser))

    def _markers_are_special(self, parser: tool_parsers.ToolParser) -> bool:
        tokenizer = self.engine.tokenizer
        added = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
        special = added | set(tokenizer.all_special_tokens)
        return any(marker in special for marker in tool_parsers.call_markers(parser))

    def _template(self, body: protocol.ChatCompletionRequest) -> str | None:
        """The chat template this request renders with: its own only where the server trusts requests' templates
        (vLLM's rule: a template runs code-like logic over every request it renders)."""
        if body.chat_template is None:
            return self.engine.tokenizer.chat_template
        if not self.trust_request_chat_template:
            message = "chat_template is refused unless the server runs with --trust-request-chat-template"
            raise common.ApiError(400, message, param="chat_template")
        return body.chat_template

    def _tool_use(self, body: protocol.ChatCompletionRequest, template: str | None) -> _ToolUse:
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if choice == "none":
            return _ToolUse(None, None, None)
        if not body.tools:
            raise common.ApiError(400, f"tool_choice {_choice_name(choice)} needs tools", param="tool_choice")
        offered = [tool.model_dump(exclude_none=True) for tool in body.tools]
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


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(completion: CompletionOutput, reading: replies.Reading) -> str | None:
    """A reply the length limit cut says so, calls or not: the calls given are those completed before the cut."""
    return "tool_calls" if reading.calls and completion.finish_reason != "length" else completion.finish_reason


def tool_calls(reading: replies.Reading) -> list[protocol.ToolCall]:
    return [
        protocol.ToolCall(id=call_id(), function=protocol.FunctionCall(name=c.name, arguments=c.arguments))
        for c in reading.calls
    ]


@dataclass(frozen=True, slots=True)
class _ChatShape:
    """How one chat call turns engine outputs into choices."""

    call: common.Call
    k: int | None  # top_logprobs, when logprobs are asked for
    reader: replies.ReplyReader

    def response(self, final: RequestOutput, prompt_logprobs: int | None) -> protocol.ChatCompletionResponse:
        choices = [self._choice(completion) for completion in final.outputs]
        response = self.call.wrap(protocol.ChatCompletionResponse, choices, common.usage([final]))
        if prompt_logprobs is not None:
            response.prompt_logprobs = common.prompt_logprobs(final, prompt_logprobs)
        return response

    def _choice(self, completion: CompletionOutput) -> protocol.ChatChoice:
        reading = self.reader.read(completion.text)
        message = protocol.AssistantMessage(
            content=reading.content, reasoning_content=reading.reasoning, tool_calls=tool_calls(reading) or None
        )
        return protocol.ChatChoice(
            index=completion.index,
            message=message,
            logprobs=_chat_logprobs(completion, range(len(completion.token_ids)), self.k),
            finish_reason=finish_reason(completion, reading),
            stop_reason=completion.stop_reason,
        )


async def _chat_chunks(
    shape: _ChatShape, group: RequestGroup, n: int, holdback: int, include_usage: bool
) -> AsyncIterator[protocol.ChatCompletionChunk]:
    # OpenAI opens every choice with the role, before any content.
    role = protocol.Delta(role="assistant", content="")
    roles = [protocol.ChatChunkChoice(index=i, delta=role) for i in range(n)]
    yield shape.call.wrap(protocol.ChatCompletionChunk, roles)
    chunk_choice = _ChunkChoices(shape.k, shape.reader)
    kind = protocol.ChatCompletionChunk
    async for chunk in common.stream_chunks(shape.call, kind, group, holdback, include_usage, chunk_choice):
        yield chunk


@dataclass(slots=True)
class _ChunkChoices:
    """Makes the stream's choices. Reasoning and content go out as far as they are settled (`ReplyStream`: a
    think tag or a tool call may still begin); when the reply finishes, it is read as the whole reply is, and the
    rest goes out with the finish reason, each tool call as OpenAI streams one: its id and name first, then its
    arguments, so that the stream adds up to the non-streamed reply."""

    k: int | None
    reader: replies.ReplyReader
    streams: dict[int, replies.ReplyStream] = field(default_factory=dict)  # per completion index

    def __call__(self, piece: common.Piece) -> list[protocol.ChatChunkChoice] | None:
        completion = piece.completion
        stream = self.streams.setdefault(completion.index, self.reader.stream())
        if completion.finish_reason is None:
            released, reading = stream.advance(piece.text), None
        else:
            released, reading = stream.finish(piece.text)
        delta = protocol.Delta(content=released.content or None, reasoning_content=released.reasoning or None)
        finished = reading is not None
        if not (delta.content or delta.reasoning_content or finished or (piece.tokens and self.k is not None)):
            return None
        logprobs = _chat_logprobs(completion, piece.tokens, self.k)
        calls = _call_deltas(reading.calls) if reading is not None else []
        if not calls:
            reason = finish_reason(completion, reading) if reading is not None else None
            return [self._choice(completion, delta, logprobs, reason)]
        # The content first, then each call's name and its arguments; the last piece carries the finish reason.
        pieces = [protocol.Delta(tool_calls=[call]) for call in calls]
        if delta.content or delta.reasoning_content:
            pieces.insert(0, delta)
        choices = [self._choice(completion, d, None, None) for d in pieces]
        choices[0].logprobs = logprobs
        choices[-1].finish_reason = finish_reason(completion, reading)
        return choices

    @staticmethod
    def _choice(
        completion: CompletionOutput, delta: protocol.Delta, logprobs: protocol.ChatLogprobs | None, reason: str | None
    ) -> protocol.ChatChunkChoice:
        return protocol.ChatChunkChoice(
            index=completion.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=completion.stop_reason if reason is not None else None,
        )


def _call_deltas(calls: tuple[tool_parsers.ParsedCall, ...]) -> list[protocol.DeltaToolCall]:
    deltas = []
    for index, call in enumerate(calls):
        name = protocol.DeltaFunctionCall(name=call.name)
        deltas.append(protocol.DeltaToolCall(index=index, id=call_id(), type="function", function=name))
        deltas.append(
            protocol.DeltaToolCall(index=index, function=protocol.DeltaFunctionCall(arguments=call.arguments))
        )
    return deltas


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
