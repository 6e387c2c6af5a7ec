"""Which LoRA adapters the model holds: `max_loras` resident in its slots (what a step may use), and
`max_cpu_loras` loaded in CPU memory (read from disk once), each least recently used out first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import torch

from pagedllm.lora_request import LoRARequest
from pagedllm.models.decoder import CausalLM
from pagedllm.models.lora import Adapter, LoRASlots, load_adapter


class LoRAManager:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype):
        self.slots = LoRASlots(model, max_loras, max_rank, dtype)
        self.config = model.config
        self.max_cpu_loras = max_cpu_loras
        self._loaded: OrderedDict[int, tuple[LoRARequest, Adapter]] = OrderedDict()  # by lora_int_id, LRU first
        self._resident: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self._free = list(range(max_loras))
        self.num_disk_loads = 0
        self.num_slot_writes = 0

    def load(self, request: LoRARequest) -> Adapter:
        """The adapter in CPU memory, read (and checked against the model) on its first use. ValueError naming
        what is wrong with its folder, or when its id already names another adapter."""
        entry = self._loaded.get(request.lora_int_id)
        if entry is not None:
            known, adapter = entry
            if known != request:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} ({known.lora_path}); "
                    f"remove it before reusing the id"
                )
            self._loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request.lora_path, self.config, self.slots.dense_mlp, self.slots.max_rank)
        self.num_disk_loads += 1
        self._loaded[request.lora_int_id] = (request, adapter)
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)  # a resident adapter keeps its slot's copy
        return adapter

    def activate(self, requests: Collection[LoRARequest]) -> dict[int, int]:
        """The slot of each of a step's adapters (at most max_loras: the scheduler's rule), writing those not
        resident over the least recently used of the adapters this step does not run."""
        by_id = {request.lora_int_id: request for request in requests}
        wanted = set(by_id)
        if len(wanted) > self.slots.max_loras:
            raise RuntimeError(f"a step runs {len(wanted)} LoRA adapters, above max_loras ({self.slots.max_loras})")
        for lora_id in wanted & self._resident.keys():
            self._resident.move_to_end(lora_id)
        for request in by_id.values():
            if request.lora_int_id in self._resident:
                continue
            slot = self._free.pop() if self._free else self._evict(wanted)
            self.slots.write(slot, self.load(request))
            self.num_slot_writes += 1
            self._resident[request.lora_int_id] = slot
        return {lora_id: self._resident[lora_id] for lora_id in wanted}

    def _evict(self, keep: set[int]) -> int:
        victim = next(lora_id for lora_id in self._resident if lora_id not in keep)
        return self._resident.pop(victim)

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter (its slot becomes free); False if it was not loaded."""
        slot = self._resident.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)
        return self._loaded.pop(lora_int_id, None) is not None or slot is not None

    @property
    def num_resident(self) -> int:
        return len(self._resident)

    def known_ids(self) -> set[int]:
        """The adapters in CPU memory or in a slot."""
        return set(self._loaded) | set(self._resident)

    def loaded(self) -> list[LoRARequest]:
        """The adapters in CPU memory, least recently used first."""
        return [request for request, _ in self._loaded.values()]
