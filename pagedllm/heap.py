"""Python's cycle collector around start-up. Importing torch and transformers and loading a model make about a
million objects that live as long as the process; every collection their allocations trigger walks all of them
again, and so does the interpreter's last one at exit: a third of a second of each, on the default model.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """No cycle collection inside the block (imports, a model's load); afterwards the collector is as it was, and
    what became garbage meanwhile is collected in the normal course."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def freeze_long_lived() -> None:
    """For a process pagedllm owns (a command, the server's processes), once its engine is built: what exists then
    lives until the process ends, so no later collection walks it, the one at exit included (`gc.freeze`). A
    library caller's process is the caller's to tune: `LLM` does not call this."""
    gc.freeze()
