"""`python tests/fault_server.py MARKER <pagedllm serve arguments>`: `pagedllm serve` whose output processor
decodes through a tokenizer that raises on text containing MARKER, as a detokenizer bug would for one request's
tokens. It lets tests show that a failure processing one request's tokens fails only that request.

The output processor runs in the server's process (the engine core sends it token ids)."""

from __future__ import annotations

import sys
from functools import wraps

from pagedllm.cli import main
from pagedllm.output_processor import OutputProcessor


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
    """Every output processor built from now on detokenizes through a FaultyTokenizer."""
    build = OutputProcessor.__init__

    @wraps(build)
    def build_faulty(processor: OutputProcessor, tokenizer: object) -> None:
        build(processor, FaultyTokenizer(tokenizer, marker))

    OutputProcessor.__init__ = build_faulty


if __name__ == "__main__":
    marker, *serve_args = sys.argv[1:]
    inject_faults(marker)
    sys.exit(main(["serve", *serve_args]))
