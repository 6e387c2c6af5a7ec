"""N-gram speculative decoding: the same greedy output as without it, in fewer steps when the answer repeats the
prompt."""

from pagedllm import LLM, SamplingParams

prompt = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."}]
params = SamplingParams(temperature=0.0, max_tokens=48)
plain = LLM().chat(prompt, params, use_tqdm=False)[0].outputs[0].text
fast = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
speculated = fast.chat(prompt, params, use_tqdm=False)[0].outputs[0].text
assert speculated == plain, "speculation never changes a greedy answer"
print(speculated)
stats = fast.stats()
print(f"{stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} guessed tokens accepted")
