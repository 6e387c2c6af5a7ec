"""Per-request settings of a pooling request (an embedding or a score), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

# What an engine runs (`EngineConfig.task`): "auto" reads it from the checkpoint (`pooling.resolve_task`); a causal
# LM may also generate and pool in the same engine, sharing its steps.
TASKS = ("auto", "generate", "embed", "score", "generate,embed", "generate,score")


@dataclass
class PoolingParams:
    """A prompt's vector rather than its continuation: its embedding on an `embed` engine, its relevance score
    on a `score` one. ``dimensions`` keeps the embedding's first entries (Matryoshka models only), normalized
    after the cut when the model normalizes; ``normalize`` overrides the model's own choice (None: the model's);
    ``truncate_prompt_tokens`` keeps a prompt's last tokens (-1: as many as the model takes) instead of refusing
    one that is too long."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        limit = self.truncate_prompt_tokens
        if limit is not None and (not _is_int(limit) or (limit < 1 and limit != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {limit!r}")

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: `max_model_len` of them); all, without it."""
        limit = self.truncation_length(max_model_len)
        return token_ids if limit is None else token_ids[-limit:]

    def truncation_length(self, max_model_len: int) -> int | None:
        """How many tokens a prompt is cut to (None: it is not cut)."""
        limit = self.truncate_prompt_tokens
        if limit is None:
            return None
        return max_model_len if limit == -1 else min(limit, max_model_len)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
