"""`POST /v1/completions`: one or several prompts, `n` completions each (or `n` beams), optionally
constrained, echoed (with the prompt's logprobs) and streamed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai import protocol
from pagedllm.entrypoints.openai import serving_common as common
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(common.OpenAIServing):
    async def create(self, body: protocol.CompletionRequest, request: Request) -> Response:
        call = self._call("cmpl", body.model)
        self._check(body)
        prompts = await self._tokenized(_prompt_list(body.prompt), "prompt")
        constraint = common.constraint(body)
        if body.use_beam_search:
            params = common.beam_params(body, constraint, body.max_tokens or self._room(prompts))
        else:
            params = common.sampling_params(
                body,
                constraint,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                prompt_logprobs=_prompt_logprobs_needed(body),
                best_of=body.best_of,
            )
        group = await self._add(
            prompts, body.cache_salt, params, param="prompt", constraint=constraint, lora_request=call.lora_request
        )
        shape = _CompletionShape(call, body.n, body.echo, body.logprobs, body.prompt_logprobs, self._decode)
        if body.stream:
            kind = protocol.CompletionResponse
            holdback = common.holdback(params)
            chunks = common.stream_chunks(call, kind, group, holdback, body.include_usage, shape.streamed)
            return common.event_stream(chunks, group)
        finals = await common.finals_or_abort(group, request)
        return JSONResponse(shape.response(finals).model_dump())

    def _decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)


def _prompt_logprobs_needed(body: protocol.CompletionRequest) -> int | None:
    """Echo with logprobs shows the prompt's tokens with theirs; vLLM's prompt_logprobs asks on its own."""
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    return max(wanted, default=None)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


@dataclass(frozen=True, slots=True)
class _Row:
    """One token of OpenAI's legacy logprobs; an echoed prompt's first token has no logprob."""

    token: str
    logprob: float | None
    top: dict[str, float] | None


@dataclass(frozen=True, slots=True)
class _CompletionShape:
    """How one completions call turns engine outputs into choices."""

    call: common.Call
    n: int
    echo: bool
    logprobs: int | None
    prompt_logprobs: int | None
    decode: Callable[[list[int]], str]

    def response(self, finals: list[RequestOutput]) -> protocol.CompletionResponse:
        choices = [
            self._choice(common.Piece.whole(index, output, completion))
            for index, output in enumerate(finals)
            for completion in output.outputs
        ]
        return self.call.wrap(protocol.CompletionResponse, choices, common.usage(finals))

    def streamed(self, piece: common.Piece) -> protocol.CompletionChoice | None:
        echoes = self.echo and piece.first
        return self._choice(piece) if echoes or piece.worth_sending(self.logprobs) else None

    def _choice(self, piece: common.Piece) -> protocol.CompletionChoice:
        """The choice for `piece`; the first piece of a completion carries the echoed prompt."""
        completion, output = piece.completion, piece.output
        echoed = self.echo and piece.first
        prompt_rows = self._prompt_rows(output) if self.echo and self.logprobs is not None else []
        logprobs = None
        if self.logprobs is not None:
            rows = (prompt_rows if echoed else []) + _completion_rows(completion, piece.tokens, self.logprobs)
            # In a stream, offsets go on from the text sent before: the echoed prompt and earlier tokens.
            before = (
                0
                if echoed
                else _length(prompt_rows) + _length(_completion_rows(completion, range(piece.tokens.start), 0))
            )
            logprobs = _legacy_logprobs(rows, before)
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = common.prompt_logprobs(output, self.prompt_logprobs)
        return protocol.CompletionChoice(
            index=piece.prompt_index * self.n + completion.index,
            text=(self._prompt_text(output) if echoed else "") + piece.text,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        return output.prompt if output.prompt is not None else self.decode(output.prompt_token_ids)

    def _prompt_rows(self, output: RequestOutput) -> list[_Row]:
        entries = output.prompt_logprobs or []
        return [
            _Row(self.decode([token]), None, None) if entry is None else _row(entry, token, self.logprobs)
            for token, entry in zip(output.prompt_token_ids, entries, strict=False)
        ]


def _completion_rows(completion: CompletionOutput, tokens: range, k: int) -> list[_Row]:
    return [_row(completion.logprobs[position], completion.token_ids[position], k) for position in tokens]


def _row(entry: dict[int, Logprob], token: int, k: int) -> _Row:
    """Keyed by token text, as in OpenAI's legacy format: tokens that decode alike (partial UTF-8) share a key."""
    top = {lp.decoded_token or "": lp.logprob for lp in common.most_likely(entry, k)}
    return _Row(entry[token].decoded_token or "", entry[token].logprob, top)


def _length(rows: list[_Row]) -> int:
    return sum(len(row.token) for row in rows)


def _legacy_logprobs(rows: list[_Row], offset: int) -> protocol.CompletionLogprobs:
    result = protocol.CompletionLogprobs()
    for row in rows:
        result.tokens.append(row.token)
        result.token_logprobs.append(row.logprob)
        result.top_logprobs.append(row.top)
        result.text_offset.append(offset)
        offset += len(row.token)
    return result
