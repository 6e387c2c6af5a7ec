"""`POST /v1/embeddings`, `/v1/score` and `/v1/rerank` (vLLM's aliases `/score`, `/rerank`, `/v2/rerank` too) on an
embed or score server.

Every input of a call is its own engine request, all of them one `RequestGroup`: they batch in the engine, and a
client that leaves, or one request that fails, aborts the rest, so every block comes back. As `LLM.score` does, a
score on an embed server is the cosine similarity of the two texts' embeddings, on a score server the
cross-encoder's score of the pair's prompt; rerank ranks the documents by those scores. Input is checked before any
of it reaches the engine (empty, too long, outside the vocabulary), each refusal a 400 naming the field and index.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from pagedllm.entrypoints.openai import field_policy
from pagedllm.entrypoints.openai import pooling_protocol as pp
from pagedllm.entrypoints.openai import serving_common as common
from pagedllm.entrypoints.scoring import cosine_output, pair_prompt, score_pairs, with_instruction
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling import EMBED, SCORE, truncated_encoding
from pagedllm.pooling_params import PoolingParams

# A text, token ids, or a cross-encoder's (query, document).
Value = str | list[int] | tuple[str, str]


@dataclass(frozen=True, slots=True)
class _Input:
    """One engine request of a call, untokenized, and the field (with its index in a list) its errors name."""

    param: str
    value: Value


@dataclass(frozen=True, slots=True)
class _Scores:
    scores: list[float]
    prompt_tokens: int  # of the requests the engine ran (an embed server's texts once each)


@dataclass(frozen=True)
class OpenAIServingPooling(common.OpenAIServing):
    max_score_documents: int

    async def embeddings(self, body: pp.EmbeddingRequest, request: Request) -> Response:
        ignored = field_policy.ignored_fields(body, field_policy.EMBEDDINGS)
        call = self._call("embd", body.model, (EMBED,))
        inputs = _embedding_inputs(body.input)
        common.at_most("input", len(inputs), self.limits.max_prompts, "max_prompts", "the number of inputs")
        params = self._params(body.truncate_prompt_tokens, dimensions=body.dimensions, normalize=body.normalize)
        finals = await self._pooled(call, request, inputs, params, instruct=True)
        data = [
            pp.EmbeddingData(index=index, embedding=_encoded(output.outputs.data, body.encoding_format))
            for index, output in enumerate(finals)
        ]
        usage = _usage(sum(len(output.prompt_token_ids) for output in finals))
        response = pp.EmbeddingResponse(id=call.id, created=call.created, model=call.model, data=data, usage=usage)
        return JSONResponse(response.model_dump(), headers=field_policy.header(ignored))

    async def score(self, body: pp.ScoreRequest, request: Request) -> pp.ScoreResponse:
        call = self._call("score", body.model, (SCORE, EMBED))
        (first_field, second_field), (firsts, seconds) = body.fields, body.sides
        queries, documents = _named(first_field, firsts), _named(second_field, seconds)
        scored = await self._scores(call, request, queries, documents, body.truncate_prompt_tokens)
        data = [pp.ScoreData(index=index, score=score) for index, score in enumerate(scored.scores)]
        usage = _usage(scored.prompt_tokens)
        return pp.ScoreResponse(id=call.id, created=call.created, model=call.model, data=data, usage=usage)

    async def rerank(self, body: pp.RerankRequest, request: Request) -> pp.RerankResponse:
        call = self._call("rerank", body.model, (SCORE, EMBED))
        texts = body.texts
        documents = _named("documents", texts)
        query = [_input("query", body.query)]
        scored = await self._scores(call, request, query, documents, body.truncate_prompt_tokens)
        # Ties keep the documents' order: sorted() is stable.
        ranked = sorted(range(len(texts)), key=lambda index: -scored.scores[index])[: body.top_n or None]
        results = [
            pp.RerankResult(
                index=index,
                relevance_score=scored.scores[index],
                document=pp.RerankDocument(text=texts[index]) if body.return_documents else None,
            )
            for index in ranked
        ]
        return pp.RerankResponse(
            id=call.id, model=call.model, usage=pp.RerankUsage(total_tokens=scored.prompt_tokens), results=results
        )

    # ---- shared -----------------------------------------------------------------------------------

    async def _scores(
        self,
        call: common.Call,
        request: Request,
        queries: list[_Input],
        documents: list[_Input],
        truncate: int | None,
    ) -> _Scores:
        """Each pair's score, pairs as vLLM makes them (one query against every document, or pair by pair); pair
        i's document is `documents[i]`, whose field an error about the pair names."""
        second_field = documents[0].param.split(".", 1)[0]
        what = f"the number of texts in {second_field}"
        common.at_most(second_field, len(documents), self.max_score_documents, "max_score_documents", what)
        try:
            pairs = score_pairs([q.value for q in queries], [d.value for d in documents])
        except ValueError as error:
            raise common.ApiError(400, f"{second_field}: {error}", param=second_field) from error
        params = self._params(truncate)
        pooler = self.engine.pooler
        if pooler.task == EMBED:
            return await self._cosines(call, request, pairs, queries + documents, params)
        if pooler.size != 1:
            message = f"this model gives {pooler.size} label probabilities per pair, not one score"
            raise common.ApiError(400, message, param="model")
        inputs = [_Input(document.param, pair) for document, pair in zip(documents, pairs, strict=True)]
        finals = await self._pooled(call, request, inputs, params)
        tokens = sum(len(output.prompt_token_ids) for output in finals)
        return _Scores([output.outputs.score for output in finals], tokens)

    async def _cosines(
        self,
        call: common.Call,
        request: Request,
        pairs: list[tuple[str, str]],
        sides: list[_Input],
        params: PoolingParams,
    ) -> _Scores:
        """An embed server's scores: each distinct text embedded once (a rerank's query, not once per document),
        then the cosine similarity of each pair's two embeddings."""
        distinct: dict[str, _Input] = {}
        for side in sides:
            distinct.setdefault(side.value, side)
        finals = await self._pooled(call, request, list(distinct.values()), params, instruct=True)
        embedded = dict(zip(distinct, finals, strict=True))
        scores = [cosine_output("", embedded[query], embedded[document]).outputs.score for query, document in pairs]
        return _Scores(scores, sum(len(output.prompt_token_ids) for output in finals))

    def _params(self, truncate: int | None, **settings: object) -> PoolingParams:
        """The request's PoolingParams, refused (400 naming the field) where the model cannot give them."""
        try:
            params = PoolingParams(truncate_prompt_tokens=truncate, **settings)
            self.engine.pooler.check(params)
        except ValueError as error:  # each message starts with its field's name
            raise common.ApiError(400, str(error), param=str(error).split(" ", 1)[0].rstrip(":")) from error
        return params

    async def _pooled(
        self,
        call: common.Call,
        request: Request,
        inputs: list[_Input],
        params: PoolingParams,
        instruct: bool = False,
    ) -> list[PoolingRequestOutput]:
        """Run every input as one group of engine requests; their outputs in input order. `instruct`: texts get the
        model's default instruction prefix, as `LLM.embed` gives them."""
        if instruct:
            inputs = [self._instructed(one) for one in inputs]
        prompts = await self._prompts(inputs, params)
        # The engine's own refusals (a prompt the KV pool cannot hold) say which prompt; the field is the input's.
        field = inputs[0].param.split(".", 1)[0]
        group = await self._add(prompts, None, params, param=field, lora_request=call.lora_request)
        return await common.finals_or_abort(group, request)

    def _instructed(self, one: _Input) -> _Input:
        if not isinstance(one.value, str):
            return one
        return _Input(one.param, with_instruction(self.engine.pooler, one.value, None))

    async def _prompts(self, inputs: list[_Input], params: PoolingParams) -> list[dict]:
        """Each input tokenized (the call's texts on one thread: the tokenizer releases the GIL), checked against the
        vocabulary and the model's length, and cut to its last tokens where `truncate_prompt_tokens` asks (an encoder's
        texts and pairs by its tokenizer)."""
        if params.truncate_prompt_tokens is None:
            for one in inputs:
                for text in _texts(one.value):
                    self._check_text_fits(text, one.param)
        tokenizer, limit = self.engine.tokenizer, self.engine.max_model_len
        # An encoder's texts are cut by its tokenizer (keeping its CLS token), as the engine cuts them.
        encoder = self.engine.pooler.bidirectional
        cut = params.truncation_length(limit) if encoder else None
        values = [one.value for one in inputs]
        encoded = await asyncio.to_thread(lambda: [_encoded_input(tokenizer, value, encoder, cut) for value in values])
        vocab = len(tokenizer)
        prompts = []
        for one, encoding in zip(inputs, encoded, strict=True):
            ids = params.truncated(encoding["input_ids"], limit)
            outside = next((token for token in ids if token >= vocab), None)
            if outside is not None:
                raise common.ApiError(
                    400, f"{one.param}: token id {outside} is outside the vocabulary [0, {vocab})", param=one.param
                )
            if len(ids) > limit:
                message = (
                    f"{one.param} has {len(ids)} tokens; max_model_len is {limit} (truncate_prompt_tokens keeps its "
                    "last tokens instead)"
                )
                raise common.ApiError(400, message, param=one.param)
            prompt = {"prompt": one.value if isinstance(one.value, str) else None, "prompt_token_ids": ids}
            if "token_type_ids" in encoding:
                prompt["token_type_ids"] = params.truncated(encoding["token_type_ids"], limit)
            prompts.append(prompt)
        return prompts


def _embedding_inputs(value: str | list) -> list[_Input]:
    """OpenAI's `input`: one text, one list of token ids, or a list of either (each named by its index)."""
    if value and all(isinstance(token, int) for token in value):
        return [_input("input", value)]
    return _named("input", value)


def _named(field: str, values: str | Sequence) -> list[_Input]:
    """A field's one value, or each of its list's (named by its index)."""
    if isinstance(values, str):
        return [_input(field, values)]
    if not values:
        raise common.ApiError(400, f"{field} must not be empty", param=field)
    return [_input(f"{field}.{index}", value) for index, value in enumerate(values)]


def _input(param: str, value: str | list[int]) -> _Input:
    if not value:
        raise common.ApiError(400, f"{param} is empty", param=param)
    return _Input(param, value)


def _encoded_input(
    tokenizer: PreTrainedTokenizerBase, value: Value, encoder: bool, limit: int | None
) -> dict[str, list[int]]:
    """An input's token ids, and an encoder's token types: its text or text pair as its tokenizer encodes it, cut to
    `limit` there (keeping its CLS token)."""
    if encoder and not isinstance(value, list):
        return truncated_encoding(tokenizer, value, limit)
    if isinstance(value, tuple):
        return {"input_ids": pair_prompt(tokenizer, *value)["prompt_token_ids"]}
    if isinstance(value, str):
        return {"input_ids": tokenizer.encode(value)}
    return {"input_ids": list(value)}


def _texts(value: Value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return value if isinstance(value, tuple) else ()


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's base64 format is the vector's little-endian float32 bytes, which its SDK decodes with numpy."""
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def _usage(prompt_tokens: int) -> pp.PoolingUsage:
    return pp.PoolingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
