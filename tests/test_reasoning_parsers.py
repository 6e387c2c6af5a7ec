"""The reasoning parsers on their own (no server): finished replies split, unfinished ones settled so that a stream
never sends what the finished reply takes back, the parser "auto" picks from real and R1-style templates; and a tiny
Qwen3 with Qwen3's real chat template, its think tags single tokens that survive decoding and logit bias."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams, config
from pagedllm.entrypoints.openai import reasoning_parsers
from pagedllm.entrypoints.openai.reasoning_parsers import DeepSeekR1Parser, Qwen3Parser, Settled, Split
from tests.conftest import CHAT_TEMPLATE
from tests.qwen3_chat import MARKERS, QWEN3_CHAT_TEMPLATE, build_qwen3_tokenizer, save_tiny_qwen3, think_token_ids

HI = [{"role": "user", "content": "hi"}]
# DeepSeek-R1's generation prompt as its template writes it: full-width bars, the block opened in a Jinja string.
R1_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
# QwQ's: ChatML, the block opened after the assistant header.
QWQ_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
)
# Qwen3.5's way: the switch closes an empty block, and otherwise the prompt opens the block itself.
QWEN35_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}",
)

SPLITS = [
    (Qwen3Parser(), "<think>\nweigh it\n</think>\n\nIt is 4.", Split("\nweigh it\n", "It is 4.")),
    (Qwen3Parser(), "<think>weigh</think>", Split("weigh", None)),
    (Qwen3Parser(), "\n<think>a</think>b", Split("a", "b")),
    (Qwen3Parser(), "Just 4.", Split(None, "Just 4.")),
    (Qwen3Parser(), "<think>cut short", Split("cut short", None)),
    (Qwen3Parser(), "<think>", Split("", None)),
    (Qwen3Parser(), "4, not <think>x</think>", Split(None, "4, not <think>x</think>")),
    (Qwen3Parser(), "<think>a</think>\n\nb</think>c", Split("a", "b</think>c")),
    (DeepSeekR1Parser(), "weigh it</think>\n\nIt is 4.", Split("weigh it", "It is 4.")),
    (DeepSeekR1Parser(), "<think>weigh</think>4", Split("weigh", "4")),
    (DeepSeekR1Parser(), "never closed", Split("never closed", None)),
    (DeepSeekR1Parser(), "a<think>b</think>", Split("a<think>b", None)),
    (DeepSeekR1Parser(), "", Split("", None)),
]


@pytest.mark.parametrize(("parser", "text", "expected"), SPLITS)
def test_a_finished_reply_splits(parser, text, expected):
    assert parser.split(text) == expected


REPLIES = [
    "<think>\nweigh it\n</think>\n\nIt is 4.",
    "<think>a < b and </thin is not </think> yet</think>\n\n\nanswer </think> <think>",
    "  <think>x</think>",
    "<thinking aloud> is content for qwen3",
    "no tags at all\n\n",
    "<think>cut </thi",
    "weigh</think>\n\nIt is 4.",
    "<think>weigh</think>4",
    "</think>only an answer",
    "<</think>>",
    "",
]


@pytest.mark.parametrize("parser", [Qwen3Parser(), DeepSeekR1Parser()], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("reply", REPLIES)
def test_what_a_prefix_settles_the_finished_reply_keeps(parser, reply):
    final = parser.split(reply)
    for end in range(len(reply) + 1):
        settled = parser.settled(reply[:end])
        assert (final.reasoning or "").startswith(settled.reasoning), (reply[:end], settled)
        assert (final.content or "").startswith(settled.content), (reply[:end], settled)


@pytest.mark.parametrize("parser", [Qwen3Parser(), DeepSeekR1Parser()], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("reply", REPLIES)
def test_a_stream_that_counts_what_it_sent_adds_up_to_the_split(parser, reply):
    """A character at a time, as the docstring of Settled tells a stream to: what went out, then the rest of the
    split at the end, is the split."""
    reasoning, content = "", ""
    for end in range(len(reply) + 1):
        settled = parser.settled(reply[:end])
        reasoning += settled.reasoning[len(reasoning) :]
        content += settled.content[len(content) :]
    final = parser.split(reply)
    reasoning += (final.reasoning or "")[len(reasoning) :]
    content += (final.content or "")[len(content) :]
    assert (reasoning, content) == (final.reasoning or "", final.content or "")


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        (Qwen3Parser(), "", Settled("", "")),
        (Qwen3Parser(), "\n<thi", Settled("", "")),  # may be the opening tag
        (Qwen3Parser(), "<think>ab</th", Settled("ab", "")),
        (Qwen3Parser(), "<think>ab</think>\n", Settled("ab", "")),  # the blank line may be all there is
        (Qwen3Parser(), "<think>ab</think>\n\nIt <th", Settled("ab", "It <th")),  # tags after the block are text
        (Qwen3Parser(), "Hello <thi", Settled("", "Hello <thi")),
        (DeepSeekR1Parser(), "<th", Settled("", "")),
        (DeepSeekR1Parser(), "<think>ab</", Settled("ab", "")),
        (DeepSeekR1Parser(), "ab <", Settled("ab ", "")),
        (DeepSeekR1Parser(), "ab</think>\n\nc", Settled("ab", "c")),
    ],
)
def test_an_unfinished_reply_sends_all_but_what_may_be_a_tag(parser, text, expected):
    assert parser.settled(text) == expected


def test_auto_picks_qwen3_for_qwen3s_real_template():
    assert type(reasoning_parsers.get_reasoning_parser("auto", QWEN3_CHAT_TEMPLATE)) is Qwen3Parser


@pytest.mark.parametrize("template", [R1_TEMPLATE, QWQ_TEMPLATE, QWEN35_TEMPLATE], ids=["r1", "qwq", "qwen3.5"])
def test_auto_picks_deepseek_r1_where_the_generation_prompt_opens_the_block(template):
    assert type(reasoning_parsers.get_reasoning_parser("auto", template)) is DeepSeekR1Parser


@pytest.mark.parametrize(
    "template",
    [
        CHAT_TEMPLATE,
        None,
        # Opens the block, but only for earlier turns.
        "{% for m in messages %}<think>\n{{ m['content'] }}</think>{% endfor %}",
        "{{ raise_exception('no') }}<think>\n",
    ],
    ids=["chatml", "no template", "block in turns only", "fails to render"],
)
def test_auto_picks_none_for_other_templates(template):
    assert reasoning_parsers.get_reasoning_parser("auto", template) is None


def test_parsers_by_name():
    assert type(reasoning_parsers.get_reasoning_parser("qwen3", None)) is Qwen3Parser
    assert type(reasoning_parsers.get_reasoning_parser("deepseek_r1", CHAT_TEMPLATE)) is DeepSeekR1Parser
    assert reasoning_parsers.get_reasoning_parser("none", QWEN3_CHAT_TEMPLATE) is None
    assert reasoning_parsers.get_reasoning_parser(None, QWEN3_CHAT_TEMPLATE) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwq'"):
        reasoning_parsers.get_reasoning_parser("qwq", None)


def test_the_names_agree_with_the_servers_choices():
    assert reasoning_parsers.REASONING_PARSERS == config.REASONING_PARSERS
    for name in reasoning_parsers.REASONING_PARSERS:
        reasoning_parsers.get_reasoning_parser(name, QWEN3_CHAT_TEMPLATE)


def test_the_switch_closes_an_empty_block_in_the_prompt_only_when_thinking_is_off():
    tokenizer = build_qwen3_tokenizer()
    off = tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    on = tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")
    assert reasoning_parsers.closed_in_prompt(off) and not reasoning_parsers.closed_in_prompt(on)


def test_the_template_renders_tools_and_calls_in_qwen3s_tags():
    tokenizer = build_qwen3_tokenizer()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    chat = [*HI, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    text = tokenizer.apply_chat_template(chat, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_the_markers_are_single_tokens_that_decoding_keeps():
    tokenizer = build_qwen3_tokenizer()
    for marker in MARKERS:
        (token,) = tokenizer.encode(marker, add_special_tokens=False)
        assert not tokenizer.added_tokens_decoder[token].special, marker
        assert tokenizer.decode([token], skip_special_tokens=True) == marker
    assert tokenizer.decode(tokenizer.encode("<|im_start|>x"), skip_special_tokens=True) == "x"


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


def test_the_saved_qwen3_covers_its_tokenizer(qwen3_folder):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    ids = think_token_ids(tokenizer)
    assert tokenizer.chat_template == QWEN3_CHAT_TEMPLATE
    assert tokenizer.convert_ids_to_tokens([ids.start, ids.end]) == ["<think>", "</think>"]
    assert max(ids.start, ids.end) < len(tokenizer)


def test_the_tiny_qwen3_generates_and_logit_bias_forces_the_think_tags(qwen3_folder):
    llm = LLM(model=qwen3_folder, dtype="float32")
    ids = think_token_ids(llm.get_tokenizer())
    forced = [SamplingParams(temperature=0, max_tokens=1, logit_bias={tag: 100}) for tag in (ids.start, ids.end)]
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={ids.start: -100, ids.end: -100})
    thinking = {"enable_thinking": True}
    outputs = [
        *llm.chat([HI, HI], forced, use_tqdm=False, chat_template_kwargs=thinking),
        *llm.chat(HI, free, use_tqdm=False, chat_template_kwargs={"enable_thinking": False}),
    ]
    opened, closed, answered = (output.outputs[0] for output in outputs)
    assert (opened.token_ids, opened.text) == ([ids.start], "<think>")
    assert (closed.token_ids, closed.text) == ([ids.end], "</think>")
    assert len(answered.token_ids) == 8
    assert outputs[2].prompt.endswith("<think>\n\n</think>\n\n")
    assert Qwen3Parser().split(answered.text) == Split(None, answered.text)
