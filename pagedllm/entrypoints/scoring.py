"""What `LLM.embed` / `LLM.score` and the server's `/v1/embeddings`, `/v1/score` and `/v1/rerank` share: the
pairs a score compares, the prompts that go to the engine, and a score from two embeddings."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from pagedllm.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling import Pooler, truncated_encoding


def score_pairs(queries: str | Seq[str], documents: str | Seq[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one query against every document, or as many queries as documents, pair by pair."""
    firsts = [queries] if isinstance(queries, str) else list(queries)
    seconds = [documents] if isinstance(documents, str) else list(documents)
    if not firsts or not seconds:
        raise ValueError("score needs at least one query and one document")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(f"got {len(firsts)} queries for {len(seconds)} documents: give one query, or one per document")
    return list(zip(firsts, seconds, strict=True))


def pair_prompt(
    tokenizer: PreTrainedTokenizerBase, query: str, document: str, encoder: bool = False, limit: int | None = None
) -> dict:
    """A cross-encoder's prompt: the query and the document as the tokenizer joins a text pair (transformers' and
    sentence-transformers' CrossEncoder's encoding). An `encoder` also gets the segments' token types where the
    tokenizer gives them (BERT's 0 then 1; a decoder has no token-type embedding), and with a `limit` the tokenizer
    cuts the pair to it, keeping the special tokens."""
    encoded = truncated_encoding(tokenizer, (query, document), limit if encoder else None)
    prompt = {"prompt": None, "prompt_token_ids": encoded["input_ids"]}
    if encoder and "token_type_ids" in encoded:
        prompt["token_type_ids"] = encoded["token_type_ids"]
    return prompt


def with_instruction(pooler: Pooler, text: str, prompt_name: str | None) -> str:
    """The text behind the model's named instruction prefix (sentence-transformers' `prompts`), or its default."""
    name = prompt_name if prompt_name is not None else pooler.default_prompt_name
    if name is None:
        return text
    if name not in pooler.prompts:
        raise ValueError(f"prompt_name {name!r} is not one of this model's prompts: {sorted(pooler.prompts)}")
    return pooler.prompts[name] + text


def cosine_output(request_id: str, first: PoolingRequestOutput, second: PoolingRequestOutput) -> PoolingRequestOutput:
    """An embedding model's score of a pair: the cosine similarity of their embeddings (vLLM's)."""
    score = F.cosine_similarity(first.outputs.data, second.outputs.data, dim=0).reshape(1)
    ids = first.prompt_token_ids + second.prompt_token_ids
    cached = (first.num_cached_tokens or 0) + (second.num_cached_tokens or 0)
    return PoolingRequestOutput(request_id, None, ids, PoolingOutput(score.to(torch.float32)), True, cached)
