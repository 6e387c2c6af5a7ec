"""What the server does with the request fields OpenAI has added that pagedllm does not act on: one decision per
field, in one table per endpoint (docs/API.md shows the same tables).

- `ignored`: accepted, and named in the reply's `pagedllm-ignored-fields` header (and once in the log), because
  a client that sends it still gets what it asked for in every way that matters (a routing hint, a billing tier).
- `refused`: a 400 saying why, because going on without it would give the client something other than what it
  asked for (audio, a web search, a moderation pass), unless its value asks for nothing (`harmless`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from pagedllm.entrypoints.openai.serving_common import ApiError

IGNORED_HEADER = "pagedllm-ignored-fields"
_log = logging.getLogger("pagedllm.server")
_logged: set[str] = set()


def _nothing(_: Any) -> bool:
    return False


def _is_false(value: Any) -> bool:
    return value is False


def _text_only(value: Any) -> bool:
    return value == ["text"]


@dataclass(frozen=True, slots=True)
class Policy:
    action: Literal["ignored", "refused"]
    why: str
    harmless: Callable[[Any], bool] = field(default=_nothing)  # values that ask for nothing: accepted silently


def _ignored(why: str, harmless: Callable[[Any], bool] = _nothing) -> Policy:
    return Policy("ignored", why, harmless)


def _refused(why: str, harmless: Callable[[Any], bool] = _nothing) -> Policy:
    return Policy("refused", why, harmless)


_CACHE = "the prefix cache finds shared prefixes by itself, with no key or retention to set"
_TIER = "there is one tier: every request is served alike"
_SAFETY = "an end-user identifier for OpenAI's abuse monitoring; pagedllm monitors nothing"
_MODERATION = "pagedllm runs no moderation model"

CHAT: dict[str, Policy] = {
    "audio": _refused("pagedllm produces text only"),
    "modalities": _refused("pagedllm produces text only: use ['text'] or leave it out", _text_only),
    "functions": _refused("deprecated by OpenAI: send tools instead"),
    "function_call": _refused("deprecated by OpenAI: send tool_choice instead"),
    "web_search_options": _refused("pagedllm runs no web search"),
    "moderation": _refused(_MODERATION),
    "store": _ignored("chat completions are not stored; /v1/responses stores responses", _is_false),
    "metadata": _ignored("kept only with stored responses (/v1/responses)"),
    "prediction": _ignored("a predicted output only speeds OpenAI's models; the answer is the same without it"),
    "reasoning_effort": _ignored("the served models have no effort levels (see chat_template_kwargs)"),
    "verbosity": _ignored("the served models have no verbosity setting"),
    "service_tier": _ignored(_TIER),
    "safety_identifier": _ignored(_SAFETY),
    "prompt_cache_key": _ignored(_CACHE),
    "prompt_cache_retention": _ignored(_CACHE),
    "prompt_cache_options": _ignored(_CACHE),
}

RESPONSES: dict[str, Policy] = {
    "conversation": _refused("the Conversations API is not served: chain responses with previous_response_id"),
    "prompt": _refused("no prompt templates are stored here: send input and instructions"),
    "moderation": _refused(_MODERATION),
    "include": _ignored("no includable extra is produced (encrypted reasoning, logprobs, search results)"),
    "reasoning": _ignored("effort and summaries are not settable; a reasoning model's thinking is returned whole"),
    "truncation": _ignored("input is never truncated: a conversation too long for the model is a 400"),
    "max_tool_calls": _ignored("it bounds built-in tool calls, which pagedllm does not run"),
    "context_management": _ignored("context is never compacted: a conversation too long for the model is a 400"),
    "top_logprobs": _ignored("log-probabilities are served on chat and completions"),
    "stream_options": _ignored("no obfuscation padding is added to stream events"),
    "service_tier": _ignored(_TIER),
    "safety_identifier": _ignored(_SAFETY),
    "prompt_cache_key": _ignored(_CACHE),
    "prompt_cache_retention": _ignored(_CACHE),
    "prompt_cache_options": _ignored(_CACHE),
}


EMBEDDINGS: dict[str, Policy] = {
    "user": _ignored(_SAFETY),
}


def ignored_fields(body: BaseModel, table: dict[str, Policy]) -> list[str]:
    """The fields of `table` that `body` set to something pagedllm does not act on, after refusing (a 400 naming
    the field) those it cannot do without."""
    ignored = []
    for name, policy in table.items():
        value = getattr(body, name, None)
        if name not in body.model_fields_set or value is None or policy.harmless(value):
            continue
        if policy.action == "refused":
            raise ApiError(400, f"{name} is not supported: {policy.why}", param=name)
        ignored.append(name)
        if name not in _logged:
            _logged.add(name)
            _log.warning("request field %s is accepted and ignored: %s", name, policy.why)
    return ignored


def header(ignored: list[str]) -> dict[str, str]:
    return {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}
