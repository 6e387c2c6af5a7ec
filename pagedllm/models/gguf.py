"""Convert a GGUF file, once, into a Hugging Face model folder.

The folder (float32 `model.safetensors`, `config.json`, `generation_config.json` and tokenizer files)
is cached under `<cache>/gguf/<key>/`, where `<cache>` is `$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm`
and `<key>` hashes the GGUF file's absolute path, size and mtime, so a changed file is reconverted. It is
a crash-safe entry of `native.cached_folder`: published complete or not at all, checked against its
manifest on every start, converted again when damaged.

What the file means comes from transformers' GGUF support, not from tables of our own:

- the config: `GGUF_CONFIG_MAPPING` renames the `<arch>.*` metadata keys to config fields;
- the tensor names: `get_gguf_hf_weights_map` runs gguf's own HF -> GGUF name table over a model
  skeleton (built on the meta device from that config, so it costs no memory);
- undoing what llama.cpp's converter did to the values: transformers' `TensorProcessor`s (the Q/K
  row permutation of the llama family, Gemma's `w + 1` norms, the stacked MoE experts);
- the saved layout: `revert_weight_conversion`, what `save_pretrained` uses, so the folder holds the
  names transformers' own checkpoints use (one tensor per MoE expert, for instance);
- the tokenizer: transformers' GGUF tokenizer conversion.

What stays ours, for speed (default model: ~5 s in all, where `load_gguf_checkpoint` takes ~12 s for
its tensors alone): a header reader that skips the vocabulary (gguf's `GGUFReader`, which
`load_gguf_checkpoint` uses, parses every token string: ~4 s), gguf's dequantization on a thread
pool, and `get_gguf_hf_weights_map` run on the top-level model only (see `_Flat`). And the metadata
transformers' table leaves out: rope scaling (linear, yarn, Llama 3's `rope_freqs`, Phi-3's longrope
factors), the head size, sliding windows, Gemma's attention scale, MoE widths, end-of-turn tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from pagedllm.native import MANIFEST, cache_root, cached_folder

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from pagedllm.models.quantized import QuantizedWeight

# Part of the cache key: bump it whenever the converted folder's contents change, so stale
# conversions made by an older pagedllm are not reused.
CONVERTER_VERSION = 4
# In a lean folder: which GGUF tensors stay quantized, under which parameter names, their rows in which order.
# Start-up reads it instead of rebuilding the plan, which needs transformers' config and model classes (~2 s
# of imports).
HELD_PLAN = "held_weights.json"
# Written last into a converted folder (it lists every file, and records the conversion): a folder
# without it, or that does not match it, is converted again.
COMPLETE_MARKER = MANIFEST

StrPath = str | os.PathLike[str]


class _Family(NamedTuple):
    model_type: str  # transformers' model_type
    layout: str  # the llama.cpp architecture whose tensor names and transforms the file uses


# GGUF `general.architecture` -> what it converts to. llama.cpp writes Mistral models as `llama`
# (see `_family`); `mistral` is an architecture name transformers' GGUF table also knows.
GGUF_ARCHITECTURES: dict[str, _Family] = {
    "llama": _Family("llama", "llama"),
    "mistral": _Family("mistral", "llama"),
    "qwen2": _Family("qwen2", "qwen2"),
    "qwen3": _Family("qwen3", "qwen3"),
    "qwen3moe": _Family("qwen3_moe", "qwen3moe"),
    "gemma2": _Family("gemma2", "gemma2"),
    "gemma3": _Family("gemma3_text", "gemma3"),
    "phi3": _Family("phi3", "phi3"),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(sorted(GGUF_ARCHITECTURES))
# Architectures transformers' GGUF table converts but pagedllm's decoder cannot run (so no test can check
# the engine on them): refused with the reason before any tensor is read. Converted, they would fail only
# in the loader, after the whole file was dequantized into the cache.
_REFUSED_GGUF_ARCHITECTURES = {
    "qwen2moe": "Qwen2-MoE's shared expert (and its gate) is not in pagedllm's mixture-of-experts block",
}

# Metadata keys llama.cpp writes and transformers' GGUF_CONFIG_MAPPING does not carry for every
# architecture; each is set only where the config class has the field.
_MORE_CONFIG_KEYS = {
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
}
# Without these a GGUF file does not describe a model (llama.cpp refuses such files too).
_REQUIRED_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
)
# Tensors that are rope parameters, read into the config rather than saved.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Tokens llama.cpp ends generation on when the vocabulary has them (llama-vocab.cpp); we add those
# the chat template writes, since a chat model ends its turn with them.
_TURN_END_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|return|>",
    "<|call|>",
)
# llama.cpp's Gemma attention scale is 1/sqrt(hidden/heads) for the 27B models (known by their
# layer count), 1/sqrt(head_dim) otherwise.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def quantized_weights(gguf_path: Path, lean_folder: Path) -> dict[str, QuantizedWeight]:
    """The 2-D tensors of `gguf_path` that stay quantized in memory (`quantized.holds_quantized`), by the
    parameter names of the converted folder's checkpoint, their rows in that checkpoint's order: what the
    lean folder (`gguf_to_hf_folder(..., lean=True)`) leaves out, as its `HELD_PLAN` lists them."""
    import torch

    from pagedllm.models.quantized import QuantizedWeight

    gguf = GGUFFile(gguf_path)
    plan = json.loads((lean_folder / HELD_PLAN).read_text())
    out: dict[str, QuantizedWeight] = {}
    for name, entry in plan.items():
        info = gguf.tensors.get(name)
        if info is None or len(info.shape) != 2:
            raise ValueError(f"{lean_folder / HELD_PLAN} names tensor {name!r}, which {gguf_path} has not as a matrix")
        weight = QuantizedWeight(info.ggml_type, torch.from_numpy(gguf.blocks(name)), info.shape[1])
        if entry["order"] is not None:
            weight = weight.rows(torch.tensor(entry["order"], dtype=torch.int64))
        weight.check(f"{gguf_path}: tensor {name!r}")
        out[entry["param"]] = weight
    return out


def tokenizer_class(folder: StrPath) -> str | None:
    """The transformers class that reads the tokenizer of `folder`, a GGUF file's conversion, as its manifest
    records it (what `AutoTokenizer` chose there); None for any other folder."""
    try:
        name = json.loads((Path(folder) / COMPLETE_MARKER).read_text())["record"]["tokenizer_class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def conversion_key(gguf_path: Path, lean: bool = False) -> str:
    """Short hash of the file's identity and of the folder's kind; cheap (no file contents are read)."""
    path = gguf_path.resolve()
    stat = path.stat()
    identity = f"{CONVERTER_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}" + ("\0lean" if lean else "")
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def gguf_to_hf_folder(gguf_path: StrPath, cache_dir: StrPath | None = None, lean: bool = False) -> Path:
    """Hugging Face model folder for `gguf_path`, converting it on the first call only. A `lean` folder
    leaves out the tensors that stay quantized in memory (`quantized_weights`): the quantized path reads
    them from the file itself, and a model's float32 copy on disk (and in memory while it is written)
    would be four to eight times the file. Only pagedllm's loader reads a lean folder."""
    gguf_path = Path(gguf_path).resolve()
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / "gguf"
    return cached_folder(root, conversion_key(gguf_path, lean), lambda out_dir: _convert(gguf_path, out_dir, lean))


def _convert(gguf_path: Path, out_dir: Path, lean: bool) -> dict[str, Any]:
    """Write the folder's files into `out_dir`; what to record about the conversion in its manifest."""
    started = time.perf_counter()
    gguf = GGUFFile(gguf_path)
    family = _family(gguf)
    config = hf_config(gguf, family)
    # Everything is checked (names, shapes) before the first tensor is dequantized or a file written.
    plan = _WeightPlan(gguf, family, config)
    tokenizer = _tokenizer(gguf_path)

    eos_ids = _end_of_generation_ids(gguf, tokenizer)
    config.eos_token_id = _one_or_list(eos_ids)
    held = plan.held_plan() if lean else {}
    tensors = plan.run(skip=frozenset(held))
    if lean:
        (out_dir / HELD_PLAN).write_text(json.dumps(held))
    # "format": "pt" is what transformers expects in a safetensors header before loading it into torch.
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.save_pretrained(out_dir)
    _generation_config(config, eos_ids).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "tokenizer_class": _tokenizer_reader(out_dir),
        "source": str(gguf_path),
        "architecture": gguf.architecture,
        "converter_version": CONVERTER_VERSION,
        "lean": lean,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _tokenizer_reader(folder: Path) -> str:
    """The class `AutoTokenizer` reads `folder`'s tokenizer with (for some model types, such as Qwen2 and Phi3,
    another than the one that wrote it, with pre-tokenizer fixes of its own): kept, so that a start reads it with
    that class directly and not through `AutoTokenizer`, which first builds the model's config (over a second)."""
    from transformers import AutoTokenizer

    return type(AutoTokenizer.from_pretrained(folder)).__name__


# --- reading the file ------------------------------------------------------------------------------


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order (ggml lists the fastest-moving dimension first)
    ggml_type: GGMLQuantizationType
    start: int  # absolute offset in the file
    nbytes: int


_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class _Truncated(Exception):
    pass


class GGUFFile:
    """A GGUF file's metadata and tensor table, and its tensors on demand (memory-mapped).

    String arrays (the vocabulary, the merges) are skipped and kept as their length: nothing here
    needs them, and parsing them is most of what makes gguf's `GGUFReader` slow.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        if size < 24:
            raise ValueError(f"{path}: not a GGUF file ({size} bytes)")
        self._blob = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(self._blob[:4]) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            end_of_table = self._read_header()
        except _Truncated:
            raise ValueError(
                f"{path}: the file is truncated: it ends inside its metadata ({size} bytes); "
                "an incomplete download or copy?"
            ) from None
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = (end_of_table + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in self._entries:
            info = self._tensor_info(name, shape, ggml_type, data_start + offset)
            if info.start + info.nbytes > size:
                raise ValueError(
                    f"{path}: the file is truncated: tensor {name!r} needs bytes {info.start}.."
                    f"{info.start + info.nbytes} but the file has {size} bytes; an incomplete download or copy?"
                )
            self.tensors[name] = info

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self.metadata[key]

    def float32(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to a writable, contiguous float32 array (torch's shape order)."""
        info = self.tensors[name]
        row_bytes = info.nbytes // max(1, math.prod(info.shape[:-1]))
        raw = self._blob[info.start : info.start + info.nbytes].reshape(*info.shape[:-1], row_bytes)
        try:
            values = dequantize(np.asarray(raw), info.ggml_type)
        except NotImplementedError as error:
            raise ValueError(f"{self.path}: tensor {name!r}: {error}") from None
        if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values, dtype=np.float32, order="C")  # F32 tensors are views of the map
        return values.reshape(info.shape)

    def blocks(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as stored, a copy: `[rows, bytes per row]` (2-D tensors only)."""
        info = self.tensors[name]
        return np.array(self._blob[info.start : info.start + info.nbytes].reshape(info.shape[0], -1))

    # The layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
    def _read_header(self) -> int:
        version, tensor_count, kv_count = self._unpack("<IQQ", 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (only 2 and 3)")
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = self._string(pos)
            (value_type,) = self._unpack("<I", pos)
            self.metadata[key], pos = self._value(pos + 4, value_type, key)
        self._entries = []
        for _ in range(tensor_count):
            name, pos = self._string(pos)
            (n_dims,) = self._unpack("<I", pos)
            dims = self._unpack(f"<{n_dims}Q", pos + 4)
            ggml_type, offset = self._unpack("<IQ", pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            self._entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        return pos

    def _tensor_info(self, name: str, shape: tuple[int, ...], ggml_type: int, start: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {name!r} has ggml type {ggml_type}, unknown to gguf") from None
        if not shape or shape[-1] % block_size:
            raise ValueError(f"{self.path}: tensor {name!r} of shape {shape} does not fit {qtype.name} blocks")
        nbytes = math.prod(shape[:-1]) * (shape[-1] // block_size) * type_size
        return TensorInfo(name, shape, qtype, start, nbytes)

    def _unpack(self, fmt: str, pos: int) -> tuple:
        try:
            return struct.unpack_from(fmt, self._blob, pos)
        except struct.error:
            raise _Truncated from None

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = self._unpack("<Q", pos)
        end = pos + 8 + length
        if end > len(self._blob):
            raise _Truncated
        return bytes(self._blob[pos + 8 : end]).decode("utf-8", errors="replace"), end

    def _value(self, pos: int, value_type: int, key: str) -> tuple[Any, int]:
        if value_type in _SCALARS:
            fmt = _SCALARS[value_type]
            return self._unpack(fmt, pos)[0], pos + struct.calcsize(fmt)
        if value_type == GGUFValueType.STRING:
            return self._string(pos)
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: metadata {key!r} has unknown value type {value_type}")
        item_type, count = self._unpack("<IQ", pos)
        pos += 12
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            end = pos + count * struct.calcsize(fmt)
            if end > len(self._blob):
                raise _Truncated
            return np.frombuffer(self._blob, dtype=np.dtype(fmt), count=count, offset=pos).tolist(), end
        if item_type != GGUFValueType.STRING:
            raise ValueError(f"{self.path}: metadata {key!r} is an array of type {item_type}, not read")
        for _ in range(count):  # variable-length: walked, not kept
            (length,) = self._unpack("<Q", pos)
            pos += 8 + length
        if pos > len(self._blob):
            raise _Truncated
        return count, pos


def _family(gguf: GGUFFile) -> _Family:
    architecture = gguf.architecture
    if architecture in _REFUSED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {architecture!r} is not supported: "
            f"{_REFUSED_GGUF_ARCHITECTURES[architecture]}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if gguf.get("split.count", 1) > 1:
        raise ValueError(
            f"{gguf.path}: a split GGUF file (part of {gguf.get('split.count')}); merge the parts first "
            "(llama-gguf-split --merge)"
        )
    if architecture == "llama" and gguf.get("llama.expert_count"):
        raise ValueError(f"{gguf.path}: llama-architecture MoE files (Mixtral) are not supported")
    family = GGUF_ARCHITECTURES[architecture]
    # llama.cpp converts MistralForCausalLM as `llama`; transformers' GGUF loader tells them apart by
    # the model's name, and so do we (the two compute the same without a sliding window).
    if architecture == "llama" and "mistral" in str(gguf.get("general.name", "")).lower():
        family = GGUF_ARCHITECTURES["mistral"]
    return family


# --- the config ------------------------------------------------------------------------------------


def hf_config(gguf: GGUFFile, family: _Family) -> PretrainedConfig:
    """The transformers config the file's metadata describes (eos ids are set by the caller)."""
    import torch
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = gguf.architecture
    default = AutoConfig.for_model(family.model_type).to_dict()
    moe = "num_experts_per_tok" in default
    for suffix in (*_REQUIRED_KEYS, "expert_used_count" if moe else "feed_forward_length"):
        gguf.require(f"{arch}.{suffix}")

    # transformers' own table, under its names for the architectures ("qwen3moe" -> "qwen3_moe").
    table = GGUF_CONFIG_MAPPING[_transformers_arch(family)]
    settings: dict[str, Any] = {}
    for suffix, field in table.items():
        if field is not None and field != -1 and f"{arch}.{suffix}" in gguf.metadata:
            settings[field] = gguf.metadata[f"{arch}.{suffix}"]
    for suffix, field in _MORE_CONFIG_KEYS.items():
        if field in default and f"{arch}.{suffix}" in gguf.metadata:
            settings[field] = gguf.metadata[f"{arch}.{suffix}"]
    settings.update(_gguf_config_defaults(family, settings))

    heads = settings["num_attention_heads"]
    # llama.cpp omits head_count_kv when it equals head_count (no grouped-query attention).
    settings.setdefault("num_key_value_heads", heads)
    # llama.cpp states the head size when the model's config did; otherwise it is hidden / heads.
    stated_head_dim = gguf.get(f"{arch}.attention.key_length")
    head_dim = stated_head_dim or settings.get("head_dim") or settings["hidden_size"] // heads
    if stated_head_dim or "head_dim" in default or head_dim != settings["hidden_size"] // heads:
        settings["head_dim"] = head_dim
    else:
        settings.pop("head_dim", None)
    rotary_dim = gguf.get(f"{arch}.rope.dimension_count") or head_dim
    if rotary_dim != head_dim:
        settings["partial_rotary_factor"] = rotary_dim / head_dim
    # 10000 is llama.cpp's default when the file does not state a base.
    settings["rope_theta"] = float(gguf.get(f"{arch}.rope.freq_base", 10000.0))
    settings["rope_scaling"] = _rope_scaling(gguf, settings, rotary_dim)
    if settings.get("sliding_window") == 0:
        settings["sliding_window"] = None  # llama.cpp's phi3 writes 0 for "none"
    if family.model_type == "mistral":
        # llama.cpp runs Mistral as llama, without a window (MistralConfig's default is 4096).
        settings.setdefault("sliding_window", None)
    if family.model_type == "phi3":
        settings["original_max_position_embeddings"] = gguf.get(
            f"{arch}.rope.scaling.original_context_length", settings["max_position_embeddings"]
        )
    if family.layout in _GEMMA_27B_LAYERS:
        settings["query_pre_attn_scalar"] = _gemma_query_scale(gguf, settings)
    if family.layout == "gemma3":
        settings["rope_local_base_freq"] = float(gguf.get(f"{arch}.rope.freq_base_swa", 10000.0))
        pattern = gguf.get(f"{arch}.attention.sliding_window_pattern")
        if pattern is not None:
            settings["layer_types"] = _layer_types(pattern, settings["num_hidden_layers"])
    if moe:
        _moe_widths(gguf, settings)
    if "attention_bias" in default:
        settings["attention_bias"] = any(name.endswith(".attn_q.bias") for name in gguf.tensors)
    if "mlp_bias" in default:
        settings["mlp_bias"] = any(name.endswith(".ffn_up.bias") for name in gguf.tensors)

    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is not None:
        settings["vocab_size"] = embedding.shape[0]
    settings.setdefault("vocab_size", gguf.get("tokenizer.ggml.tokens"))  # kept as its length
    # llama.cpp writes `output.weight` only when it differs from the token embedding.
    settings["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    settings["bos_token_id"] = gguf.get("tokenizer.ggml.bos_token_id")
    settings["pad_token_id"] = gguf.get("tokenizer.ggml.padding_token_id")
    settings["eos_token_id"] = gguf.get("tokenizer.ggml.eos_token_id")
    settings.pop("model_type", None)

    config = AutoConfig.for_model(family.model_type, **settings)
    config.architectures = [_causal_lm_class_name(family.model_type)]
    config.dtype = torch.float32
    return config


def _transformers_arch(family: _Family) -> str:
    """transformers' name for the architecture in its GGUF tables."""
    return "gemma3" if family.model_type == "gemma3_text" else family.model_type


def _gguf_config_defaults(family: _Family, settings: dict[str, Any]) -> dict[str, Any]:
    """transformers' GGUF-specific defaults (what llama.cpp hard-codes), for fields the file left out."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    except ImportError:  # older transformers
        return {}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(_transformers_arch(family), {})
    return {key: value for key, value in defaults.items() if key not in settings}


def _causal_lm_class_name(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def _rope_scaling(gguf: GGUFFile, settings: dict[str, Any], rotary_dim: int) -> dict[str, Any] | None:
    """HF's rope scaling parameters from llama.cpp's metadata and rope tensors, or None when unscaled."""
    arch = gguf.architecture
    if "rope_factors_long.weight" in gguf.tensors:
        long = gguf.float32("rope_factors_long.weight")
        # llama.cpp leaves contexts within the original length unscaled when there are no short factors.
        short = gguf.float32("rope_factors_short.weight") if "rope_factors_short.weight" in gguf.tensors else None
        scaling = {
            "rope_type": "longrope",
            "long_factor": long.tolist(),
            "short_factor": short.tolist() if short is not None else [1.0] * len(long),
        }
        # Stated only where it is not the value HF derives from the two context lengths by itself.
        attention_factor = gguf.get(f"{arch}.rope.scaling.attn_factor")
        original = gguf.get(f"{arch}.rope.scaling.original_context_length") or settings["max_position_embeddings"]
        scale = settings["max_position_embeddings"] / original
        derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if attention_factor is not None and not math.isclose(attention_factor, derived, rel_tol=1e-6):
            scaling["attention_factor"] = attention_factor
        return scaling
    if "rope_freqs.weight" in gguf.tensors:
        return llama3_rope_scaling(
            gguf.float32("rope_freqs.weight"),
            rope_theta=settings["rope_theta"],
            rotary_dim=rotary_dim,
            original_context=gguf.get(f"{arch}.rope.scaling.original_context_length"),
            source=gguf.path,
        )
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{gguf.path}: GGUF rope scaling type {kind!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(gguf.require(f"{arch}.rope.scaling.factor"))}
    original = gguf.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for suffix, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{suffix}" in gguf.metadata:
                scaling[field] = float(gguf.metadata[f"{arch}.rope.scaling.{suffix}"])
    return scaling


def llama3_rope_factors(
    rope_theta: float, rotary_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs` for HF's `llama3` rope scaling."""
    freqs = 1.0 / rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def llama3_rope_scaling(
    rope_freqs: np.ndarray,
    rope_theta: float,
    rotary_dim: int,
    original_context: int | None = None,
    source: StrPath = "GGUF file",
) -> dict[str, Any] | None:
    """HF `llama3` rope parameters that reproduce a `rope_freqs` tensor, or None for all ones.

    The factors only pin down the ratios original/low and original/high (and `factor`), so the
    original context is taken as llama.cpp's converter assumes it (8192, unless the file states
    one), Llama 3's own low/high (1, 4) are tried first, then a fit of the smoothed band; whatever
    is chosen must reproduce every factor.
    """
    factors = np.asarray(rope_freqs, dtype=np.float64)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"{source}: rope_freqs has shape {factors.shape}, expected ({rotary_dim // 2},)")
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    original = float(original_context or 8192)
    candidates = [(1.0, 4.0)]
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if medium.sum() >= 2 and factor > 1:
        # medium factors r: 1/r = (1 - s)/factor + s with s = original/wavelen/(high - low) - low/(high - low)
        wavelen = 2 * math.pi * rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        low, high = -intercept * original / slope, (1 - intercept) * original / slope
        candidates += [(round(low, 4), round(high, 4)), (low, high)]
    for low, high in candidates:
        if high > low and np.allclose(
            llama3_rope_factors(rope_theta, rotary_dim, factor, low, high, original), factors, rtol=1e-4, atol=0
        ):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(original),
            }
    raise ValueError(f"{source}: its rope_freqs tensor does not follow Llama 3's rope scaling; not supported")


def _gemma_query_scale(gguf: GGUFFile, settings: dict[str, Any]) -> float:
    """Gemma's `query_pre_attn_scalar`: queries are scaled by its inverse square root."""
    scale = gguf.get(f"{gguf.architecture}.attention.scale")
    if scale:
        scalar = 1 / scale**2
        return round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-4) else scalar
    if settings["num_hidden_layers"] == _GEMMA_27B_LAYERS[gguf.architecture]:
        return settings["hidden_size"] // settings["num_attention_heads"]
    return settings["head_dim"]


def _layer_types(pattern: int | list, layers: int) -> list[str]:
    """llama.cpp's sliding-window pattern (every n-th layer global, or a flag per layer) as HF layer types."""
    if isinstance(pattern, list):
        return ["sliding_attention" if flag else "full_attention" for flag in pattern[:layers]]
    return ["full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def _moe_widths(gguf: GGUFFile, settings: dict[str, Any]) -> None:
    """Expert widths the file does not state, read off the first layer's expert tensors."""
    shapes = {name.removeprefix("blk.0."): info.shape for name, info in gguf.tensors.items()}
    if "moe_intermediate_size" not in settings and "ffn_down_exps.weight" in shapes:
        settings["moe_intermediate_size"] = shapes["ffn_down_exps.weight"][-1]
    if "num_experts" not in settings and "ffn_down_exps.weight" in shapes:
        settings["num_experts"] = shapes["ffn_down_exps.weight"][0]


def _one_or_list(ids: list[int]) -> int | list[int] | None:
    """HF's convention for `eos_token_id`: a single id, a list of ids, or None."""
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _end_of_generation_ids(gguf: GGUFFile, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The file's eos, end-of-turn and end-of-message ids, then the turn-ending tokens its chat template writes."""
    ids = [gguf.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    ids += [vocab.get(token) for token in _TURN_END_TOKENS if token in template]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _generation_config(config: PretrainedConfig, eos_ids: list[int]):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=_one_or_list(eos_ids), pad_token_id=config.pad_token_id
    )


def _tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer built from the GGUF vocabulary by transformers' own GGUF conversion.

    `PreTrainedTokenizerFast` directly, not `AutoTokenizer`: the latter also rebuilds the model config
    from the file with a second full metadata parse (~3 s); the tokenizer it returns is the same.
    This carries over the chat template, the special tokens and `add_bos_token`.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"{gguf_path}: cannot build its tokenizer: {error}") from error


# --- the weights -----------------------------------------------------------------------------------


@dataclass
class _WeightPlan:
    """Which GGUF tensor becomes which parameter, checked against a meta-device model skeleton."""

    gguf: GGUFFile
    family: _Family
    config: PretrainedConfig

    def __post_init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        with torch.device("meta"):
            self.skeleton: PreTrainedModel = AutoModelForCausalLM.from_config(self.config)
        self.processor = TENSOR_PROCESSORS.get(self.family.layout, TensorProcessor)(config=self.config.to_dict())
        state = self.skeleton.state_dict()
        # gguf's name table is chosen from the model type; a mistral file uses llama's names.
        model_type = "llama" if self.family.layout == "llama" else None
        self.names: dict[str, str] = get_gguf_hf_weights_map(_Flat(self.config, state), self.processor, model_type)
        self.shapes = {name: tuple(p.shape) for name, p in state.items()}
        if self.config.tie_word_embeddings:
            self.shapes.pop("lm_head.weight", None)

        path, cls = self.gguf.path, type(self.skeleton).__name__
        self.sources = [name for name in self.gguf.tensors if name not in _ROPE_TENSORS]
        unknown = [name for name in self.sources if self._target(name) is None]
        if unknown:
            raise ValueError(f"{path}: tensors {_some(unknown)} have no counterpart in {cls}")
        missing = sorted(set(self.shapes) - {self._target(name) for name in self.sources})
        if missing:
            raise ValueError(f"{path}: no tensor for {cls} parameters {_some(missing)}")
        for name in self.sources:  # one tensor, one parameter (not stacked experts): the sizes must agree
            info, target = self.gguf.tensors[name], self.names.get(name)
            if target is not None and math.prod(info.shape) != math.prod(self.shapes.get(target, info.shape)):
                raise ValueError(
                    f"{path}: tensor {name} has shape {info.shape}; {cls}.{target} is {self.shapes[target]}"
                )

    def _target(self, gguf_name: str) -> str | None:
        # transformers keys stacked MoE experts without the ".weight" suffix.
        return self.names.get(gguf_name) or self.names.get(gguf_name.removesuffix(".weight"))

    def run(self, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every parameter but those of the GGUF tensors in `skip`, as float32, under the names transformers
        saves checkpoints with."""
        import torch

        state: dict[str, torch.Tensor] = {}
        parsed = {"tensors": state}  # where transformers' MoE processors put the experts they stack
        sources = [name for name in self.sources if name not in skip]
        # numpy releases the GIL in the bulk array work of dequantization, so threads use every core;
        # transformers' processors run here, in file order (the MoE ones fill shared tensors).
        with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
            for name, weights in zip(sources, pool.map(self.gguf.float32, sources), strict=True):
                result = self.processor.process(
                    weights=weights, name=name, tensor_key_mapping=self.names, parsed_parameters=parsed
                )
                if result.name is not None:
                    state[self.names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights))
        for name, tensor in state.items():
            state[name] = self._fit(name, tensor)
        return {name: _own(tensor) for name, tensor in self._saved_layout(state).items()}

    def held_plan(self) -> dict[str, dict[str, Any]]:
        """`HELD_PLAN`: each tensor that stays quantized, by GGUF name: its parameter and the order of its rows
        there (None: as stored), where transformers' processor reorders rows (the Q/K permutation of the llama
        family); a tensor the processor changes in any other way is left to the dequantized folder."""
        import torch

        plan = {}
        for name, order in self._held_orders().items():
            identity = bool(torch.equal(order, torch.arange(len(order))))
            plan[name] = {"param": self.names[name], "order": None if identity else order.tolist()}
        return plan

    def _held_orders(self) -> dict[str, torch.Tensor]:
        """Each tensor that stays quantized, by GGUF name, with the order of its rows in the checkpoint."""
        from pagedllm.models.quantized import holds_quantized

        orders = {}
        for name in self.sources:
            info = self.gguf.tensors[name]
            if self.names.get(name) is None or len(info.shape) != 2 or not holds_quantized(info.ggml_type):
                continue
            order = self._row_order(name, info.shape[0])
            if order is not None:
                orders[name] = order
        return orders

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """Where the processor takes each output row from, found by processing the row indices themselves;
        None when what it does is not a reordering of rows."""
        import torch

        index = np.arange(rows, dtype=np.float64)[:, None]
        result = self.processor.process(
            weights=index, name=name, tensor_key_mapping=self.names, parsed_parameters={"tensors": {}}
        )
        order = np.asarray(result.weights)
        if result.name is None or order.shape != index.shape or not np.array_equal(np.sort(order[:, 0]), index[:, 0]):
            return None
        return torch.from_numpy(order[:, 0].astype(np.int64))

    def _fit(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        expected = self.shapes[name]
        if tuple(tensor.shape) == expected:
            return tensor
        # llama.cpp drops size-1 dimensions (a [1, hidden] matrix is stored as [hidden]).
        if [d for d in tensor.shape if d != 1] == [d for d in expected if d != 1]:
            return tensor.reshape(expected)
        raise ValueError(f"{self.gguf.path}: {name} has shape {tuple(tensor.shape)}, expected {expected}")

    def _saved_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers 5 fuses some checkpoint tensors when it loads them (MoE experts) and splits them
        again when it saves; the folder holds the saved form, like any checkpoint."""
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # transformers 4: the model's names are the checkpoint's
            return state
        return revert_weight_conversion(self.skeleton, state)


class _Flat:
    """What `get_gguf_hf_weights_map` reads of a model, without submodules.

    It also maps every submodule on its own (for checkpoints saved from a base model, like Bloom's),
    which costs ~5 s on a 30-layer model and finds nothing new for these architectures.
    """

    def __init__(self, config: PretrainedConfig, state: dict[str, torch.Tensor]) -> None:
        self.config = config
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_children(self) -> list:
        return []


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with storage of its own: safetensors refuses tensors that share memory (split experts)."""
    if tensor.untyped_storage().nbytes() == tensor.nbytes and tensor.is_contiguous():
        return tensor
    return tensor.clone() if tensor.is_contiguous() else tensor.contiguous()


def _some(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
