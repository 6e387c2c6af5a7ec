"""`LoRARequest`: which LoRA adapter a request runs under, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) known by a name and a
    positive integer id; requests with the same id share its loaded weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        try:
            path = Path(self.lora_path).expanduser()
        except RuntimeError as error:  # "~name" of no such user
            raise ValueError(f"lora_path {self.lora_path!r} cannot be expanded: {error}") from error
        object.__setattr__(self, "lora_path", str(path))

    @property
    def cache_key(self) -> str:
        """What the prefix cache's hash takes from the adapter: its K/V differ from the base model's and from any
        other adapter's for the same tokens."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
