"""`POST /v1/completions`: one or several prompts, `n` completions each, optionally echoed and streamed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai import protocol
from pagedllm.entrypoints.openai import serving_common as common
from pagedllm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(common.OpenAIServing):
    async def create(self, body: protocol.CompletionRequest, request: Request) -> Response:
        call = self._call("cmpl", body.model)
        params = common.sampling_params(body, body.max_tokens, body.logprobs, body.best_of)
        group = await self._add(_prompt_list(body.prompt), body.cache_salt, params, param="prompt")
        shape = _CompletionShape(call, body.n, body.echo, body.logprobs, self._prompt_text)
        if body.stream:
            kind = protocol.CompletionResponse
            chunks = common.stream_chunks(call, kind, group, params, body.include_usage, shape.streamed)
            return common.event_stream(chunks, group)
        finals = await common.finals_or_abort(group, request)
        return JSONResponse(shape.response(finals).model_dump())

    def _prompt_text(self, output: RequestOutput) -> str:
        return output.prompt if output.prompt is not None else self.engine.tokenizer.decode(output.prompt_token_ids)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


@dataclass(frozen=True, slots=True)
class _CompletionShape:
    """How one completions call turns engine outputs into choices."""

    call: common.Call
    n: int
    echo: bool
    logprobs: int | None
    prompt_text: Callable[[RequestOutput], str]

    def response(self, finals: list[RequestOutput]) -> protocol.CompletionResponse:
        choices = [
            self._choice(common.Piece.whole(index, output, completion), self._echoed(output))
            for index, output in enumerate(finals)
            for completion in output.outputs
        ]
        return self.call.wrap(protocol.CompletionResponse, choices, common.usage(finals))

    def streamed(self, piece: common.Piece) -> protocol.CompletionChoice | None:
        echoed = self._echoed(piece.output) if piece.first else ""
        return self._choice(piece, echoed) if echoed or piece.worth_sending(self.logprobs) else None

    def _choice(self, piece: common.Piece, echoed: str) -> protocol.CompletionChoice:
        """The choice for `piece`, after `echoed` (the prompt, or '')."""
        completion = piece.completion
        logprobs = None
        if self.logprobs is not None:
            logprobs = _completion_logprobs(completion, piece.tokens, self.logprobs)
        return protocol.CompletionChoice(
            index=piece.prompt_index * self.n + completion.index,
            text=echoed + piece.text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _echoed(self, output: RequestOutput) -> str:
        return self.prompt_text(output) if self.echo else ""


def _completion_logprobs(completion: CompletionOutput, tokens: range, k: int) -> protocol.CompletionLogprobs:
    """`text_offset` counts from the start of the completion (never echoed: echo excludes logprobs), so in a
    stream it starts after the tokens sent before."""
    offset = sum(len(common.sampled_logprob(completion, p).decoded_token or "") for p in range(tokens.start))
    result = protocol.CompletionLogprobs()
    for position in tokens:
        sampled = common.sampled_logprob(completion, position)
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        top = common.most_likely(completion, position, k)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in top})
        result.text_offset.append(offset)
        offset += len(token)
    return result
