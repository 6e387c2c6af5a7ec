"""Times `bench speculative`'s tasks on vLLM, inside vLLM's own interpreter, with or without its speculation.

    VLLM_PYTHON pagedllm/benchmarks/vllm_speculative_runner.py JOB.json RESULT.json

Like `vllm_runner.py` it imports nothing from pagedllm: the job holds the prompts as token ids (rendered by
pagedllm's chat template, so both engines read the same tokens), and each task is timed as pagedllm's side is:
a one-token call (the prompt's step) apart from the whole answer, so TPOT is the decode steps only.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import torch

    torch.set_num_threads(job["threads"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        speculative_config=job["speculative_config"],
        enable_prefix_caching=True,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    first = SamplingParams(temperature=0.0, max_tokens=1)
    whole = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])

    def one_round(params: SamplingParams) -> dict:
        tpots, outputs = [], []
        for prompt in prompts:
            llm.generate([prompt], first, use_tqdm=False)
            start = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            tpots.append((time.perf_counter() - start - prefill) / max(len(tokens) - 1, 1) * 1e3)
            outputs.append(tokens)
        return {"tpot_ms": statistics.fmean(tpots), "outputs": outputs}

    one_round(SamplingParams(temperature=0.0, max_tokens=8))  # warm-up, as pagedllm's side
    rounds = [one_round(whole) for _ in range(job["rounds"])]
    with open(result_path, "w") as f:
        json.dump({"rounds": rounds, "metrics": _spec_metrics(llm)}, f)


def _spec_metrics(llm) -> dict[str, float]:
    """vLLM's own speculative-decoding counters, where this version exposes them."""
    try:
        metrics = llm.get_metrics()
    except Exception:
        return {}
    return {m.name: float(m.value) for m in metrics if "spec_decode" in m.name and hasattr(m, "value")}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
