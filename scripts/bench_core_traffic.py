"""What the engine core sends the server per decode step, at two context lengths.

    python scripts/bench_core_traffic.py [--model PATH] [--batch 16] [--contexts 256 4096] [--max-tokens 32]

For each context length, `--batch` requests of that many prompt tokens decode `--max-tokens` tokens each
(greedy, ignore_eos). Each step's message for the requests that gained a token is pickled as the core sends it
(`StepDeltas`: each request's new token ids) beside what a core that sent whole cumulative outputs would send
(the same requests' `RequestOutput`s, as the server's output processor builds them from the deltas), per request,
and the processing the core no longer does (detokenization, stop strings, outputs) is timed per request.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.entrypoints.openai.engine_core import StepDeltas


def measure(engine: LLMEngine, context: int, batch: int, max_tokens: int) -> dict[str, float]:
    rng = random.Random(context)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, engine.vocab_size - 100) for _ in range(context)]
        engine.add_request(f"{context}-{i}", prompt, params)
    delta_bytes, output_bytes, process_s = [], [], []
    assert engine.output_processor is not None
    while engine.has_unfinished_requests():
        step = engine.step_core()
        started = time.perf_counter()
        processed = engine.output_processor.process(step.deltas)
        elapsed = time.perf_counter() - started
        engine.stop_sequences(processed.stops)
        # The requests that gained one token and go on (chunked prefill overlaps the long prompts' decodes, so
        # a step rarely holds the whole batch): bytes per request per step, both ways.
        decoding = {d.request_id for d in step.deltas if not d.finished and len(d.seqs) == 1}
        if not decoding:
            continue
        deltas = [d for d in step.deltas if d.request_id in decoding]
        outputs = [o for o in processed.outputs if o.request_id in decoding]
        delta_bytes.append(len(pickle.dumps(StepDeltas(deltas, {}, 0.0))) / len(deltas))
        output_bytes.append(len(pickle.dumps((outputs, {}, 0.0))) / len(outputs))
        process_s.append(elapsed / len(step.deltas))
    return {
        "context": context,
        "decode_steps": len(delta_bytes),
        "delta_bytes_per_request_step": statistics.mean(delta_bytes),
        "whole_output_bytes_per_request_step": statistics.mean(output_bytes),
        "processing_us_per_request_step": 1e6 * statistics.mean(process_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or GGUF (default: the embedded model)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    longest = max(args.contexts) + args.max_tokens
    config = EngineConfig(model=args.model, max_model_len=longest, max_num_seqs=args.batch)
    engine = LLMEngine(config)
    print("context  steps  core sends B  whole outputs B  processing µs (now off the core), per request per step")
    for context in args.contexts:
        row = measure(engine, context, args.batch, args.max_tokens)
        print(
            f"{row['context']:7d}  {row['decode_steps']:5d}  {row['delta_bytes_per_request_step']:12.0f}  "
            f"{row['whole_output_bytes_per_request_step']:15.0f}  {row['processing_us_per_request_step']:12.1f}"
        )


if __name__ == "__main__":
    main()
