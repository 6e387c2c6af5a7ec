"""Embeddings and retrieval on the embedded default model: the chat model pools its last token's hidden state (the
way decoder embedders such as Qwen3-Embedding do), so one engine both answers and embeds (task generate,embed)."""

import torch

from pagedllm import LLM, SamplingParams

documents = [
    "Paris is the capital and largest city of France.",
    "The Pacific is the largest and deepest of the Earth's oceans.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]
question = "What is the capital of France?"
llm = LLM(task="generate,embed")
vectors = torch.stack([output.outputs.data for output in llm.embed(documents + [question], use_tqdm=False)])
scores = vectors[:-1] @ vectors[-1]  # unit vectors: the dot product is the cosine similarity
best = int(scores.argmax())
print("scores:", [round(float(score), 3) for score in scores])
print("retrieved:", documents[best])
prompt = llm.render_chat([{"role": "user", "content": f"Context: {documents[best]}\nQuestion: {question}"}])
answer = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
print("answer:", answer.outputs[0].text)
