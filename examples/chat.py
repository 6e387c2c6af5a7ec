"""A conversation through the model's chat template, with a follow-up turn."""

from pagedllm import LLM, SamplingParams

llm = LLM()
params = SamplingParams(temperature=0.0, max_tokens=32)
history = [{"role": "user", "content": "What is the capital of France?"}]
answer = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
print("assistant:", answer)
history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
print("assistant:", llm.chat(history, params, use_tqdm=False)[0].outputs[0].text)
