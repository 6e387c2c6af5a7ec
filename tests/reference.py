"""Greedy reference outputs from `transformers` itself, and the near-tie rule for comparing engines."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pagedllm.outputs import RequestOutput


@dataclass(slots=True)
class Reference:
    token_ids: list[int]
    top5: list[set[int]]  # the reference's five most likely tokens at each generated position


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
        tokens = out.sequences[0, len(prompt) :].tolist()
        top5 = [set(step[0].topk(5).indices.tolist()) for step in out.logits]
        refs.append(Reference(tokens, top5))
    return refs


@dataclass(slots=True)
class Comparison:
    exact: int
    near_ties: int
    failures: list[str]


def compare_greedy(outputs: list[RequestOutput], refs: list[Reference]) -> Comparison:
    """Exact match, or the first divergence is a near-tie: each engine's token is in the other's top 5.
    The engine's outputs must carry logprobs=5."""
    exact, near, failures = 0, 0, []
    for i, (output, ref) in enumerate(zip(outputs, refs, strict=True)):
        ours = output.outputs[0].token_ids
        if ours == ref.token_ids:
            exact += 1
            continue
        shorter = min(len(ours), len(ref.token_ids))
        at = next((j for j in range(shorter) if ours[j] != ref.token_ids[j]), shorter)
        if at == shorter:
            failures.append(f"prompt {i}: lengths differ ({len(ours)} vs {len(ref.token_ids)})")
            continue
        our_top = set(output.outputs[0].logprobs[at])
        if ref.token_ids[at] in our_top and ours[at] in ref.top5[at]:
            near += 1
        else:
            failures.append(f"prompt {i}: token {at} is {ours[at]} vs reference {ref.token_ids[at]}")
    return Comparison(exact, near, failures)
