"""Building a model, its config and tokenizer from a Hugging Face folder or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}

# Checkpoint names fused into one matrix here: (target, [parts in order]).
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    folder: Path


def resolve_model_folder(model: str | Path | None) -> Path:
    """`None` is the embedded default; a `.gguf` file is converted once to a cached HF folder."""
    from pagedllm.models.default import default_model_file
    from pagedllm.models.gguf import gguf_to_hf_folder

    path = default_model_file() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_folder(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {str(path)!r} is neither a .gguf file nor a folder with config.json")
    return path


def load_model(model: str | Path | None, dtype: torch.dtype, device: str = "cpu") -> LoadedModel:
    folder = resolve_model_folder(model)
    config = ModelConfig.from_folder(folder)
    if not set(config.architectures) & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {list(config.architectures)}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    # Parameters start as uninitialised (untouched) memory; the checkpoint's tensors replace them.
    net = LlamaForCausalLM(config)
    net.load_state_dict(_read_state_dict(folder, net, dtype), assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    tokenizer = AutoTokenizer.from_pretrained(folder)
    net = net.to(device).eval().requires_grad_(False)
    net.prepack()
    return LoadedModel(net, config, tokenizer, folder)


def _read_state_dict(folder: Path, net: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    raw = _read_checkpoint(folder)
    return {name: _checkpoint_tensor(raw, name).to(dtype) for name in net.state_dict(keep_vars=True)}


def _checkpoint_tensor(raw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Our parameter `name` from checkpoint tensors: renamed (`model.` prefix) or concatenated (fused)."""
    for fused, parts in _FUSED.items():
        if fused in name:
            pieces = [_lookup(raw, name.replace(fused, part)) for part in parts]
            return torch.cat(pieces, dim=0)
    return _lookup(raw, name)


def _lookup(raw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name == "lm_head.weight":
        if "lm_head.weight" in raw:
            return raw["lm_head.weight"]
        return raw["model.embed_tokens.weight"]
    key = f"model.{name}"
    if key not in raw:
        raise KeyError(f"checkpoint lacks {key}")
    return raw[key]


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = handle.get_tensor(key)
    return tensors
