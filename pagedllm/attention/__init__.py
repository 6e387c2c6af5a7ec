"""Paged attention: write K/V into cache slots and attend through block tables."""

from pagedllm.attention.dispatch import get_backend, paged_attention, write_kv
from pagedllm.attention.metadata import AttentionMetadata, Backend

__all__ = ["AttentionMetadata", "Backend", "get_backend", "paged_attention", "write_kv"]
