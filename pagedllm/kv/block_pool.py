"""The pool of physical KV blocks: reference counts and a free queue. No tensors here."""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids. A block is free when its reference count is 0.

    The free queue is ordered oldest-freed first, so reuse follows least-recently-used order
    (what prefix caching needs later), and an `OrderedDict` gives O(1) removal from its middle.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the back of the free queue.

        A sequence's blocks are released tail first so that, among blocks freed together,
        the tail of a chain is reused before its head.
        """
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed while not referenced")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def is_free(self, block: int) -> bool:
        return block in self._free
