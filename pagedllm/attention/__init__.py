"""Paged attention: write K/V into cache slots and attend through block tables."""

from pagedllm.attention.ops import AttentionPlan, paged_attention, plan_attention, run_planned, write_kv

__all__ = ["AttentionPlan", "paged_attention", "plan_attention", "run_planned", "write_kv"]
