"""Every field the `openai` SDK's chat, Responses and embeddings request types carry has one decision here: acted on (a
field of pagedllm's request model outside field_policy's table) or in the table, ignored or refused; and docs/API.md
shows the same table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from openai.types import embedding_create_params
from openai.types.chat import completion_create_params
from openai.types.responses import response_create_params

from pagedllm.entrypoints.openai import field_policy, protocol
from pagedllm.entrypoints.openai import pooling_protocol as pp
from pagedllm.entrypoints.openai import responses_protocol as rp

API_DOC = Path(__file__).parents[1] / "docs" / "API.md"
ENDPOINTS = [
    (completion_create_params.CompletionCreateParamsBase, protocol.ChatCompletionRequest, field_policy.CHAT, "Chat"),
    (response_create_params.ResponseCreateParamsBase, rp.ResponsesRequest, field_policy.RESPONSES, "Responses"),
    (embedding_create_params.EmbeddingCreateParams, pp.EmbeddingRequest, field_policy.EMBEDDINGS, "Embeddings"),
]
IDS = ["chat", "responses", "embeddings"]


@pytest.mark.parametrize(("sdk", "model", "table", "title"), ENDPOINTS, ids=IDS)
def test_every_sdk_field_has_a_decision(sdk, model, table, title):
    undecided = [name for name in sdk.__annotations__ if name not in model.model_fields]
    assert not undecided, f"the openai SDK sends {undecided}: act on them or add them to field_policy"
    assert set(table) <= set(model.model_fields), "a policy for a field the request model does not declare"


@pytest.mark.parametrize(("sdk", "model", "table", "title"), ENDPOINTS, ids=IDS)
def test_the_docs_show_the_code_table(sdk, model, table, title):
    section = API_DOC.read_text().split(f"### {title}", 1)[1].split("###", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (ignored|refused) \|", section, re.MULTILINE))
    assert rows == {name: policy.action for name, policy in table.items()}
