"""Request and response bodies of the OpenAI-compatible server: OpenAI's fields plus vLLM's extras.

Requests are validated strictly (no "5" for 5, no true for 1) and unknown fields are refused, so a typo
fails loudly with the field's name instead of being ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pagedllm.sampling_params import MAX_LOGIT_BIAS

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs; vLLM's default max_logprobs
MAX_N = 128  # each sample is a sequence in the engine: refuse requests that would flood it

TokenId = Annotated[int, Field(ge=0)]
JsonSchema = dict[str, Any]


def _check_prompt_shape(value: object) -> object:
    """One clear message instead of one error per member of the union below."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or _is_token_ids(value):
            return value
        if all(isinstance(p, list) and p and _is_token_ids(p) for p in value):
            return value
    raise ValueError("prompt must be a string, a non-empty list of strings, of token ids, or of token-id lists")


def _is_token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


PromptField = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_prompt_shape)]


def _token_id_keys(value: object) -> object:
    """OpenAI's logit_bias is a JSON object, so its token ids arrive as strings: '42' -> 42, range checked."""
    if not isinstance(value, dict):
        return value
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(number, bool) or not isinstance(number, int | float) or abs(number) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {number!r} for token {key}")
        bias[int(key)] = number
    return bias


LogitBias = Annotated[dict[int, float], BeforeValidator(_token_id_keys)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: JsonSchema = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's `response_format`. The type is checked here rather than by a Literal so that an unknown one
    is an error naming `response_format` with the types we know."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _known_type(self) -> ResponseFormat:
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"unknown type {self.type!r}: use 'text', 'json_object' or 'json_schema'")
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra: exactly one constraint (checked when it becomes SamplingParams)."""

    json_: JsonSchema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Strict):
    """Fields that completions and chat completions share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    cache_salt: str | None = Field(None, min_length=1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    # vLLM's constrained decoding extras: the current field and the older guided_* ones
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's prompt logprobs and beam search extras
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when streaming (as in vLLM)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: PromptField
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("best_of")
    @classmethod
    def _best_of_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1) and info.data.get("stream"):
            raise ValueError("best_of other than n cannot be streamed: the best are known only at the end")
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call
    # What the openai client's reply message carries when an agent loop sends it back as is: accepted
    # empty, as the reply gave them, and not shown to the model.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, need tool_call_id")
        return self

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention): text content, and each tool
        call's arguments as a dict when they are a JSON object."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
                for call, arguments in zip(self.tool_calls, self.call_arguments(), strict=True)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def call_arguments(self) -> list[dict | str]:
        return [_json_object_or_text(call.function.arguments) for call in self.tool_calls or []]


def _json_object_or_text(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None  # a named or required choice is always enforced; auto never is


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, value: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if (value is None) == (info.data.get("prompt") is None):
            raise ValueError("give exactly one of prompt and messages")
        return value


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format; an echoed prompt's first token has no logprob (null), as in vLLM."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first token, then token id (as a string) -> its logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _Choice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Reply(BaseModel):
    """What every response and stream chunk carries besides its choices."""

    id: str
    created: int
    model: str


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Reply):
    """A whole completion, or (streaming) one chunk of it: OpenAI uses the same shape for both."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Choice):
    delta: Delta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
