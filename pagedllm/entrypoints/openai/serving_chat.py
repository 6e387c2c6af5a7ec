"""`POST /v1/chat/completions`: the messages through the chat template, `n` replies, optionally streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai import protocol
from pagedllm.entrypoints.openai import serving_common as common
from pagedllm.entrypoints.openai.async_engine import RequestGroup
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


class OpenAIServingChat(common.OpenAIServing):
    async def create(self, body: protocol.ChatCompletionRequest, request: Request) -> Response:
        call = self._call("chatcmpl", body.model)
        prompt = self._render(body.messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = common.sampling_params(body, max_tokens, top_logprobs, None)
        group = await self._add([prompt], body.cache_salt, params, param="messages")
        if body.stream:
            return common.event_stream(_chat_chunks(call, group, params, body.include_usage), group)
        (final,) = await common.finals_or_abort(group, request)
        return JSONResponse(_chat_response(call, final, top_logprobs).model_dump())


def _chat_response(call: common.Call, final: RequestOutput, k: int | None) -> protocol.ChatCompletionResponse:
    choices = [
        protocol.ChatChoice(
            index=completion.index,
            message=protocol.AssistantMessage(content=completion.text),
            logprobs=_chat_logprobs(completion, range(len(completion.token_ids)), k),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        for completion in final.outputs
    ]
    return call.wrap(protocol.ChatCompletionResponse, choices, common.usage([final]))


async def _chat_chunks(
    call: common.Call, group: RequestGroup, params: SamplingParams, include_usage: bool
) -> AsyncIterator[protocol.ChatCompletionChunk]:
    # OpenAI opens every choice with the role, before any content.
    role = protocol.Delta(role="assistant", content="")
    roles = [protocol.ChatChunkChoice(index=i, delta=role) for i in range(params.n)]
    yield call.wrap(protocol.ChatCompletionChunk, roles)
    choice = partial(_chunk_choice, params.logprobs)
    async for chunk in common.stream_chunks(call, protocol.ChatCompletionChunk, group, params, include_usage, choice):
        yield chunk


def _chunk_choice(k: int | None, piece: common.Piece) -> protocol.ChatChunkChoice | None:
    if not piece.worth_sending(k):
        return None
    completion = piece.completion
    return protocol.ChatChunkChoice(
        index=completion.index,
        delta=protocol.Delta(content=piece.text),
        logprobs=_chat_logprobs(completion, piece.tokens, k),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


def _chat_logprobs(completion: CompletionOutput, tokens: range, k: int | None) -> protocol.ChatLogprobs | None:
    if k is None:
        return None
    content = []
    for position in tokens:
        top = [_top_logprob(lp) for lp in common.most_likely(completion, position, k)]
        sampled = _top_logprob(common.sampled_logprob(completion, position))
        content.append(protocol.TokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return protocol.ChatLogprobs(content=content)


def _top_logprob(logprob: Logprob) -> protocol.TopLogprob:
    token = logprob.decoded_token or ""
    return protocol.TopLogprob(token=token, logprob=logprob.logprob, bytes=list(token.encode()))
