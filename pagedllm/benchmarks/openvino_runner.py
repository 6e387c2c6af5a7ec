"""Runs one `bench throughput` workload on OpenVINO GenAI, inside OpenVINO's own interpreter.

    OPENVINO_PYTHON pagedllm/benchmarks/openvino_runner.py JOB.json RESULT.json

OpenVINO GenAI lives in its own venv, so this file imports nothing from pagedllm: the harness exports the
model once (`optimum-cli export openvino`, cached) and writes the workload as JSON; this script loads the
exported model in a `ContinuousBatchingPipeline` (OpenVINO's paged-attention serving path) and answers with the
load time and the generation time as JSON.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    start = time.perf_counter()
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = job["kv_cache_gb"]
    scheduler.max_num_seqs = job["max_num_seqs"]
    scheduler.max_num_batched_tokens = job["max_num_batched_tokens"]
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = job["enable_prefix_caching"]
    # The KV cache in the compute precision, as pagedllm's, unless the job asks for OpenVINO's u8 one (its CPU
    # default, which pagedllm's int8 cache is compared with).
    precision = job["precision"]
    properties = {
        "INFERENCE_NUM_THREADS": job["threads"],
        "INFERENCE_PRECISION_HINT": precision,
        "KV_CACHE_PRECISION": job["kv_cache_precision"] or precision,
    }
    pipe = genai.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)
    warm = genai.GenerationConfig()
    warm.max_new_tokens = 2
    pipe.generate([ov.Tensor(np.array([job["requests"][0][0][:8]], dtype=np.int64))], [warm])
    load_seconds = time.perf_counter() - start
    prompts, configs = [], []
    for prompt, output_len in job["requests"]:
        prompts.append(ov.Tensor(np.array([prompt], dtype=np.int64)))
        config = genai.GenerationConfig()
        # EOS is generated as any token and does not stop, as with the other engines' ignore_eos (OpenVINO's
        # min_new_tokens would ban it instead, and pick another token where the model puts EOS first).
        config.max_new_tokens = output_len
        config.ignore_eos = True
        config.do_sample = False
        configs.append(config)
    start = time.perf_counter()
    results = pipe.generate(prompts, configs)
    seconds = time.perf_counter() - start
    outputs = [list(result.m_generation_ids[0]) for result in results]
    answer = {
        "load_seconds": load_seconds,
        "seconds": seconds,
        "generated_tokens": sum(len(output) for output in outputs),
        "sample": outputs[: job["check"]],
    }
    with open(result_path, "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
