"""Request and response bodies of the pooling routes: OpenAI's `/v1/embeddings`, vLLM's `/v1/score` and the
Jina/Cohere-shaped `/v1/rerank`, validated as strictly as `protocol.py`'s (unknown fields refused, no "5" for 5).

What the types cannot say (an empty input and where it is, a prompt too long for the model, a `dimensions` the model
cannot give) the serving class checks, naming the field and the index."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field, model_validator

from pagedllm.entrypoints.openai.protocol import TokenId, _Strict

# -1 keeps as many of a prompt's last tokens as the model takes (vLLM's); 0 would keep none.
TruncatePromptTokens = Annotated[int, Field(ge=-1)]


def _check_input_shape(value: object) -> object:
    """One clear message instead of one error per member of the union below. Empty strings and lists pass here:
    the serving class refuses them naming their index."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(item, str) for item in value) or _is_token_ids(value):
            return value
        if all(isinstance(item, list) and _is_token_ids(item) for item in value):
            return value
    raise ValueError(
        "input must be a string, a list of strings, a list of token ids (non-negative integers), or a list of "
        "token-id lists"
    )


def _is_token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


EmbeddingInput = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]],
    BeforeValidator(_check_input_shape),
]
Texts = str | list[str]


class EmbeddingRequest(_Strict):
    """OpenAI's body, plus vLLM's `truncate_prompt_tokens` and `normalize`."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # field_policy.EMBEDDINGS says what becomes of it
    # vLLM's extras
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    normalize: bool | None = None


class ScoreRequest(_Strict):
    """vLLM's: `text_1` against `text_2` (one against each, or pair by pair), or the same as `queries` and
    `documents`, as newer vLLM names them."""

    model: str | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None

    @model_validator(mode="after")
    def _one_naming(self) -> ScoreRequest:
        old = [side is not None for side in (self.text_1, self.text_2)]
        new = [side is not None for side in (self.queries, self.documents)]
        mixed = any(old) and any(new)
        if mixed or not (all(old) or all(new)):
            raise ValueError("give text_1 and text_2, or queries and documents")
        return self

    @property
    def fields(self) -> tuple[str, str]:
        """The names the client gave the two sides, which errors name."""
        return ("text_1", "text_2") if self.text_1 is not None else ("queries", "documents")

    @property
    def sides(self) -> tuple[Texts, Texts]:
        return (self.text_1, self.text_2) if self.text_1 is not None else (self.queries, self.documents)


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    """Jina's and Cohere's (as vLLM serves it): the documents ranked by their relevance to the query."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0)  # None or 0 (vLLM's default): every document
    return_documents: bool = True
    truncate_prompt_tokens: TruncatePromptTokens | None = None

    @property
    def texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


# ---- responses ------------------------------------------------------------------------------


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format base64


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
