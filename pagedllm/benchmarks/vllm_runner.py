"""Runs one `bench throughput` workload on vLLM, inside vLLM's own interpreter.

    VLLM_PYTHON pagedllm/benchmarks/vllm_runner.py JOB.json RESULT.json

vLLM lives in its own venv (its CPU wheel pins its own torch and transformers), so this file
imports nothing from pagedllm: the harness writes the workload as JSON, and this script answers
with the load time and the generation time as JSON.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import torch

    torch.set_num_threads(job["threads"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        seed=job["seed"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=job["enable_prefix_caching"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
    )
    load_seconds = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in job["requests"]]
    start = time.perf_counter()
    if job["beam_width"] > 1:
        max_tokens = {out for _, out in job["requests"]}
        if len(max_tokens) != 1:
            raise ValueError("vLLM's beam search takes one max_tokens for all prompts")
        params = BeamSearchParams(beam_width=job["beam_width"], max_tokens=max_tokens.pop(), ignore_eos=True)
        outputs = llm.beam_search(prompts, params)
        generated = sum(
            len(o.sequences[0].tokens) - len(p["prompt_token_ids"]) for o, p in zip(outputs, prompts, strict=True)
        )
        sample = [
            o.sequences[0].tokens[len(p["prompt_token_ids"]) :]
            for o, p in zip(outputs[: job["check"]], prompts, strict=False)
        ]
    else:
        params = [
            SamplingParams(
                n=job["n"],
                temperature=job["temperature"],
                max_tokens=out,
                ignore_eos=True,
                seed=job["seed"] + i,
            )
            for i, (_, out) in enumerate(job["requests"])
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        sample = [list(o.outputs[0].token_ids) for o in outputs[: job["check"]]]
    seconds = time.perf_counter() - start
    with open(result_path, "w") as f:
        json.dump(
            {"load_seconds": load_seconds, "seconds": seconds, "generated_tokens": generated, "sample": sample}, f
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
