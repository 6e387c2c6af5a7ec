"""Request and response bodies of the OpenAI-compatible server: OpenAI's fields plus vLLM's extras.

Requests are validated strictly (no "5" for 5, no true for 1, no NaN or Infinity, no half of a surrogate
pair in a string) and unknown fields are refused, so a typo fails loudly with the field's name instead of
being ignored. The limits the server's flags set (n, logprobs, stop strings) are checked by the serving
classes, which know them; the bounds here are those of the types.
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

# The sampler divides logits by the temperature in float32: past its range (3.4e38) a temperature is inf,
# and a banned token's -inf / inf is NaN, which fails the request. OpenAI allows 2; at 100 a model's distribution
# is already close to uniform.
MAX_TEMPERATURE = 100.0
# A repetition penalty divides the positive logits of repeated tokens and multiplies the negative ones: far
# from 1 (1e-40, 1e300) they become ±inf and the sampler's probabilities NaN. Past these bounds it can only
# force or ban repetition, which a hundredfold already does.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# top_p is compared in float32, where below about 1e-45 it is 0, which keeps no token at all; from 1e-9 down,
# every top_p keeps only the most likely token anyway (no vocabulary has a billion tokens).
MIN_TOP_P = 1e-9
# Seeds become torch generator seeds, which are 64-bit (seed + sample index must fit too); vLLM's range.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Beam scores divide by length ** length_penalty, which overflows (or underflows to 0) past about ±60 at a
# 128k context; ±10 already makes length dominate any difference in log-probability.
MAX_LENGTH_PENALTY = 10.0
# A top_k at or past the vocabulary means no truncation; this bound, far past any vocabulary, keeps numbers such
# as 2**70 from travelling on to the engine, whose tensors could not hold them.
MAX_TOP_K = 2**31 - 1

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
    raise ValueError(
        "prompt must be a string, a non-empty list of strings, of token ids (non-negative integers), "
        "or of token-id lists"
    )


def _is_token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


# The union's members carry their bounds too, so that the OpenAPI schema says what is accepted.
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptField = Annotated[
    str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)],
    BeforeValidator(_check_prompt_shape),
]


def _token_id_keys(value: object) -> object:
    """OpenAI's logit_bias is a JSON object, so its token ids arrive as strings: '42' -> 42, range checked
    (`not <=` so that NaN, which compares false, is out of range too)."""
    if not isinstance(value, dict):
        return value
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(number, bool) or not isinstance(number, int | float) or not abs(number) <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {number!r} for token {key}")
        bias[int(key)] = number
    return bias


LogitBias = Annotated[dict[int, float], BeforeValidator(_token_id_keys)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _encodable(cls, value: object) -> object:
        """JSON can escape half of a surrogate pair ("\\ud800"), which Python keeps in a str but no UTF-8 text
        holds: the tokenizer, and the encoder of any reply that quotes it, would fail on it with a 500."""
        if _has_lone_surrogate(value):
            raise ValueError("strings must be valid Unicode, without a lone surrogate such as \\ud800")
        return value


def _has_lone_surrogate(value: object) -> bool:
    # A loop rather than recursion: the body may nest as deep as the JSON parser allowed.
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels; none is added


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: JsonSchema = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's `response_format`. The type is checked here rather than by a Literal so that an unknown one
    is an error naming `response_format` with the types we know. `schema` beside `json_object` is what
    Instructor's JSON_SCHEMA mode, Together and Anyscale send: the reply is held to that schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _known_type(self) -> ResponseFormat:
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"unknown type {self.type!r}: use 'text', 'json_object' or 'json_schema'")
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        if self.schema_ is not None and self.type != "json_object":
            raise ValueError("schema goes with type 'json_object' (with 'json_schema', inside json_schema)")
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
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
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
    prompt_logprobs: int | None = Field(None, ge=0)
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)

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

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    @property
    def sample_counts(self) -> dict[str, int | None]:
        """The fields that count the sequences one prompt runs (bounded by the server's --max-n)."""
        return {"n": self.n}

    @property
    def logprob_counts(self) -> dict[str, int | None]:
        """The fields that count log-probabilities per token (bounded by the server's --max-logprobs)."""
        return {"prompt_logprobs": self.prompt_logprobs}

    @property
    def num_prompts(self) -> int:
        """The requests this call becomes, one per prompt (bounded by the server's --max-prompts)."""
        return 1


class CompletionRequest(SamplingRequest):
    prompt: PromptField
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _best_of_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1) and info.data.get("stream"):
            raise ValueError("best_of other than n cannot be streamed: the best are known only at the end")
        return value

    @property
    def sample_counts(self) -> dict[str, int | None]:
        return {"n": self.n, "best_of": self.best_of}

    @property
    def logprob_counts(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}

    @property
    def num_prompts(self) -> int:
        # A string or one list of token ids is one prompt; otherwise a list of them.
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return 1 if one else len(self.prompt)

    @property
    def max_output(self) -> tuple[str, int | None]:
        """The field that caps the output's tokens, and its value (None: up to the model's length)."""
        return "max_tokens", self.max_tokens


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
    reasoning_content: str | None = None  # an assistant's earlier thinking: templates that show it get it
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
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
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
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: passed to the chat template (`enable_thinking`, say), and a template of the request's own
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(None, min_length=1)
    # OpenAI's fields that pagedllm does not act on: field_policy.CHAT says what becomes of each.
    audio: Any = None
    modalities: list[str] | None = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def logprob_counts(self) -> dict[str, int | None]:
        return {"top_logprobs": self.top_logprobs, "prompt_logprobs": self.prompt_logprobs}

    @property
    def max_output(self) -> tuple[str, int | None]:
        """max_completion_tokens, or the max_tokens it replaces, and its value (None: up to the model's length)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # served by the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


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
    reasoning_content: str | None = None  # vLLM's: a reasoning model's thinking (--reasoning-parser)
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
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
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
    task: str  # what the engine runs: generate (completions, chat, responses), embed, score, or generate,embed ...
    root: str | None = None  # vLLM's: an adapter's folder
    parent: str | None = None  # vLLM's: the base model an adapter runs on; null for a base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's `/v1/load_lora_adapter` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's `/v1/unload_lora_adapter` body; its optional `lora_int_id` is accepted and ignored (the name decides)."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    """`/health`: 200 with ok or overloaded (new requests get 503 until the queue shrinks; no reason to restart),
    503 with dead (the engine cannot go on: restart the server)."""

    status: Literal["ok", "overloaded", "dead"]
    num_waiting: int | None = None
    max_waiting: int | None = None
    message: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
