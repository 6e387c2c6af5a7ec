"""`/v1/responses`: OpenAI's Responses API over the chat path. A request's input items (with the conversation its
`previous_response_id` continues) become chat messages, its tools, `tool_choice` and `text.format` chat's tools
and constraint, and it runs as a chat call (`OpenAIServingChat.start`); its reply, read as chat reads one
(`replies.ReplyReader`), becomes output items: reasoning, a message, function calls. Streamed, the same items are
built event by event (`_EventStream`); stored, the response and its conversation are kept (`ResponseStore`) for
`GET`, `DELETE`, and the next turn; in the background, it runs on after the call returns, until done or cancelled.

Where the Responses API and chat differ in what a field is called, errors name the Responses field.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from pagedllm.entrypoints.openai import field_policy, protocol, replies
from pagedllm.entrypoints.openai import responses_protocol as rp
from pagedllm.entrypoints.openai import serving_common as common
from pagedllm.entrypoints.openai.async_engine import RequestFailedError, RequestGroup
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse, owner_of
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.outputs import CompletionOutput, RequestOutput

# Chat's names for the Responses API's fields, in the errors chat's checks raise.
_CHAT_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(error: common.ApiError) -> common.ApiError:
    info = error.body.error
    param = _CHAT_NAMES.get(info.param or "", info.param)
    message = info.message
    for chat_name, name in _CHAT_NAMES.items():
        message = message.replace(chat_name, name)
    return common.ApiError(error.status, message, param=param, kind=info.type, code=info.code)


# ---- input items to chat messages -------------------------------------------------------------


def _messages(items: list[rp.InputItem], history: list[protocol.ChatMessage]) -> list[protocol.ChatMessage]:
    """The chat messages of `items`, continuing `history`: consecutive function calls join one assistant turn
    (after its text, if the turn had any), and each call's output must answer a call made before it."""
    called = {call.id for message in history for call in message.tool_calls or []}
    messages: list[protocol.ChatMessage] = []
    for index, item in enumerate(items):
        if isinstance(item, rp.MessageItem):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append(protocol.ChatMessage(role=item.role, content=content))
        elif isinstance(item, rp.FunctionCallItem):
            call = protocol.ToolCall(
                id=item.call_id, function=protocol.FunctionCall(name=item.name, arguments=item.arguments)
            )
            _add_call(messages, call)
            called.add(item.call_id)
        elif isinstance(item, rp.FunctionCallOutputItem):
            if item.call_id not in called:
                message = f"input.{index}.call_id: no function_call with call_id {item.call_id!r} comes before it"
                raise common.ApiError(400, message, param=f"input.{index}.call_id")
            messages.append(protocol.ChatMessage(role="tool", content=item.text, tool_call_id=item.call_id))
        # A reasoning item stays out of the prompt: chat templates drop an earlier turn's thinking too.
    return messages


def _add_call(messages: list[protocol.ChatMessage], call: protocol.ToolCall) -> None:
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
    else:
        messages.append(protocol.ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _output_messages(reading: replies.Reading, ids: _ItemIds) -> list[protocol.ChatMessage]:
    """The reply as the next turn's history holds it: one assistant message, its calls under their call ids."""
    calls = [
        protocol.ToolCall(id=item.call_id, function=protocol.FunctionCall(name=item.name, arguments=item.arguments))
        for item in _call_items(reading, ids)
    ]
    if not calls and reading.content is None:
        return []
    return [protocol.ChatMessage(role="assistant", content=reading.content, tool_calls=calls or None)]


# ---- tools and formats to chat's -------------------------------------------------------------


def _chat_request(body: rp.ResponsesRequest, messages: list[protocol.ChatMessage]) -> protocol.ChatCompletionRequest:
    try:
        tools = rp.read_tools(body.tools or [])
    except rp.ItemError as error:
        raise common.ApiError(400, str(error), param=error.param) from error
    # OpenAI takes "auto" and "none" without tools; chat refuses any choice without them.
    choice = body.tool_choice if tools or body.tool_choice not in ("auto", "none") else None
    if isinstance(choice, rp.NamedFunctionChoice):
        choice = protocol.NamedToolChoice(type="function", function=protocol.NamedFunction(name=choice.name))
    chat_tools = [
        protocol.Tool(
            type="function",
            function=protocol.FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in tools
    ]
    return protocol.ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=chat_tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        # As JSON sends it: chat reads the token ids from the keys' text.
        logit_bias={str(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None,
        user=body.user,
        chat_template_kwargs=body.chat_template_kwargs,
        chat_template=body.chat_template,
    )


def _response_format(text: rp.TextConfig | None) -> protocol.ResponseFormat | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return protocol.ResponseFormat(type="json_object", schema=form.schema_)
    if form.schema_ is None or form.name is None:
        raise common.ApiError(400, "text.format: json_schema needs name and schema", param="text.format")
    schema = protocol.JsonSchemaFormat(name=form.name, description=form.description, schema=form.schema_)
    return protocol.ResponseFormat(type="json_schema", json_schema=schema)


# ---- output items -------------------------------------------------------------------------------


@dataclass(slots=True)
class _ItemIds:
    """The ids of one reply's output items, made once: a stream names its items before the reply is whole."""

    reasoning: str = field(default_factory=lambda: _id("rs"))
    message: str = field(default_factory=lambda: _id("msg"))
    call_ids: list[tuple[str, str]] = field(default_factory=list)  # (item id, call id) per call

    def calls(self, count: int) -> list[tuple[str, str]]:
        """The (item id, call id) of the first `count` calls."""
        while len(self.call_ids) < count:
            self.call_ids.append((_id("fc"), f"call_{uuid.uuid4().hex[:24]}"))
        return self.call_ids[:count]


def _has_message(reading: replies.Reading) -> bool:
    return reading.content is not None and bool(reading.content or not reading.calls)


def _call_items(reading: replies.Reading, ids: _ItemIds) -> list[rp.FunctionCallOutput]:
    return [
        rp.FunctionCallOutput(id=item_id, call_id=call_id, name=call.name, arguments=call.arguments, status="completed")
        for call, (item_id, call_id) in zip(reading.calls, ids.calls(len(reading.calls)), strict=True)
    ]


def _output_items(reading: replies.Reading, ids: _ItemIds, status: str) -> list[rp.OutputItem]:
    items: list[rp.OutputItem] = []
    if reading.reasoning is not None:
        text = [rp.ReasoningText(text=reading.reasoning)]
        items.append(rp.ReasoningOutput(id=ids.reasoning, content=text, status="completed"))
    if _has_message(reading):
        text = [rp.OutputText(text=reading.content)]
        items.append(rp.OutputMessage(id=ids.message, status=status, content=text))
    return [*items, *_call_items(reading, ids)]


def _usage(final: RequestOutput) -> rp.ResponseUsage:
    prompt, output = len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs)
    return rp.ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=rp.InputTokensDetails(cached_tokens=final.num_cached_tokens or 0),
        output_tokens=output,
        output_tokens_details=rp.OutputTokensDetails(),
        total_tokens=prompt + output,
    )


@dataclass(frozen=True, slots=True)
class _Turn:
    """One call of the Responses API: what its response repeats of the request, and the conversation it ran on
    (its instructions aside: a later turn does not inherit them, as in OpenAI's API)."""

    body: rp.ResponsesRequest
    response_id: str
    model: str
    created: int
    owner: str
    conversation: list[protocol.ChatMessage]

    def response(self, status: rp.Status, output: list[rp.OutputItem] | None = None, **more: Any) -> rp.Response:
        body = self.body
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        tool_choice = body.tool_choice or ("auto" if body.tools else "none")
        return rp.Response(
            id=self.response_id,
            created_at=self.created,
            model=self.model,
            status=status,
            output=output or [],
            instructions=body.instructions,
            metadata=body.metadata,
            parallel_tool_calls=body.parallel_tool_calls,
            temperature=body.temperature,
            top_p=body.top_p,
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            tools=body.tools or [],
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            background=body.background,
            store=body.store,
            text={
                "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
            },
            reasoning=body.reasoning,
            user=body.user,
            **more,
        )

    def finished(self, final: RequestOutput, reading: replies.Reading, ids: _ItemIds) -> rp.Response:
        """The response of the finished request `final`, whose reply reads as `reading`."""
        cut = final.outputs[0].finish_reason == "length"
        items = _output_items(reading, ids, "incomplete" if cut else "completed")
        details = rp.IncompleteDetails(reason="max_output_tokens") if cut else None
        status = "incomplete" if cut else "completed"
        return self.response(status, items, usage=_usage(final), incomplete_details=details, completed_at=_now())

    def stored(self, response: rp.Response, reading: replies.Reading | None, ids: _ItemIds) -> StoredResponse:
        """`response` kept with its conversation, to which its reply (`reading`, None while it runs) is added."""
        output = _output_messages(reading, ids) if reading is not None else []
        return StoredResponse(self.owner, response, [*self.conversation, *output])


def _kept(
    store: ResponseStore, turn: _Turn, response: rp.Response, reading: replies.Reading, ids: _ItemIds
) -> rp.Response:
    """`response`, stored when its request asked: one the store cannot take (over its bytes, or full of running
    background responses) is answered all the same, saying `store: false`, since its tokens are already made."""
    if not turn.body.store:
        return response
    try:
        store.put(turn.stored(response, reading, ids))
    except common.ApiError:
        return response.model_copy(update={"store": False})
    return response


def _now() -> int:
    return int(time.time())


# ---- the endpoints --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenAIServingResponses:
    chat: OpenAIServingChat
    store: ResponseStore

    async def create(self, body: rp.ResponsesRequest, request: Request) -> Any:
        ignored = field_policy.ignored_fields(body, field_policy.RESPONSES)
        headers = field_policy.header(ignored)
        if body.background and not body.store:
            raise common.ApiError(400, "background responses must be stored: store true", param="background")
        call = self.chat._call("resp", body.model)  # a 404 for an unknown model; the adapter it names, if any
        turn, chat_body = self._turn(body, owner_of(request.headers.get("authorization")), call.model)
        try:
            run = await self.chat.start(chat_body, call)
        except common.ApiError as error:
            raise _renamed(error) from error
        if body.background:
            return JSONResponse(self._in_background(turn, run).model_dump(), headers=headers)
        if body.stream:
            events = _EventStream(turn, run, self.store).events()
            abort = BackgroundTask(run.group.abort)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers, background=abort)
        (final,) = await common.finals_or_abort(run.group, request)
        ids, reading = _ItemIds(), run.reader.read(final.outputs[0].text)
        response = _kept(self.store, turn, turn.finished(final, reading, ids), reading, ids)
        return JSONResponse(response.model_dump(), headers=headers)

    def _turn(self, body: rp.ResponsesRequest, owner: str, model: str) -> tuple[_Turn, protocol.ChatCompletionRequest]:
        history: list[protocol.ChatMessage] = []
        if body.previous_response_id is not None:
            previous = self.store.get(owner, body.previous_response_id, param="previous_response_id")
            history = previous.conversation
        raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
        try:
            items = rp.read_items(raw)
        except rp.ItemError as error:
            raise common.ApiError(400, str(error), param=error.param) from error
        conversation = [*history, *_messages(items, history)]
        system = [protocol.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
        try:
            chat_body = _chat_request(body, [*system, *conversation])
        except ValidationError as error:  # a chat rule the Responses request's own types do not carry
            problem = error.errors()[0]
            raise common.ApiError(400, problem["msg"].removeprefix("Value error, ")) from error
        return _Turn(body, _id("resp"), model, _now(), owner, conversation), chat_body

    def _in_background(self, turn: _Turn, run: ChatRun) -> rp.Response:
        queued = turn.response("queued")
        entry = turn.stored(queued, None, _ItemIds())
        self.store.put(entry)
        entry.task = asyncio.ensure_future(self._run_in_background(turn, run, entry))
        return queued

    async def _run_in_background(self, turn: _Turn, run: ChatRun, entry: StoredResponse) -> None:
        entry.response = turn.response("in_progress")
        try:
            finals = [output async for _, output in run.group if output.finished]
        except RequestFailedError as error:
            entry.response = turn.response("failed", error=rp.ResponseError(code="server_error", message=str(error)))
            return
        finally:
            run.group.abort()  # cancelled (or failed): give the blocks back now; nothing once it has finished
        final = finals[0]
        if final.outputs[0].finish_reason == "abort":  # cancelled
            entry.response = turn.response("cancelled")
            return
        ids, reading = _ItemIds(), run.reader.read(final.outputs[0].text)
        finished = turn.stored(turn.finished(final, reading, ids), reading, ids)
        entry.response, entry.conversation = finished.response, finished.conversation
        entry.task = None
        try:
            self.store.put(entry)  # its size again, now that it is whole
        except common.ApiError as error:  # too large to keep: nobody waits on this call to hear it
            entry.conversation = []
            entry.response = turn.response("failed", error=rp.ResponseError(code="store_full", message=str(error)))

    async def retrieve(self, response_id: str, request: Request) -> JSONResponse:
        entry = self.store.get(owner_of(request.headers.get("authorization")), response_id)
        return JSONResponse(entry.response.model_dump())

    async def delete(self, response_id: str, request: Request) -> JSONResponse:
        entry = self.store.delete(owner_of(request.headers.get("authorization")), response_id)
        if entry.running:
            entry.task.cancel()
        return JSONResponse(rp.DeletedResponse(id=response_id).model_dump())

    async def cancel(self, response_id: str, request: Request) -> JSONResponse:
        """A background response stops where it is (its requests aborted, their blocks returned); cancelling one
        that has finished changes nothing, as in OpenAI's API."""
        entry = self.store.get(owner_of(request.headers.get("authorization")), response_id)
        if not entry.response.background:
            raise common.ApiError(400, "only background responses can be cancelled", param="response_id")
        if entry.running:
            entry.task.cancel()
            entry.response = entry.response.model_copy(update={"status": "cancelled"})
        return JSONResponse(entry.response.model_dump())


# ---- a stream -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _EventStream:
    """A response streamed as OpenAI's events: the response created and in progress; each output item added, its
    content part opened, its text in deltas, then done; each function call added with its arguments, then done;
    and the response completed (also when the length limit cut it: its status then says incomplete, as vLLM
    does, so that a client's stream helper still gets its final response). Every event has its
    `sequence_number`."""

    turn: _Turn
    run: ChatRun
    store: ResponseStore
    ids: _ItemIds = field(default_factory=_ItemIds)
    sequence: int = 0
    outputs: int = 0  # output items opened so far
    open_reasoning: int | None = None  # the output index of the open reasoning item
    reasoned: bool = False  # whether a reasoning item went out
    open_message: int | None = None
    reasoning_text: str = ""
    message_text: str = ""

    async def events(self) -> AsyncIterator[str]:
        group = self.run.group
        try:
            yield self._event("response.created", response=self.turn.response("in_progress"))
            yield self._event("response.in_progress", response=self.turn.response("in_progress"))
            async for event in self._body(group):
                yield event
        except RequestFailedError as error:
            failed = self.turn.response("failed", error=rp.ResponseError(code="server_error", message=str(error)))
            yield self._event("response.failed", response=failed)
        finally:
            group.abort()  # a disconnect cancels us mid-stream: give the blocks back now

    async def _body(self, group: RequestGroup) -> AsyncIterator[str]:
        stream = self.run.reader.stream()
        sent = 0
        async for _, output in group:
            completion = output.outputs[0] if output.outputs else None
            if completion is None:
                continue
            new_text, sent = completion.text[sent:], len(completion.text)
            if completion.finish_reason is None:
                for event in self._released(stream.advance(new_text)):
                    yield event
                continue
            released, reading = stream.finish(new_text)
            for event in [*self._released(released), *self._finish(output, completion, reading)]:
                yield event

    def _released(self, released: replies.Released) -> list[str]:
        events = []
        if released.reasoning:
            if self.open_reasoning is None:
                events += self._open_reasoning()
            self.reasoning_text += released.reasoning
            events.append(self._text_event("response.reasoning_text.delta", self.open_reasoning, released.reasoning))
        if released.content:
            events += self._close_reasoning()
            if self.open_message is None:
                events += self._open_message()
            self.message_text += released.content
            events.append(self._text_event("response.output_text.delta", self.open_message, released.content))
        return events

    def _open_reasoning(self) -> list[str]:
        self.reasoned = True
        self.open_reasoning = self._next_output()
        item = rp.ReasoningOutput(id=self.ids.reasoning, content=[], status="in_progress")
        part = rp.ReasoningText(text="")
        return [
            self._item_event("response.output_item.added", self.open_reasoning, item),
            self._part_event("response.content_part.added", self.open_reasoning, self.ids.reasoning, part),
        ]

    def _close_reasoning(self) -> list[str]:
        index = self.open_reasoning
        if index is None:
            return []
        self.open_reasoning = None
        part = rp.ReasoningText(text=self.reasoning_text)
        item = rp.ReasoningOutput(id=self.ids.reasoning, content=[part], status="completed")
        return [
            self._event(
                "response.reasoning_text.done", **self._at(index, self.ids.reasoning), text=self.reasoning_text
            ),
            self._part_event("response.content_part.done", index, self.ids.reasoning, part),
            self._item_event("response.output_item.done", index, item),
        ]

    def _open_message(self) -> list[str]:
        self.open_message = self._next_output()
        item = rp.OutputMessage(id=self.ids.message, status="in_progress", content=[])
        part = rp.OutputText(text="")
        return [
            self._item_event("response.output_item.added", self.open_message, item),
            self._part_event("response.content_part.added", self.open_message, self.ids.message, part),
        ]

    def _close_message(self, status: str) -> list[str]:
        index = self.open_message
        if index is None:
            return []
        self.open_message = None
        part = rp.OutputText(text=self.message_text)
        item = rp.OutputMessage(id=self.ids.message, status=status, content=[part])
        return [
            self._event(
                "response.output_text.done", **self._at(index, self.ids.message), text=self.message_text, logprobs=[]
            ),
            self._part_event("response.content_part.done", index, self.ids.message, part),
            self._item_event("response.output_item.done", index, item),
        ]

    def _finish(self, final: RequestOutput, completion: CompletionOutput, reading: replies.Reading) -> list[str]:
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        opened = self._open_reasoning() if reading.reasoning is not None and not self.reasoned else []
        events = [*opened, *self._close_reasoning()]  # an empty block still has its item
        if _has_message(reading) and self.open_message is None:
            events += self._open_message()  # an empty reply still has its message
        events += self._close_message(status)
        for item in _call_items(reading, self.ids):
            index = self._next_output()
            opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
            events.append(self._item_event("response.output_item.added", index, opened))
            at = {"item_id": item.id, "output_index": index}
            events.append(self._event("response.function_call_arguments.delta", **at, delta=item.arguments))
            events.append(
                self._event("response.function_call_arguments.done", **at, name=item.name, arguments=item.arguments)
            )
            events.append(self._item_event("response.output_item.done", index, item))
        response = _kept(self.store, self.turn, self.turn.finished(final, reading, self.ids), reading, self.ids)
        events.append(self._event("response.completed", response=response))
        return events

    def _next_output(self) -> int:
        self.outputs += 1
        return self.outputs - 1

    @staticmethod
    def _at(index: int, item_id: str) -> dict[str, Any]:
        return {"item_id": item_id, "output_index": index, "content_index": 0}

    def _text_event(self, kind: str, index: int, delta: str) -> str:
        item_id = self.ids.reasoning if kind.startswith("response.reasoning") else self.ids.message
        more = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self._event(kind, **self._at(index, item_id), delta=delta, **more)

    def _item_event(self, kind: str, index: int, item: BaseModel) -> str:
        return self._event(kind, output_index=index, item=item)

    def _part_event(self, kind: str, index: int, item_id: str, part: BaseModel) -> str:
        return self._event(kind, **self._at(index, item_id), part=part)

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence}
        data |= {name: value.model_dump() if isinstance(value, BaseModel) else value for name, value in fields.items()}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
