"""`python tests/fault_server.py MARKER <pagedllm serve arguments>`: `pagedllm serve` whose engine decodes
through a tokenizer that raises on text containing MARKER, as a detokenizer bug would for one request's
tokens. It lets tests show that a failure inside `LLMEngine.step` fails only the request it belongs to.

The engine runs in the server's engine-core process, forked from this one: it inherits the patched class."""

from __future__ import annotations

import sys
from functools import wraps

from pagedllm.cli import main
from pagedllm.entrypoints.llm import LLM


class FaultyTokenizer:
    def __init__(self, tokenizer: object, marker: str) -> None:
        self._tokenizer = tokenizer
        self._marker = marker

    def decode(self, *args: object, **kwargs: object) -> str:
        text = self._tokenizer.decode(*args, **kwargs)
        if self._marker in text:
            raise RuntimeError(f"injected fault: decoded text contains {self._marker!r}")
        return text

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)


def inject_faults(marker: str) -> None:
    """Every LLM built from now on detokenizes through a FaultyTokenizer."""
    build = LLM.__init__

    @wraps(build)
    def build_faulty(llm: LLM, *args: object, **kwargs: object) -> None:
        build(llm, *args, **kwargs)
        # The tokenizer that detokenizes: the output processor's where the engine has one, else the engine's.
        target = getattr(llm.engine, "output_processor", llm.engine)
        target.tokenizer = FaultyTokenizer(target.tokenizer, marker)

    LLM.__init__ = build_faulty


if __name__ == "__main__":
    marker, *serve_args = sys.argv[1:]
    inject_faults(marker)
    sys.exit(main(["serve", *serve_args]))
