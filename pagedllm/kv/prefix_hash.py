"""Chained block hashes for automatic prefix caching: sha256(parent hash, block tokens, extra keys)."""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = b"pagedllm-prefix-v1"


def hash_block(parent: bytes, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
    """A full block's identity: its tokens, everything before them (the parent's hash), and
    anything else that changes its K/V (the cache salt, on the first block only)."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(struct.pack("<q", len(extra_keys)))
    digest.update(extra_keys)
    return digest.digest()


def hash_blocks(
    token_ids: list[int], block_size: int, salt: str | None, start: int, stop: int, parent: bytes
) -> list[bytes]:
    """Hashes of full blocks `start .. stop-1` of a token sequence, chained from `parent`."""
    hashes = []
    for index in range(start, stop):
        extra = salt.encode() if index == 0 and salt else b""
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
