"""LoRA adapters on the decoder's projections, many in one batch.

A PEFT folder (`adapter_config.json`, `adapter_model.safetensors`) is read into an `Adapter`: for each
(layer, projection, part) its down-projection A and its up-projection B, the scaling folded into B. The
model holds `max_loras` slots of every adaptable projection (`LoRASlots`: one `LoRAStack` per layer and
projection, every rank padded to `max_lora_rank`), allocated once; an adapter is resident when its pairs
are written into a slot. The base weights are never touched.

A step's tokens are grouped by slot (`LoRABatch`), and each projection adds to its base output, per set
of groups, one gather of the groups' rows, one batched product by their A (shrink) and one by each part's
B (expand), and one indexed add: the Punica / S-LoRA idea, whatever the mix of adapters and base-model
rows. Small groups (decode tokens) are padded into one set; a large group (a prompt chunk) is a set of its
own, so no small group is padded to its length.

Our projections fuse the checkpoint's: `qkv` is q, k, v side by side and `gate_up` is gate, up, so an
adapter of q_proj writes part 0 of `qkv`; a checkpoint that fuses them itself (Phi3's qkv_proj,
gate_up_proj) has one A for all parts and one B whose rows split into the parts."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from pagedllm.models.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A group of more rows than this (a prompt chunk) is multiplied on its own rather than padded with others.
ALONE_ROWS = 64

# The checkpoint's module in a layer -> our projection and the parts of it the module is.
TARGETS: dict[str, tuple[str, tuple[int, ...]]] = {
    "self_attn.q_proj": ("qkv", (0,)),
    "self_attn.k_proj": ("qkv", (1,)),
    "self_attn.v_proj": ("qkv", (2,)),
    "self_attn.qkv_proj": ("qkv", (0, 1, 2)),
    "self_attn.o_proj": ("o", (0,)),
    "mlp.gate_proj": ("gate_up", (0,)),
    "mlp.up_proj": ("gate_up", (1,)),
    "mlp.gate_up_proj": ("gate_up", (0, 1)),
    "mlp.down_proj": ("down", (0,)),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class Projection:
    """An adaptable projection of a layer: its input width and its parts' output widths."""

    in_features: int
    part_sizes: tuple[int, ...]


def projections(config: ModelConfig, layer: int, dense_mlp: bool) -> dict[str, Projection]:
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"qkv": Projection(hidden, (q_size, kv_size, kv_size)), "o": Projection(q_size, (hidden,))}
    if dense_mlp:
        shapes |= {"gate_up": Projection(hidden, (inter, inter)), "down": Projection(inter, (hidden,))}
    return shapes


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(folder: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's settings, checked: ValueError naming what pagedllm cannot serve."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(f"lora_path {str(folder)!r} has no {ADAPTER_CONFIG}")
    if not (Path(folder) / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"lora_path {str(folder)!r} has no {ADAPTER_WEIGHTS}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not readable JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type must be LORA, got {raw['peft_type']!r}")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{path}: the adapter's rank r={rank} is above max_lora_rank ({max_rank})")
    refused = {
        "use_dora": bool(raw.get("use_dora")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "modules_to_save": bool(raw.get("modules_to_save")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "bias": raw.get("bias", "none") != "none",
    }
    for name, set_ in refused.items():
        if set_:
            raise ValueError(f"{path}: {name}={raw[name]!r} is not supported")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)))


@dataclass(slots=True)
class Adapter:
    """An adapter as loaded, in float32: (layer, projection, part) -> (A `[in, r]`, scaling * B `[r, out]`)."""

    config: AdapterConfig
    pairs: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def load_adapter(folder: str | Path, config: ModelConfig, dense_mlp: list[bool], max_rank: int) -> Adapter:
    """Read and check a PEFT folder against the model: every weight must be the A or B of an adaptable
    projection of one of its layers, of the right shape. ValueError naming the first that is not."""
    settings = read_adapter_config(folder, max_rank)
    tensors = _read_weights(Path(folder) / ADAPTER_WEIGHTS)
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise ValueError(
                f"adapter weight {key!r} is not a LoRA pair of an adaptable projection (q/k/v/o/gate/up/down)"
            )
        layer = int(match.group(1))
        if layer >= config.num_hidden_layers:
            raise ValueError(f"adapter weight {key!r}: the model has {config.num_hidden_layers} layers")
        modules.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    pairs: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), found in modules.items():
        name = f"layer {layer} {module}"
        if set(found) != {"A", "B"}:
            raise ValueError(f"adapter's {name} has lora_{''.join(found)} without its pair")
        projection, parts = TARGETS[module]
        shapes = projections(config, layer, dense_mlp[layer])
        if projection not in shapes:
            raise ValueError(f"adapter's {name}: layer {layer} is a mixture of experts, whose MLP takes no adapter")
        shape = shapes[projection]
        widths = [shape.part_sizes[part] for part in parts]
        a, b = found["A"].float(), found["B"].float()
        if a.shape != (settings.rank, shape.in_features) or b.shape != (sum(widths), settings.rank):
            raise ValueError(
                f"adapter's {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                f"({settings.rank}, {shape.in_features}) and ({sum(widths)}, {settings.rank})"
            )
        scaled = (b * settings.scaling).T.contiguous()
        for part, piece in zip(parts, scaled.split(widths, dim=1), strict=True):
            pairs[(layer, projection, part)] = (a.T.contiguous(), piece.contiguous())
    return Adapter(settings, pairs)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
    except Exception as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error


@dataclass(slots=True)
class RowSet:
    """Groups of the step's rows multiplied together: group g is slot `slots[g]`'s rows `gather[g]`, padded
    (with its first row) to the longest; `picks` selects the real entries of the flattened product (None:
    all are), which `targets` says the rows of."""

    slots: torch.Tensor  # [G]
    first_slot: int | None  # the slots are first_slot .. first_slot + G - 1: a view of the stacks, no copy
    gather: torch.Tensor  # [G * N]
    picks: torch.Tensor | None
    targets: torch.Tensor

    @property
    def num_groups(self) -> int:
        return len(self.slots)

    def to(self, device: torch.device) -> RowSet:
        picks = None if self.picks is None else self.picks.to(device)
        return RowSet(self.slots.to(device), self.first_slot, self.gather.to(device), picks, self.targets.to(device))

    def take(self, stack: torch.Tensor) -> torch.Tensor:
        """This set's slots of a stacked tensor `[max_loras, ...]`."""
        if self.first_slot is not None:
            return stack[self.first_slot : self.first_slot + self.num_groups]
        return stack.index_select(0, self.slots)


@dataclass(slots=True)
class LoRABatch:
    """A step's rows that run under an adapter, by slot; the other rows are the base model's alone."""

    sets: list[RowSet]

    @staticmethod
    def build(slot_of_seq: list[int], query_lens: list[int]) -> LoRABatch | None:
        """`slot_of_seq[i]` is scheduled sequence i's slot (-1: the base model), `query_lens[i]` its rows."""
        starts = np.concatenate(([0], np.cumsum(query_lens)))
        rows: dict[int, list[np.ndarray]] = {}
        for i, slot in enumerate(slot_of_seq):
            if slot >= 0:
                rows.setdefault(slot, []).append(np.arange(starts[i], starts[i + 1]))
        if not rows:
            return None
        groups = sorted((slot, np.concatenate(parts)) for slot, parts in rows.items())
        alone = [[group] for group in groups if len(group[1]) > ALONE_ROWS]
        padded = [group for group in groups if len(group[1]) <= ALONE_ROWS]
        return LoRABatch([_row_set(part) for part in alone + ([padded] if padded else [])])

    def to(self, device: torch.device) -> LoRABatch:
        if device.type == "cpu":
            return self
        return LoRABatch([rows.to(device) for rows in self.sets])


def _row_set(groups: list[tuple[int, np.ndarray]]) -> RowSet:
    width = max(len(rows) for _, rows in groups)
    gather = np.stack([np.pad(rows, (0, width - len(rows)), mode="edge") for _, rows in groups])
    valid = np.stack([np.arange(width) < len(rows) for _, rows in groups]).reshape(-1)
    slots = [slot for slot, _ in groups]
    contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
    return RowSet(
        slots=torch.tensor(slots),
        first_slot=slots[0] if contiguous else None,
        gather=torch.from_numpy(gather.reshape(-1)),
        picks=None if valid.all() else torch.from_numpy(np.flatnonzero(valid)),
        targets=torch.from_numpy(gather.reshape(-1)[valid]),
    )


class LoRAStack:
    """One projection's slots: the parts' A side by side (`a`: `[max_loras, in, parts * R]`) and each
    part's B (`b[i]`: `[max_loras, R, out_i]`); a rank below R and a part the adapter leaves alone are zeros."""

    def __init__(self, shape: Projection, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.rank = max_rank
        parts = len(shape.part_sizes)
        self.a = torch.zeros(max_loras, shape.in_features, parts * max_rank, dtype=dtype, device=device)
        self.b = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for size in shape.part_sizes]

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].nbytes for t in (self.a, *self.b))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        rank = a.shape[1]
        self.a[slot, :, part * self.rank : part * self.rank + rank] = a
        self.b[part][slot, :rank] = b

    def add(self, out: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """`out += B(A x)` for each row of `batch`, with its own slot's pair."""
        for rows in batch.sets:
            shrunk = torch.bmm(x.index_select(0, rows.gather).view(rows.num_groups, -1, x.shape[1]), rows.take(self.a))
            parts = [
                torch.bmm(shrunk[..., i * self.rank : (i + 1) * self.rank], rows.take(b)) for i, b in enumerate(self.b)
            ]
            delta = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).view(-1, out.shape[1])
            out.index_add_(0, rows.targets, delta if rows.picks is None else delta.index_select(0, rows.picks))


def add_lora(out: torch.Tensor, x: torch.Tensor, stack: LoRAStack | None, batch: LoRABatch | None) -> None:
    """A projection's adapters, where the model has slots for it and the step has rows under an adapter."""
    if stack is not None and batch is not None:
        stack.add(out, x, batch)


class LoRASlots:
    """Every adaptable projection's `LoRAStack`, attached to the model's modules (`lora_qkv`, `lora_o` on
    attention, `lora_gate_up`, `lora_down` on a dense MLP)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dense_mlp: list[bool] = model.dense_mlp
        device = model.embed_tokens.weight.device
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for index, layer in enumerate(model.layers):
            for name, shape in projections(model.config, index, self.dense_mlp[index]).items():
                stack = LoRAStack(shape, max_loras, max_rank, dtype, device)
                self.stacks[(index, name)] = stack
                owner = layer.self_attn if name in ("qkv", "o") else layer.mlp
                setattr(owner, f"lora_{name}", stack)

    @property
    def bytes_per_slot(self) -> int:
        return sum(stack.bytes_per_slot for stack in self.stacks.values())

    def write(self, slot: int, adapter: Adapter) -> None:
        for stack in self.stacks.values():
            stack.clear(slot)
        for (layer, projection, part), (a, b) in adapter.pairs.items():
            self.stacks[(layer, projection)].write(slot, part, a, b)
