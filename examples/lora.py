"""LoRA: a PEFT adapter for the default model, served beside the base model in the same batch.

A real adapter comes from training (`peft`'s `save_pretrained` writes the folder this reads); this one is made here
with random weights on q_proj and v_proj, so that the script runs anywhere in seconds and its answers visibly
differ from the base model's."""

import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.models.loader import resolve_model_folder

# The default model's config (its GGUF file converted once, without the weights): an adapter needs only the shapes.
config = AutoConfig.from_pretrained(resolve_model_folder(None, lean=True))
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(config)  # random weights: only the adapter is saved
adapter = Path(tempfile.mkdtemp()) / "random-adapter"
lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
get_peft_model(base, lora).save_pretrained(adapter)

llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8)
question = llm.render_chat([{"role": "user", "content": "What is the capital of France?"}])
params = SamplingParams(temperature=0.0, max_tokens=16)
# One call, two requests in the same steps: the base model, and the adapter (a name, an id, its folder).
outputs = llm.generate(
    [question, question], params, lora_request=[None, LoRARequest("random", 1, str(adapter))], use_tqdm=False
)
print("base model:", outputs[0].outputs[0].text)
print("adapter:   ", outputs[1].outputs[0].text)
print("the adapter changed the answer:", outputs[0].outputs[0].text != outputs[1].outputs[0].text)
