"""KV events in vLLM's vocabulary (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), for tools outside the
engine that mirror the prefix cache (routers, dashboards). The pool emits them only while a sink is set, so
an engine nobody listens to pays nothing.

Hashes are the chained sha256 block hashes of `prefix_hash.py`, written as hex strings; a chain's first block
has no parent (`parent_block_hash` is null), as in vLLM.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one chain became findable by the prefix cache."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the block before the first of them; None at a chain's start
    token_ids: list[int]  # every token of the blocks, in order
    block_size: int
    lora_id: int | None = None  # the LoRA adapter whose K/V they hold (vLLM's field); None: the base model

    def as_dict(self) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": [block_hash.hex() for block_hash in self.block_hashes],
            "parent_block_hash": self.parent_block_hash.hex() if self.parent_block_hash else None,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": self.lora_id,
        }


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (handed out again); their hashes no longer find anything."""

    block_hashes: list[bytes]

    def as_dict(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": [block_hash.hex() for block_hash in self.block_hashes]}


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash finds anything."""

    def as_dict(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVEvent], None]


class KVEventFile:
    """A sink writing one JSON object per line (`{"ts": unix seconds, "type": ..., ...}`) to a file, line
    buffered so that a tool tailing the file sees each event as it happens."""

    def __init__(self, path: str | Path) -> None:
        # Open for the engine's lifetime; every line is flushed as written, so nothing is lost at exit.
        self._file: IO[str] = Path(path).open("a", buffering=1)  # noqa: SIM115

    def __call__(self, event: KVEvent) -> None:
        self._file.write(json.dumps({"ts": time.time(), **event.as_dict()}) + "\n")

    def close(self) -> None:
        self._file.close()
