"""The Responses API's bodies (`/v1/responses`), as OpenAI documents them and vLLM serves them: the request, the
input items it carries, the response and its output items, and the events of a stream.

A request is validated as strictly as chat's (protocol._Strict). Its input items and tools are read one by one
(`input_messages`, `function_tools`) so that an unknown item or a built-in tool is a 400 naming its place
(`input.3.type`, `tools.0.type`) rather than one error per member of a union.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, field_validator

from pagedllm.entrypoints.openai.protocol import (
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    MIN_TOP_P,
    JsonSchema,
    LogitBias,
    _Strict,
)

# Tools OpenAI runs on its side: pagedllm runs none of them, so a request that offers one is refused.
BUILT_IN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
        "tool_search",
        "namespace",
    }
)


class ItemError(ValueError):
    """An input item or tool that cannot be read, with the field it names (`input.2.call_id`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---- the request ----------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier reply's output_text, sent back as is
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningItem(_Strict):
    """An earlier reply's reasoning, sent back by agent loops: kept out of the prompt, as chat templates keep an
    earlier turn's thinking out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_TEXT_PARTS = ("input_text", "output_text")


def read_items(raw: list[dict[str, Any]]) -> list[InputItem]:
    """The input items, each checked by its type; ItemError naming the first that does not read."""
    return [_read_item(index, item) for index, item in enumerate(raw)]


def _read_item(index: int, raw: dict[str, Any]) -> InputItem:
    where = f"input.{index}"
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in _ITEMS:
        known = ", ".join(_ITEMS)
        raise ItemError(f"{where}.type", f"{where}: unknown item type {kind!r}; pagedllm reads {known}")
    if kind == "message" and isinstance(raw.get("content"), list):
        for number, part in enumerate(raw["content"]):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in _TEXT_PARTS:
                param = f"{where}.content.{number}"
                raise ItemError(param, f"{param}: a {part_type!r} part; pagedllm reads text parts only")
    return _validated(_ITEMS[kind], raw, where)


def _validated(kind: type[_Strict], raw: dict[str, Any], where: str) -> Any:
    try:
        return kind.model_validate(raw)
    except ValidationError as error:
        problem = error.errors()[0]
        param = ".".join([where, *(str(part) for part in problem["loc"] if not _is_tag(part))])
        message = "unknown field" if problem["type"] == "extra_forbidden" else problem["msg"]
        raise ItemError(param, f"{param}: {message.removeprefix('Value error, ')}") from error


def _is_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


def read_tools(raw: list[dict[str, Any]]) -> list[FunctionTool]:
    tools = []
    for index, tool in enumerate(raw):
        kind = tool.get("type")
        param = f"tools.{index}.type"
        if kind in BUILT_IN_TOOLS:
            message = f"{param}: pagedllm does not run built-in tools ({kind!r}); offer function tools instead"
            raise ItemError(param, message)
        if kind != "function":
            raise ItemError(param, f"{param}: unknown tool type {kind!r}; pagedllm runs function tools")
        tools.append(_validated(FunctionTool, tool, f"tools.{index}"))
    return tools


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object (optionally held to `schema`, as chat's json_object), or a
    JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # no served model has a verbosity setting


def _non_empty_items(value: object) -> object:
    if isinstance(value, list) and not value:
        raise ValueError("input must be a string or a non-empty list of items")
    return value


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], BeforeValidator(_non_empty_items)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    # vLLM's extras
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    logit_bias: LogitBias | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(None, min_length=1)
    # OpenAI's fields that pagedllm does not act on: field_policy.RESPONSES says what becomes of each.
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    context_management: Any = None
    top_logprobs: int | None = None
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None

    @field_validator("background")
    @classmethod
    def _background_is_stored(cls, value: bool, info: Any) -> bool:
        if value and info.data.get("stream"):
            raise ValueError("a background response cannot be streamed here: poll GET /v1/responses/{id}")
        return value


# ---- the response ---------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = ReasoningOutput | OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


Status = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    model: str
    status: Status
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    text: dict[str, Any]
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
