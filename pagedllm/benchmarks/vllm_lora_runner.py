"""Times `scripts/bench_lora.py`'s load on vLLM's multi-LoRA, inside vLLM's own interpreter.

    VLLM_PYTHON pagedllm/benchmarks/vllm_lora_runner.py JOB.json RESULT.json

Like `vllm_runner.py` it imports nothing from pagedllm: the job holds the model folder, the adapters' folders
and the prompts as token ids. The same greedy load runs alternately on the base model and spread round-robin
over the adapters, each warmed once over the whole load first, as pagedllm's side is.
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
    from vllm.lora.request import LoRARequest

    adapters = job["adapters"]
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=job["rank"],
        max_cpu_loras=len(adapters),
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    spread = [requests[i % len(requests)] for i in range(len(prompts))]

    def rate(loras: list | None) -> float:
        llm.reset_prefix_cache()  # every run prefills its prompts, as pagedllm's side does
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

    rate(spread)
    rate(None)
    rounds = [{"base": rate(None), "adapters": rate(spread)} for _ in range(job["rounds"])]
    with open(result_path, "w") as f:
        json.dump({"rounds": rounds}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
