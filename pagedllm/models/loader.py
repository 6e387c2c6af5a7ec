"""Building a model, its config and tokenizer from a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from pagedllm.distributed.parallel import Shard
from pagedllm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedllm.models.decoder import CausalLM, Embedding, Linear
from pagedllm.models.encoder import Encoder, encoder_of
from pagedllm.models.lean import LeanLayers
from pagedllm.models.moe import moe_weights
from pagedllm.models.prepack import can_prepack
from pagedllm.models.quantized import (
    PackedWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    has_integer_kernel,
    packs_kind,
)
from pagedllm.models.tensor_parallel import shard_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "load_model", "resolve_model_folder"]

logger = logging.getLogger(__name__)

# `quantization`'s names for GGUF block types: 8-bit and 4-bit values in blocks of 32, one scale each.
QUANTIZATION_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_0}

# A GGUF file's matrices get no dequantized copy beside their blocks (`holds_dense`) when the copies would take
# more than this share of the memory available at load: a file chosen to fit is not made to swap.
DEQUANTIZED_SHARE = 0.25

# Our fused matrices and the checkpoint's parts, in order; a checkpoint that stores the fused matrix
# itself (Phi3's qkv_proj and gate_up_proj) is read as is.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM | Encoder
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    folder: Path


def resolve_model_folder(model: str | Path | None, lean: bool = False) -> Path:
    """`None` is the embedded default; a `.gguf` file is converted once to a cached HF folder (`lean`: without
    the tensors the quantized path holds, see `gguf_to_hf_folder`)."""
    from pagedllm.models.default import default_model_file
    from pagedllm.models.gguf import gguf_to_hf_folder

    path = default_model_file() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_folder(path, lean=lean)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {str(path)!r} is neither a .gguf file nor a folder with config.json")
    return path


def load_model(
    model: str | Path | None,
    dtype: torch.dtype,
    device: str = "cpu",
    shard: Shard | None = None,
    dequantize: bool | None = None,
    quantization: str | None = None,
    int16_activations: bool | None = None,
) -> LoadedModel:
    """The model in `dtype` on `device`; with a `shard` of a tensor-parallel group, that rank's slices.
    A GGUF file's quantized linear layers and embedding stay quantized (`quantized.py`) unless `dequantize`,
    or where the quantized kernels cannot go: another device, tensor parallelism; with `dequantize` None the
    layers may hold a dequantized copy beside (`holds_dense`). `quantization` ("int8",
    "int4") quantizes the rest of them once, here. Unless `int16_activations` is False, their products
    quantize the activations to int16 where an integer kernel takes them (`quantized.packs`)."""
    world_size = 1 if shard is None else shard.world_size
    quantized_path = runs_quantized(device, world_size)
    folder = resolve_model_folder(model, lean=reads_lean_folder(device, world_size, dequantize))
    # Unsupported architectures, missing fields and options we cannot follow exactly fail here,
    # before any weight is read.
    config = ModelConfig.from_folder(folder)
    for note in config.notes:
        logger.warning(note)
    if config.encoder is not None:
        return _load_encoder(model, folder, config, dtype, device, world_size, quantization)
    # Parameters start as uninitialised (untouched) memory; the checkpoint's tensors replace them.
    net = CausalLM(config)
    held = _held_quantized(model, folder, net, dequantize, quantization) if quantized_path else {}
    integer = int16_activations is not False
    dense = holds_dense(model, dtype, device, world_size, dequantize, integer)
    _quantize_modules(net, held, dtype, dense, integer)
    net.load_state_dict(read_state_dict(folder, net, dtype, held), assign=True)
    if (config.tie_word_embeddings or not config.has_lm_head) and isinstance(net.embed_tokens, Embedding):
        net.lm_head.weight = net.embed_tokens.weight
    if shard is not None and shard.world_size > 1:
        shard_model(net, shard)
    tokenizer = load_tokenizer(folder)
    net = net.to(device).eval().requires_grad_(False)
    net.prepack()
    if quantized_path:
        net.lean = LeanLayers.of(net, dtype)
    return LoadedModel(net, config, tokenizer, folder)


def _load_encoder(
    model: str | Path | None,
    folder: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    world_size: int,
    quantization: str | None,
) -> LoadedModel:
    """A BERT-style encoder from its safetensors folder, whole, in `dtype` (its products are few and small: no
    quantized path, no sharding)."""
    refused = [
        what
        for what, asked in (
            ("a GGUF file", _gguf_source(model) is not None),
            (f"quantization {quantization!r}", quantization is not None),
            ("tensor parallelism", world_size > 1),
        )
        if asked
    ]
    if refused:
        raise ValueError(f"{folder}: {config.architecture} (an encoder) does not run with {refused[0]}")
    net = encoder_of(config)
    net.load_state_dict(read_encoder_state_dict(folder, net, dtype), assign=True)
    net = net.to(device).eval().requires_grad_(False)
    net.prepack()
    return LoadedModel(net, config, load_tokenizer(folder), folder)


def read_encoder_state_dict(folder: Path, net: Encoder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter of an encoder from its checkpoint, in `dtype`. The encoder's keys may carry the classifier's
    prefix (`bert.`, `roberta.`) or not, whatever the architecture, as transformers accepts both."""
    raw = Checkpoint(folder)
    assert net.config.encoder is not None
    prefix = net.config.encoder.checkpoint_prefix
    out: dict[str, torch.Tensor] = {}
    for name in net.state_dict():
        keys = [key if key in raw or prefix + key not in raw else prefix + key for key in net.checkpoint_keys(name)]
        out[name] = torch.cat([raw[key] for key in keys], dim=0).to(dtype)
    return out


def runs_quantized(device: str, world_size: int) -> bool:
    """Whether quantized weights stay quantized: the kernels are CPU ones, for a whole (unsharded) model."""
    return device == "cpu" and world_size == 1


def holds_dense(
    model: str | Path | None,
    dtype: torch.dtype,
    device: str,
    world_size: int,
    dequantize: bool | None,
    integer: bool = True,
) -> bool:
    """Whether a GGUF file's quantized matrices also get a dequantized, prepacked copy in `dtype` (auto only,
    `dequantize` None), where no integer kernel takes them packed (with `integer`): so that every product of
    more than a few rows is faster on the copy (`QuantizedLinear.hold_dense`), unless the copies would take
    more than `DEQUANTIZED_SHARE` of the memory available."""
    source = _gguf_source(model)
    if dequantize is not None or source is None or not runs_quantized(device, world_size):
        return False
    if not can_prepack(torch.empty(0, dtype=dtype)):
        return False
    if integer and dtype == torch.bfloat16 and has_integer_kernel(dtype):
        return False  # with AVX512-VNNI no bf16 layer holds a copy: the types it does not pack take the tiles
    from pagedllm.models.gguf import GGUFFile

    infos = GGUFFile(source).tensors.values()
    elements = sum(math.prod(i.shape) for i in infos if not (integer and packs_kind(i.ggml_type, dtype)))
    needed = elements * torch.empty((), dtype=dtype).element_size()
    fits = needed <= DEQUANTIZED_SHARE * available_memory()
    if not fits:
        logger.warning(
            "%s runs on its quantized blocks alone: a dequantized copy in %s would take %.1f GiB, over %d%% of "
            "the memory available (pass dequantize=True to hold the dequantized weights only)",
            source.name,
            dtype,
            needed / 2**30,
            round(100 * DEQUANTIZED_SHARE),
        )
    return fits


def available_memory() -> int:
    """Bytes of memory available for new allocations (MemAvailable), or all of it where /proc cannot say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reads_lean_folder(device: str, world_size: int, dequantize: bool | None) -> bool:
    """Whether a GGUF file's quantized tensors come from the file itself, so that its lean folder serves."""
    return runs_quantized(device, world_size) and not dequantize


def _held_quantized(
    model: str | Path | None, folder: Path, net: CausalLM, dequantize: bool, quantization: str | None
) -> dict[str, QuantizedWeight]:
    """The checkpoint tensors that stay quantized: a GGUF file's own, then the rest quantized to `quantization`."""
    from pagedllm.models.gguf import quantized_weights

    source = _gguf_source(model)
    held = quantized_weights(source, folder) if source is not None and not dequantize else {}
    if quantization is not None:
        held |= quantize_checkpoint(folder, net, QUANTIZATION_TYPES[quantization], held)
    return held


def quantize_checkpoint(
    folder: Path, net: CausalLM, kind: GGMLQuantizationType, held: Mapping[str, QuantizedWeight]
) -> dict[str, QuantizedWeight]:
    """The linear layers' matrices and the embedding of the checkpoint in `folder`, each read and quantized to
    `kind` by gguf's own quantizer (what llama-quantize computes for these types), one tensor at a time; those
    in `held` are left alone, and so are matrices whose rows are not whole blocks of 32."""
    raw = Checkpoint(folder)
    linears = [name for name, module in net.named_modules() if isinstance(module, Linear)]
    keys = {"model.embed_tokens.weight"} | {key for name in linears for key in _checkpoint_keys(raw, f"{name}.weight")}
    out: dict[str, QuantizedWeight] = {}
    for key in sorted(keys - set(held)):
        tensor = raw.get(key)
        if tensor is not None and tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            blocks = quantize(tensor.float().numpy(), kind)
            out[key] = QuantizedWeight(kind, torch.from_numpy(blocks), tensor.shape[1])
    return out


def _gguf_source(model: str | Path | None) -> Path | None:
    """The GGUF file `model` names (the embedded default is one), or None for a folder."""
    from pagedllm.models.default import default_model_file

    path = default_model_file() if model is None else Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _quantize_modules(
    net: CausalLM, weights: Mapping[str, QuantizedWeight], dtype: torch.dtype, dense: bool, integer: bool
) -> None:
    """Each linear layer whose every checkpoint part is in `weights`, and the embedding if it is, become their
    quantized forms (with a dequantized copy of each layer's weight if `dense`; with `integer`, multiplied by
    the integer kernels where they take `dtype`); their weights are then not read from the dequantized folder."""
    embedding: QuantizedWeight | PackedWeight | None = weights.get("model.embed_tokens.weight")
    for name, module in list(net.named_modules()):
        if not isinstance(module, Linear):
            continue
        tied = name == "lm_head" and net.config.tie_word_embeddings
        if tied:
            parts = [embedding] if embedding is not None else []
        else:
            parts = [weights.get(key) for key in _checkpoint_keys(weights, f"{name}.weight")]
        if parts and all(part is not None for part in parts):
            layer = QuantizedLinear(parts, bias=module.bias is not None, pack_for=dtype if integer else None)
            if dense and not all(isinstance(part, PackedWeight) for part in layer.parts):
                layer.hold_dense(dtype)
            net.set_submodule(name, layer)
            if tied:  # packed in place, if at all: the embedding's lookups read the head's rows
                embedding = layer.parts[0]
    if embedding is not None:
        net.embed_tokens = QuantizedEmbedding(embedding, dtype, net.embed_tokens.scale)


def read_state_dict(
    folder: Path, net: CausalLM, dtype: torch.dtype, held: Mapping[str, QuantizedWeight] | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter of `net` from the checkpoint in `folder`, in `dtype`; a tensor a lean folder lacks is
    dequantized from `held` (a fused layer whose other parts have no quantized kernel needs it whole)."""
    raw = WithHeld(Checkpoint(folder), held or {})
    names = list(net.state_dict(keep_vars=True))
    out: dict[str, torch.Tensor] = {}
    moe = net.config.moe
    if moe is not None:
        for i, sparse in enumerate(moe.layers):
            if sparse:
                prefix = next(
                    (p.format(i=i) for p in moe.checkpoint_prefixes if p.format(i=i) + "gate.weight" in raw),
                    moe.checkpoint_prefixes[0].format(i=i),
                )
                for key, tensor in moe_weights(raw, prefix, moe.num_experts).items():
                    out[f"layers.{i}.mlp.{key}"] = tensor.to(dtype)
    for name in names:
        if name not in out:
            out[name] = _checkpoint_tensor(raw, name).to(dtype)
    return out


def _checkpoint_tensor(raw: Checkpoint, name: str) -> torch.Tensor:
    """Our parameter `name` from checkpoint tensors: renamed (`model.` prefix) or concatenated (fused)."""
    keys = _checkpoint_keys(raw, name)
    return raw[keys[0]] if len(keys) == 1 else torch.cat([raw[key] for key in keys], dim=0)


def _checkpoint_keys(raw: Container[str], name: str) -> list[str]:
    """The checkpoint keys our parameter `name` is made of, in order."""
    if f"model.{name}" in raw:
        return [f"model.{name}"]
    for fused, parts in _FUSED.items():
        if fused in name:
            return [_key(raw, name.replace(fused, part)) for part in parts]
    return [_key(raw, name)]


def _key(raw: Container[str], name: str) -> str:
    if name == "lm_head.weight":
        # Tied embeddings, a converted GGUF file without a separate output matrix, or a checkpoint without a
        # head (a bare `*Model`, a classifier), whose embedding keys have no `model.` prefix.
        heads = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
        return next((key for key in heads if key in raw), heads[1])
    # A classifier's `score` sits beside `model.`; a bare `*Model` checkpoint's keys have no prefix.
    return name if name in raw and f"model.{name}" not in raw else f"model.{name}"


@dataclass(frozen=True)
class WithHeld(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors, and those it lacks that are held quantized, dequantized when asked for."""

    raw: Mapping[str, torch.Tensor]
    held: Mapping[str, QuantizedWeight]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.raw or key not in self.held:
            return self.raw[key]
        return self.held[key].dequantize(torch.float32)

    def __contains__(self, key: object) -> bool:
        return key in self.raw or key in self.held

    def __iter__(self) -> Iterator[str]:
        return iter(set(self.raw) | set(self.held))

    def __len__(self) -> int:
        return len(set(self.raw) | set(self.held))


class Checkpoint(Mapping[str, torch.Tensor]):
    """The tensors of a folder's safetensors files by name, each read when asked for. With
    `model.safetensors.index.json` (a sharded checkpoint) the index names the files; otherwise every
    `*.safetensors` file in the folder is read."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shards that are not in {folder}: {missing}")
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors weights in {folder}")
        self._handles = [safe_open(file, framework="pt") for file in files]
        self._where = {key: handle for handle in self._handles for key in handle.keys()}  # noqa: SIM118

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(f"checkpoint in {self.folder} lacks {key}")
        return self._where[key].get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of `folder`. A GGUF file's conversion records the class `AutoTokenizer` chose for it, and is
    read with that class directly: `AutoTokenizer` would first build the model's config, which imports
    transformers' model code (over a second of every start)."""
    import transformers

    from pagedllm.models.gguf import tokenizer_class

    name = tokenizer_class(folder)
    reader = getattr(transformers, name, None) if name is not None else None
    if reader is None:
        from transformers import AutoTokenizer  # its auto mappings are a few tenths of a second to import

        reader = AutoTokenizer
    return reader.from_pretrained(folder)
