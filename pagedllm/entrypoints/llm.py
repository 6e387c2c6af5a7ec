"""`LLM`: the offline entry point, with vLLM's names so users feel at home."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine, PromptInput
from pagedllm.entrypoints.scoring import cosine_output, pair_prompt, score_pairs, with_instruction
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EngineStats, KVSnapshot, PoolingRequestOutput, RequestOutput
from pagedllm.pooling import EMBED
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        """`options` are `EngineConfig`'s fields (dtype, block_size, num_kv_blocks, ...)."""
        config = EngineConfig(model=model, **options)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def kv_snapshot(self) -> KVSnapshot:
        """The KV cache as it is now: every block's reference count, the cached blocks, every live sequence's
        block table (`KVSnapshot`; `.as_dict()` is what the server's `GET /kv/snapshot` returns)."""
        return self.engine.kv_snapshot()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (refused while requests hold blocks)."""
        self.engine.reset_prefix_cache()

    def beam_search(
        self,
        prompts: PromptInput | Seq[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search per prompt; each result's outputs are its beams, best score first."""
        batch = _as_prompt_list(prompts)
        return self._run(self._add_all(batch, [params] * len(batch), _per_prompt(lora_request, len(batch))), use_tqdm)

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in continuous batches; results come back in input order. With
        `lora_request` (one for all prompts, or one per prompt, None for the base model) prompts run under
        LoRA adapters (`enable_lora=True`), all in the same batches."""
        batch = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        return self._run(self._add_all(batch, params, _per_prompt(lora_request, len(batch))), use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Seq[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        prompt_name: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`output.outputs.embedding`), on an engine whose task is embed; text prompts
        get the model's instruction prefix `prompt_name` (or its default one), as sentence-transformers does."""
        batch = _as_prompt_list(prompts)
        if self.engine.pooler is not None:
            batch = [with_instruction(self.engine.pooler, p, prompt_name) if isinstance(p, str) else p for p in batch]
        params = [pooling_params or PoolingParams()] * len(batch)
        return self._run(self._add_all(batch, params, _per_prompt(lora_request, len(batch))), use_tqdm)

    def score(
        self,
        queries: str | Seq[str],
        documents: str | Seq[str],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each (query, document) pair's score (`output.outputs.score`), one query against every document or
        pair by pair: a score engine's cross-encoder on the pair, or an embed engine's cosine similarity."""
        pairs = score_pairs(queries, documents)
        params = pooling_params or PoolingParams()
        if self.engine.pooler is not None and self.engine.pooler.task == EMBED:
            firsts = self.embed([q for q, _ in pairs], params, use_tqdm)
            seconds = self.embed([d for _, d in pairs], params, use_tqdm)
            return [cosine_output(str(next(self._ids)), a, b) for a, b in zip(firsts, seconds, strict=True)]
        tokenizer, encoder = self.engine.tokenizer, self.engine.pooler is not None and self.engine.pooler.bidirectional
        limit = params.truncation_length(self.engine.max_model_len)
        prompts: list[PromptInput] = [pair_prompt(tokenizer, q, d, encoder, limit) for q, d in pairs]
        return self._run(self._add_all(prompts, [params] * len(prompts), [None] * len(prompts)), use_tqdm)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, each rendered by the model's chat template (or `chat_template`),
        which also gets `chat_template_kwargs` (Qwen3's `enable_thinking`, say)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.render_chat(
                c, add_generation_prompt, chat_template=chat_template, template_kwargs=chat_template_kwargs
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> dict:
        return render_chat(
            self.engine.tokenizer, conversation, add_generation_prompt, tools, chat_template, template_kwargs
        )

    def _add_all(
        self,
        prompts: list[PromptInput],
        params: Seq[SamplingParams | BeamSearchParams | PoolingParams],
        loras: list[LoRARequest | None],
    ) -> list[str]:
        request_ids = [str(next(self._ids)) for _ in prompts]
        self.engine.add_requests(list(zip(request_ids, prompts, params, loras, strict=True)))
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> dict:
    """The conversation through the chat template (the tokenizer's, or `chat_template`); `tools` (OpenAI's
    function definitions) go to templates that show them to the model, and messages may carry `tool_calls` and
    tool results as transformers expects them; `template_kwargs` are the template's own variables."""
    if not (chat_template or tokenizer.chat_template):
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **(template_kwargs or {}),
    )
    # The template already holds any BOS it wants; tokenizing must not add a second.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _as_prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _per_prompt(lora_request: LoRARequest | Seq[LoRARequest | None] | None, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_request for {count} prompts")
    return loras


def _params_per_prompt(
    sampling_params: SamplingParams | Seq[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
