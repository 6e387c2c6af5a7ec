"""Stored responses (`store: true`, OpenAI's default): what `previous_response_id` continues and
`GET /v1/responses/{id}` reads, in memory, bounded by count and by bytes (`--max-stored-responses`,
`--max-stored-response-bytes`), oldest out first. Each entry belongs to the API key that made it: another key's
request finds nothing (a 404, as for an id that never was), so one key never reads another's conversations."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.responses_protocol import Response
from pagedllm.entrypoints.openai.serving_common import ApiError


def owner_of(authorization: str | None) -> str:
    """Whose entries a request may read: a digest of the key it presents (the key itself is not kept)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


@dataclass(slots=True)
class StoredResponse:
    owner: str
    response: Response  # replaced as a background response moves on
    conversation: list[ChatMessage]  # the messages it ran on, its instructions aside, then its output
    task: asyncio.Task | None = None  # a background response's run, until it ends

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def size(self) -> int:
        messages = sum(len(message.model_dump_json()) for message in self.conversation)
        return len(self.response.model_dump_json()) + messages


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def put(self, entry: StoredResponse) -> None:
        """Store (or update) `entry` as the newest, evicting the oldest finished entries to stay within both
        bounds; a 503 when only running background responses could make room."""
        response_id = entry.response.id
        size = entry.size()
        if size > self.max_bytes:
            message = f"the response is {size} bytes, over --max-stored-response-bytes ({self.max_bytes}): store false"
            raise ApiError(400, message, param="store")
        self._entries.pop(response_id, None)
        self._sizes.pop(response_id, None)
        while self._entries and (len(self._entries) >= self.max_count or self.bytes + size > self.max_bytes):
            oldest = next((key for key, old in self._entries.items() if not old.running), None)
            if oldest is None:
                message = "the response store is full of running background responses; retry later"
                raise ApiError(503, message, kind="server_error", code="store_full")
            del self._entries[oldest]
            del self._sizes[oldest]
        self._entries[response_id] = entry
        self._sizes[response_id] = size

    def get(self, owner: str, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            message = f"no stored response with id {response_id!r} (never stored, deleted, or evicted)"
            raise ApiError(404, message, param=param, code="response_not_found")
        return entry

    def delete(self, owner: str, response_id: str) -> StoredResponse:
        entry = self.get(owner, response_id)
        del self._entries[response_id]
        del self._sizes[response_id]
        return entry
