"""Convert a Llama-architecture GGUF file, once, into a Hugging Face model folder.

The folder (float32 `model.safetensors`, `config.json`, `generation_config.json` and tokenizer files)
is cached under `<cache>/gguf/<key>/`, where `<cache>` is `$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm`
and `<key>` hashes the GGUF file's absolute path, size and mtime, so a changed file is reconverted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file

if TYPE_CHECKING:
    from transformers import GenerationConfig, LlamaConfig

# Part of the cache key: bump it whenever the converted folder's contents change, so stale
# conversions made by an older pagedllm are not reused.
CONVERTER_VERSION = 1
# Written last, into the temporary folder, so a folder without it was never completed.
COMPLETE_MARKER = "pagedllm_conversion.json"

_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

StrPath = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class LlamaHyperparameters:
    """What a GGUF file's `llama.*` and `tokenizer.ggml.*` metadata says about the model."""

    num_layers: int
    context_length: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: dict[str, float | int | str] | None
    bos_token_id: int | None
    # llama.cpp stops generation on any end-of-generation token (eos, end-of-turn, end-of-message).
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def default_cache_dir() -> Path:
    """pagedllm's cache root: `$PAGEDLLM_CACHE_DIR` if set, else `~/.cache/pagedllm`."""
    configured = os.environ.get("PAGEDLLM_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pagedllm"


def conversion_key(gguf_path: Path) -> str:
    """Short hash of the file's identity; cheap (no file contents are read)."""
    path = gguf_path.resolve()
    stat = path.stat()
    identity = f"{CONVERTER_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def gguf_to_hf_folder(gguf_path: StrPath, cache_dir: StrPath | None = None) -> Path:
    """Hugging Face model folder for `gguf_path`, converting it on the first call only."""
    gguf_path = Path(gguf_path).resolve()
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf"
    folder = root / conversion_key(gguf_path)
    if (folder / COMPLETE_MARKER).is_file():
        return folder

    root.mkdir(parents=True, exist_ok=True)
    # Converted in a sibling temporary folder and renamed into place (atomic on one filesystem), so an
    # interrupted conversion never leaves a half-written folder under the final name.
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        _convert(gguf_path, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if folder.exists() and not (folder / COMPLETE_MARKER).is_file():
        shutil.rmtree(folder)  # not made by this converter (it would have the marker)
    try:
        os.rename(staging, folder)
    except OSError:
        # Another process finished the same conversion first and renamed its folder into place.
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / COMPLETE_MARKER).is_file():
            raise
    return folder


def _convert(gguf_path: Path, out_dir: Path) -> None:
    started = time.perf_counter()
    reader = GGUFReader(gguf_path)
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: architecture {architecture!r} is not supported, only llama")
    params = read_llama_hyperparameters(reader)

    tensors = _hf_tensors(reader, params)
    # llama.cpp writes `output.weight` only when it differs from the token embedding.
    tied = "lm_head.weight" not in tensors
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    # "format": "pt" is what transformers expects in a safetensors header before loading it into torch.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors  # ~0.5 GB, no longer needed while the tokenizer is built
    _llama_config(params, vocab_size, tied).save_pretrained(out_dir)
    _generation_config(params).save_pretrained(out_dir)
    _save_tokenizer(gguf_path, out_dir)

    record = {
        "source": str(gguf_path),
        "converter_version": CONVERTER_VERSION,
        "seconds": round(time.perf_counter() - started, 3),
    }
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value, or `default` when the key is absent.

    Read through `parts`/`data` rather than `ReaderField.contents()`, which older gguf releases lack.
    """
    field = reader.get_field(key)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array, expected a single value")
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.item()


def read_llama_hyperparameters(reader: GGUFReader) -> LlamaHyperparameters:
    """The model hyperparameters and special token ids from a llama GGUF file's metadata."""

    def llama(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata llama.{key} is missing")
        return value

    hidden_size = int(llama("embedding_length"))
    num_heads = int(llama("attention.head_count"))
    end_ids = (_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom"))
    return LlamaHyperparameters(
        num_layers=int(llama("block_count")),
        context_length=int(llama("context_length")),
        hidden_size=hidden_size,
        intermediate_size=int(llama("feed_forward_length")),
        num_heads=num_heads,
        # llama.cpp omits head_count_kv when it equals head_count (no grouped-query attention).
        num_kv_heads=int(llama("attention.head_count_kv", num_heads)),
        head_dim=int(llama("attention.key_length", hidden_size // num_heads)),
        # 10000 is llama.cpp's default when the file does not state a base.
        rope_theta=float(llama("rope.freq_base", 10000.0)),
        rms_norm_eps=float(llama("attention.layer_norm_rms_epsilon")),
        rope_scaling=_rope_scaling(reader),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in end_ids if i is not None)),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _rope_scaling(reader: GGUFReader) -> dict[str, float | int | str] | None:
    """HF `rope_scaling` for llama.cpp's linear/yarn scaling metadata, or None when unscaled."""
    kind = _field(reader, "llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported")
    scaling: dict[str, float | int | str] = {
        "rope_type": kind,
        "factor": float(_field(reader, "llama.rope.scaling.factor")),
    }
    original = _field(reader, "llama.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_TENSORS:
        return _GGUF_GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and match[2] in _GGUF_LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_GGUF_LAYER_TENSORS[match[2]]}.weight"
    if gguf_name == "rope_freqs.weight":
        # Llama-3-style frequency scaling is stored as per-dimension factors that HF's `llama3` rope
        # parameters cannot be recovered from; silently dropping them would change long-context outputs.
        raise NotImplementedError("GGUF rope_freqs tensors (Llama 3 rope scaling) are not supported")
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from HF's rotate-half RoPE layout to interleaved
    pairs: `w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
    """
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_tensors(reader: GGUFReader, params: LlamaHyperparameters) -> dict[str, np.ndarray]:
    """All tensors under HF names, dequantized to contiguous float32 (numpy shape is HF's [out, in])."""
    heads = {"attn_q": params.num_heads, "attn_k": params.num_kv_heads}

    def convert(tensor: ReaderTensor) -> tuple[str, np.ndarray]:
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = tensor.name.split(".")[-2]  # "blk.3.attn_q.weight" -> "attn_q"
        if kind in heads:
            weight = _unpermute_rows(weight, heads[kind])
        return _hf_name(tensor.name), np.ascontiguousarray(weight)

    # numpy releases the GIL in the bulk array work of dequantization, so threads use every core.
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        return dict(pool.map(convert, reader.tensors))


def _llama_config(params: LlamaHyperparameters, vocab_size: int, tied: bool) -> LlamaConfig:
    # transformers is imported here, not at module level, so that a cache hit stays fast.
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads,
        head_dim=params.head_dim,
        max_position_embeddings=params.context_length,
        rms_norm_eps=params.rms_norm_eps,
        # Legacy keyword arguments, accepted by every supported transformers version (v5 folds them
        # into `rope_parameters`).
        rope_theta=params.rope_theta,
        rope_scaling=params.rope_scaling,
        bos_token_id=params.bos_token_id,
        eos_token_id=_one_or_list(params.eos_token_ids),
        pad_token_id=params.pad_token_id,
        tie_word_embeddings=tied,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


def _generation_config(params: LlamaHyperparameters) -> GenerationConfig:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=params.bos_token_id,
        eos_token_id=_one_or_list(params.eos_token_ids),
        pad_token_id=params.pad_token_id,
    )


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    """HF's convention for `eos_token_id`: a single id, a list of ids, or None."""
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build the tokenizer from the GGUF vocabulary with transformers' own GGUF conversion and save it.

    `PreTrainedTokenizerFast` directly, not `AutoTokenizer`: the latter also rebuilds the model config
    from the file with a second full metadata parse (~3 s); the tokenizer it returns is the same.
    This carries over the chat template, the special tokens and `add_bos_token`.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
