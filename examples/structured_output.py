"""Output held to a JSON schema (xgrammar), offline: every sample parses and fits the schema."""

import json

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
llm = LLM()
params = SamplingParams(
    n=3, temperature=1.0, seed=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema)
)
question = [{"role": "user", "content": "The largest city of Japan and its population, as JSON."}]
for sample in llm.chat(question, params, use_tqdm=False)[0].outputs:
    print(json.loads(sample.text))
