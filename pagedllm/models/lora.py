"""LoRA adapters on the decoder's projections, many in one batch.

A PEFT folder (`adapter_config.json`, `adapter_model.safetensors`) is read into an `Adapter`: for each
(layer, projection, part) its down-projection A and its up-projection B, the scaling folded into B. The
model holds `max_loras` slots of every adaptable projection (`LoRASlots`: one `LoRAStack` per layer and
projection, every rank padded to `max_lora_rank`), allocated once; an adapter is resident when its pairs
are written into a slot. The base weights are never touched.

A step's tokens are grouped by slot (`LoRABatch`), and each projection adds a low-rank delta to its base
output, never merging an adapter into the weights nor splitting the step by adapter. Groups (decode
tokens, prompt chunks of similar lengths) are gathered into one padded `[groups, rows, in]` batch and shrunk by
their own slots' A and expanded by their own slots' B in two batched products (Punica's SGMV idea), so a row
pays for its own rank-R pair only, whatever the mix of adapters. A group that would pad the batch too much (a
prompt chunk beside decode tokens) is multiplied by its own slot's pair alone.

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
# The step's groups are multiplied together, padded to the largest, while the padded rows are at most this many
# times the real ones; past it the largest groups (prompt chunks beside decode tokens) are multiplied alone.
MAX_PADDING = 1.25

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
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        try:
            found = (Path(folder) / name).is_file()
        except OSError as error:  # a name too long, a folder it may not read: the path's fault, not the server's
            raise ValueError(f"lora_path {str(folder)[:200]!r} cannot be read: {error.strerror}") from error
        if not found:
            raise ValueError(f"lora_path {str(folder)[:200]!r} has no {name}")
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


Rows = slice | torch.Tensor  # rows of the flat batch: a contiguous run, or indices


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _add_to(out: torch.Tensor, rows: Rows, delta: torch.Tensor) -> None:
    """`out[rows] += delta`, each row once: an indexed add, except in bf16, where torch's indexed add is several
    times slower than reading the rows, adding and copying them back (in float32 it is 2-4 times faster)."""
    if isinstance(rows, slice):
        out[rows] += delta
    elif out.dtype == torch.bfloat16:
        out.index_copy_(0, rows, out.index_select(0, rows).add_(delta))
    else:
        out.index_add_(0, rows, delta)


def _rows(indices: np.ndarray) -> Rows:
    if len(indices) == 1 or bool(np.all(np.diff(indices) == 1)):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return torch.from_numpy(indices)


@dataclass(slots=True)
class GroupedRows:
    """Groups of several adapters (decode tokens, prompt chunks of similar lengths), multiplied together as one
    batched product per side: the rows are laid out `[groups, width, in]`, each group's rows after one another and
    padded with zeros to the largest group's size, and multiplied by their own slot's A, then B (Punica's
    shrink and expand, as two `bmm`s). `take` lists the rows in that order, `place` their positions in the
    padded layout (None when no group needs padding)."""

    slots: Rows  # each group's slot: a run of slots (the stacks' views, no copy) or their indices
    num_groups: int
    width: int  # rows per group, padded
    take: Rows
    place: torch.Tensor | None


@dataclass(slots=True)
class OwnRows:
    """A large group (a prompt chunk): multiplied by its own slot's pair alone."""

    slot: int
    rows: Rows


@dataclass(slots=True)
class LoRABatch:
    """A step's rows that run under an adapter, by slot; the other rows are the base model's alone."""

    grouped: GroupedRows
    own: list[OwnRows]

    @staticmethod
    def build(slot_of_seq: list[int], query_lens: list[int]) -> LoRABatch | None:
        """`slot_of_seq[i]` is scheduled sequence i's slot (-1: the base model), `query_lens[i]` its rows."""
        starts = np.concatenate(([0], np.cumsum(query_lens)))
        per_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(slot_of_seq):
            if slot >= 0:
                per_slot.setdefault(slot, []).extend(range(starts[i], starts[i + 1]))
        if not per_slot:
            return None
        groups = sorted(per_slot.items(), key=lambda group: len(group[1]))
        own: list[OwnRows] = []
        while len(groups) > 1 and len(groups) * len(groups[-1][1]) > MAX_PADDING * sum(len(g) for _, g in groups):
            slot, rows = groups.pop()
            own.append(OwnRows(slot, _rows(np.array(rows))))
        return LoRABatch(_grouped(sorted(groups)), own)

    def to(self, device: torch.device) -> LoRABatch:
        if device.type == "cpu":
            return self

        def moved(rows: Rows) -> Rows:
            return rows if isinstance(rows, slice) else rows.to(device)

        g = self.grouped
        place = None if g.place is None else g.place.to(device)
        grouped = GroupedRows(moved(g.slots), g.num_groups, g.width, moved(g.take), place)
        return LoRABatch(grouped, [OwnRows(group.slot, moved(group.rows)) for group in self.own])


def _grouped(groups: list[tuple[int, list[int]]]) -> GroupedRows:
    """The groups, in the order of their slots, in the padded `[groups, width]` layout."""
    width = max(len(rows) for _, rows in groups)
    take = np.concatenate([np.asarray(rows) for _, rows in groups])
    place = None
    if any(len(rows) < width for _, rows in groups):
        place = torch.from_numpy(
            np.concatenate([g * width + np.arange(len(rows)) for g, (_, rows) in enumerate(groups)])
        )
    slots = np.array([slot for slot, _ in groups])
    return GroupedRows(_rows(slots), len(groups), width, _rows(take), place)


class LoRAStack:
    """One projection's slots. A is `[max_loras, in, parts * R]`: every part's A side by side, so that one
    product shrinks a row for all parts; B is `[max_loras, parts * R, out]`, block-diagonal (part i's R rows
    reach part i's columns only), so that one product expands it into every part. A rank below R and a part the
    adapter leaves alone are zeros."""

    def __init__(self, shape: Projection, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.rank, self.max_loras = max_rank, max_loras
        self.num_parts = len(shape.part_sizes)
        self.offsets = np.concatenate(([0], np.cumsum(shape.part_sizes))).tolist()
        inner = self.num_parts * max_rank
        self.a = torch.zeros(max_loras, shape.in_features, inner, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, inner, self.offsets[-1], dtype=dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        return (self.a.nbytes + self.b.nbytes) // self.max_loras

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        rank, first = a.shape[1], part * self.rank
        self.a[slot, :, first : first + rank] = a
        self.b[slot, first : first + rank, self.offsets[part] : self.offsets[part + 1]] = b

    def add(self, out: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """`out += B(A x)` for each row of `batch`, with its own slot's pair."""
        _add_to(out, batch.grouped.take, self._grouped_delta(x, batch.grouped))
        for group in batch.own:
            shrunk = _take(x, group.rows) @ self.a[group.slot]
            if isinstance(group.rows, slice):  # a prompt chunk: each part's block added in place, no zeros
                self._expand_parts_into(out[group.rows], shrunk, group.slot)
            else:
                _add_to(out, group.rows, shrunk @ self.b[group.slot])

    def _expand_parts_into(self, target: torch.Tensor, shrunk: torch.Tensor, slot: int) -> None:
        """`target += shrunk @ B` by each part's diagonal block only (a view of `target` is written in place)."""
        for part in range(self.num_parts):
            inner = slice(part * self.rank, (part + 1) * self.rank)
            columns = slice(self.offsets[part], self.offsets[part + 1])
            target[:, columns].addmm_(shrunk[:, inner], self.b[slot, inner, columns])

    def _grouped_delta(self, x: torch.Tensor, grouped: GroupedRows) -> torch.Tensor:
        """The deltas of the grouped rows, in `take`'s order."""
        xs = _take(x, grouped.take)
        groups = grouped.num_groups
        if grouped.place is not None:
            xs = xs.new_zeros(groups * grouped.width, x.shape[1]).index_copy_(0, grouped.place, xs)
        a, b = self.a[grouped.slots], self.b[grouped.slots]  # views for a run of slots
        delta = torch.bmm(torch.bmm(xs.view(groups, grouped.width, -1), a), b).view(groups * grouped.width, -1)
        return delta if grouped.place is None else delta.index_select(0, grouped.place)


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
        device = model.norm.weight.device  # (the embedding and projections may be quantized or prepacked)
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
