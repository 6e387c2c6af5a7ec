"""Paged attention: write K/V into cache slots and attend through block tables."""

from pagedllm.attention.dispatch import get_backend, paged_attention, write_kv
from pagedllm.attention.metadata import AttentionCall, AttentionMetadata, Backend

__all__ = ["AttentionCall", "AttentionMetadata", "Backend", "get_backend", "paged_attention", "write_kv"]
