"""What a start imports: generating from the default model (its GGUF conversion already cached) must not import
what only some requests or commands use, nor transformers' model code, which the converted folder makes needless.
Each is a second or a fraction of one of every start (docs/PERFORMANCE.md, "Start-up to ready")."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedllm.models.loader import resolve_model_folder

# Imported only by a constrained request, a Ray backend, a plot, a benchmark's client (httpx brings rich); transformers'
# Llama classes only by a conversion, its auto classes only by a folder that is not a conversion.
NOT_AT_START = (
    "xgrammar",
    "httpx",
    "ray",
    "matplotlib",
    "transformers.models.llama.modeling_llama",
    "transformers.models.llama.configuration_llama",
    "transformers.models.auto.tokenization_auto",
)

CHILD = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(num_kv_blocks=16)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
assert out[0].outputs[0].token_ids
from pagedllm.models.loader import load_tokenizer
load_tokenizer(str(llm.engine.loaded.folder))  # as the server's process reads it, by the folder's name
print(json.dumps(sorted(sys.modules)))
"""


def test_a_start_imports_only_what_generation_needs() -> None:
    resolve_model_folder(None, lean=True)  # the conversion is made once, here: it needs transformers' classes
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    loaded = set(json.loads(child.stdout.splitlines()[-1]))
    assert "transformers" in loaded  # the tokenizer is transformers'
    assert not [name for name in NOT_AT_START if name in loaded]


def test_the_collector_is_paused_for_the_imports_only() -> None:
    """A library caller's collector is as the caller left it once pagedllm is imported and an engine built."""
    child = (
        "import gc, sys\n"
        "if sys.argv[1] == 'off': gc.disable()\n"
        "from pagedllm import LLM\n"
        "after_import = gc.isenabled()\n"
        "LLM(num_kv_blocks=16)\n"
        "print(after_import, gc.isenabled(), gc.get_freeze_count())\n"
    )
    for state, expected in (("on", "True True 0"), ("off", "False False 0")):
        run = subprocess.run([sys.executable, "-c", child, state], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split("\n")[-2] == expected
