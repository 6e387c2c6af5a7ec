"""Engine configuration: one dataclass, validated once, with the defaults a CPU user wants. It is the
only place an engine option is named; `add_dataclass_args` turns any such option list into CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch

DEFAULT_KV_CACHE_MEMORY = 4 << 30  # bytes; the same default as vLLM's CPU backend
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
PREEMPTION_MODES = ("recompute", "swap")
DEVICES = ("cpu", "cuda")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def option(default: object, help: str, **extra: object) -> Any:
    """A config field with the help text the CLI shows for it (and, in `extra`, e.g. `choices`)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(slots=True)
class EngineConfig:
    """Every engine option, named once: `LLM(**options)`, the CLI flags and the server read this list."""

    model: str | Path | None = option(None, "HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    dtype: str | torch.dtype = option(
        "auto", "auto (bfloat16 where the CPU has native bf16, else float32), " + ", ".join(_DTYPES)
    )
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV blocks in the pool (default: from kv_cache_memory)")
    kv_cache_memory: int | None = option(None, "bytes of KV cache (default 4 GiB)")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's, capped by the pool)")
    max_num_seqs: int = option(256, "most sequences running at once")
    max_num_batched_tokens: int | None = option(
        None, f"most tokens per step; longer prompts prefill in chunks (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})"
    )
    seed: int = option(0, "seed of the random generators of unseeded requests")
    enable_prefix_caching: bool = option(True, "reuse cached prompt blocks")
    preemption_mode: str = option("recompute", "what preemption does with a request's KV", choices=PREEMPTION_MODES)
    swap_space: float = option(4.0, "GiB of CPU memory for blocks swapped out (preemption_mode swap)")
    device: str = option("cpu", "cuda runs the model and KV cache on the GPU with the Triton kernels", choices=DEVICES)
    tensor_parallel_size: int = option(1, "ranks that each hold a slice of every layer and of every KV block")
    threads_per_worker: int | None = option(None, "torch threads of each rank (default: the cores divided among them)")
    distributed_timeout: float = option(
        120.0, "seconds a rank waits for the others (start-up, each step) before the engine fails"
    )
    master_addr: str = option("127.0.0.1", "address where the tensor-parallel ranks meet (rank 0's)")
    master_port: int | None = option(None, "port where the ranks meet (default: a free one; required with nnodes > 1)")
    kv_events_file: str | None = option(
        None, "append KV events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared) to this JSON-lines file"
    )
    nnodes: int = option(1, "machines the tensor-parallel ranks are spread over (the engine runs on node 0)")
    node_rank: int = option(0, "this machine's index among nnodes (`pagedllm worker` on nodes 1 ..)")

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("max_num_seqs", self.max_num_seqs)
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        resolve_dtype(self.dtype)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.threads_per_worker is not None:
            _require_positive("threads_per_worker", self.threads_per_worker)
        if (
            self.tensor_parallel_size > 1
            and self.device == "cuda"
            and self.tensor_parallel_size > torch.cuda.device_count()
        ):
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} exceeds the {torch.cuda.device_count()} GPUs"
            )
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int | float) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """The server's own options (`pagedllm serve` flags come from this list, as the engine's do)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (not /health, /metrics)")
    served_model_names: tuple[str, ...] = option((), "default: the --model argument", flag="--served-model-name")
    shutdown_grace_s: float = option(5.0, "seconds in-flight requests get after SIGTERM", flag="--shutdown-grace")
    log_level: str = option("warning", "uvicorn's log level (the CLI's --log-level)")
    max_body_bytes: int = option(16 << 20, "largest request body accepted; larger ones get HTTP 413 unread")
    max_waiting_requests: int = option(
        1024, "requests waiting for their first token beyond which new ones get HTTP 503 with Retry-After"
    )
    metrics_need_key: bool = option(False, "with --api-key, /metrics needs the key too (/health never does)")
    tool_call_parser: str = option(
        "auto",
        "how chat replies' tool calls are read; auto: llama3_json for Llama 3 templates, else hermes",
        choices=("auto", "hermes", "llama3_json"),
    )
    # What one request may ask for: over these, a 400 names the field and the flag.
    max_n: int = option(16, "largest n and best_of (and beam width): the sequences one prompt may run at once")
    max_logprobs: int = option(20, "largest logprobs, top_logprobs and prompt_logprobs (vLLM's --max-logprobs)")
    max_stop: int = option(64, "most stop strings, and most stop_token_ids, in one request")
    max_stop_len: int = option(1024, "longest stop string, in characters")
    max_prompts: int = option(2048, "most prompts in one completions request (each becomes a request)")

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_stop_len", "max_prompts"):
            _require_positive(name, getattr(self, name))
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")

    def model_names(self, model: str | Path | None) -> tuple[str, ...]:
        return self.served_model_names or (str(model) if model is not None else DEFAULT_SERVED_NAME,)


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() or torch.cuda.is_available() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def cpu_has_native_bf16() -> bool:
    """bf16 pays on the CPU only with hardware support (AVX-512 BF16 or AMX); otherwise it is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def add_dataclass_args(parser: argparse.ArgumentParser, options: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `options`: `--field-name`, typed by its annotation, with its
    default, and the help, choices and flag name (`flag`) of its metadata."""
    hints = get_type_hints(options)
    for spec in fields(options):
        if spec.name in skip:
            continue
        flag = spec.metadata.get("flag", "--" + spec.name.replace("_", "-"))
        kind = _flag_type(hints[spec.name])
        extra: dict[str, Any] = {"help": spec.metadata.get("help"), "dest": spec.name}
        if kind is bool:
            extra["action"] = argparse.BooleanOptionalAction
        elif kind is tuple:
            extra["nargs"] = "+"
        else:
            extra["type"] = kind
        if "choices" in spec.metadata:
            extra["choices"] = spec.metadata["choices"]
        default = spec.default if spec.default is not MISSING else None
        parser.add_argument(flag, default=default, **extra)


def option_values(options: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the fields of `options` that `args` holds (the flags `add_dataclass_args` made)."""
    values = {spec.name: getattr(args, spec.name) for spec in fields(options) if hasattr(args, spec.name)}
    return {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}


def _flag_type(annotation: Any) -> type:
    """bool, int, float or tuple where the annotation (less `None`) is one; str for everything else."""
    union = get_origin(annotation) in (Union, UnionType)
    kinds = [kind for kind in (get_args(annotation) if union else (annotation,)) if kind is not type(None)]
    origin = [get_origin(kind) or kind for kind in kinds]
    for kind in (bool, int, float, tuple):
        if origin == [kind]:
            return kind
    return str
