"""A tiny random Qwen3 that chats through a Qwen3-style chat template, with the markers that template and the
reasoning and tool parsers rely on each one token, as in Qwen3's own vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase

from tests.conftest import build_tokenizer, save_tiny_model

# Written for these tests after Qwen3's template, with the parts the server relies on: the switch that closes an
# empty think block in the generation prompt, tools in the system turn, calls and results in Hermes' tags, and an
# earlier turn's reasoning shown only after the last user message.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
    {{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content and loop.index0 > ns.last_user %}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
        {%- endif %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {%- if loop.first and message.content %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- (call.function.arguments if call.function.arguments is string else call.function.arguments | tojson) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


# Qwen3's added tokens that are not special (conftest's tokenizer already has <|endoftext|>, <|im_start|> and
# <|im_end|> as special ones, as Qwen3 does): decoding with skip_special_tokens keeps them in the text, which is how
# the parsers get to see them.
MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


@dataclass(frozen=True, slots=True)
class ThinkTokenIds:
    start: int  # <think>
    end: int  # </think>


def build_qwen3_tokenizer() -> PreTrainedTokenizerBase:
    tokenizer = build_tokenizer()
    # Unnormalized, as in Qwen3's tokenizer.json: the markers match the raw text.
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in MARKERS])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def save_tiny_qwen3(folder: Path, seed: int = 0) -> Path:
    """The model and its tokenizer saved in `folder` as an HF folder; its vocabulary covers the added markers."""
    tokenizer = build_qwen3_tokenizer()
    # Room for the template's tool preamble; save_tiny_model writes conftest's plain tokenizer, replaced below.
    save_tiny_model(folder, "qwen3", seed=seed, vocab_size=len(tokenizer), max_position_embeddings=2048)
    tokenizer.save_pretrained(folder)
    return folder


def think_token_ids(tokenizer: PreTrainedTokenizerBase) -> ThinkTokenIds:
    """The ids of `<think>` and `</think>` (to force them through logit_bias, or find them in outputs)."""
    start, end = (_single_token(tokenizer, marker) for marker in ("<think>", "</think>"))
    return ThinkTokenIds(start, end)


def _single_token(tokenizer: PreTrainedTokenizerBase, marker: str) -> int:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{marker!r} is not one token of this tokenizer: {ids}")
    return ids[0]
