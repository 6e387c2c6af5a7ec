"""Greedy reference outputs from `transformers` itself, judged by the near-tie rule of
`pagedllm.benchmarks.near_tie` (re-exported here for the tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pagedllm.benchmarks.near_tie import NEAR_TIE, Comparison, compare_sequences, float32_logprobs
from pagedllm.outputs import RequestOutput

__all__ = [
    "NEAR_TIE",
    "Comparison",
    "Reference",
    "compare_greedy",
    "compare_sequences",
    "float32_logprobs",
    "reference_greedy",
]


@dataclass(slots=True)
class Reference:
    token_ids: list[int]
    logprobs: torch.Tensor  # [len(token_ids), vocab]: the float32 log-probabilities each token was picked from


def reference_greedy(
    folder: Path | str, prompts: list[list[int]], max_new_tokens: int, **load_kwargs
) -> list[Reference]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **load_kwargs).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    refs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        logprobs = torch.stack([step[0] for step in out.logits]).float().log_softmax(-1)
        refs.append(Reference(out.sequences[0, len(prompt) :].tolist(), logprobs))
    return refs


def compare_greedy(outputs: list[RequestOutput], refs: list[Reference]) -> Comparison:
    """The engine's greedy outputs against `reference_greedy`'s, whose log-probabilities judge divergences."""
    pairs = [(output.outputs[0].token_ids, ref.token_ids) for output, ref in zip(outputs, refs, strict=True)]
    return compare_sequences(pairs, lambda i, at: refs[i].logprobs[at])
