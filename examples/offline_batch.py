"""Offline batch generation: many prompts through one engine, greedy, on the embedded default model."""

from pagedllm import LLM, SamplingParams

prompts = ["The capital of France is", "Water boils at", "The largest planet in the solar system is"]
llm = LLM()
for output in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False):
    print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
stats = llm.stats()
print(f"KV blocks: {stats.kv_blocks_peak} at the peak of {stats.kv_blocks_total}, {stats.num_steps} steps")
