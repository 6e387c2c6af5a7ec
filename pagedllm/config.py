"""Engine configuration: one dataclass, validated once, with the defaults a CPU user wants. It is the
only place an engine option is named; `add_dataclass_args` turns any such option list into CLI flags.
Each field carries its domain (`domains.py`): the list and its flags refuse a value outside it alike."""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import torch

from pagedllm import speculative
from pagedllm.domains import (
    INT64_MAX,
    NON_NEGATIVE_INTS,
    PORTS,
    POSITIVE_INTS,
    SEEDS,
    WAITS,
    ArgType,
    Booleans,
    Choices,
    Domain,
    ExistingPaths,
    FilePaths,
    Hosts,
    Integers,
    JsonObjects,
    Reals,
    Texts,
    Tuples,
)
from pagedllm.pooling_params import TASKS

DEFAULT_KV_CACHE_MEMORY = 4 << 30  # bytes; the same default as vLLM's CPU backend
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
PREEMPTION_MODES = ("recompute", "swap")
QUANTIZATIONS = ("int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8")
DEVICES = ("cpu", "cuda")
# uvicorn's levels less its "trace": the same flag sets Python's logging, which has no such level.
EXECUTOR_BACKENDS = ("mp", "ray")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True, slots=True)
class DTypes(Domain):
    """`auto` or a floating-point type: by name, or from Python as the torch.dtype itself."""

    def describe(self) -> str:
        return "auto or one of " + ", ".join(_DTYPES) + " (from Python, also their torch dtypes)"

    def admits(self, value: object) -> bool:
        if isinstance(value, torch.dtype):
            return value in _DTYPES.values()
        return isinstance(value, str) and (value == "auto" or value in _DTYPES)

    def flag_kwargs(self) -> dict[str, Any]:
        return {"type": ArgType(self), "metavar": "{auto," + ",".join(_DTYPES) + "}"}


@dataclass(frozen=True, slots=True)
class LoRAModules(Domain):
    """vLLM's `--lora-modules` item: `name=path`, the name one a request's `model` field can give (no `=`, no
    surrounding whitespace) and the path an existing folder (the adapter's files are checked at start)."""

    def describe(self) -> str:
        return "name=path, a non-empty name without '=' or surrounding whitespace and an existing folder"

    def admits(self, value: object) -> bool:
        if not isinstance(value, str) or "=" not in value:
            return False
        name, path = value.split("=", 1)
        try:
            folder = Path(path).expanduser()
        except RuntimeError:  # "~name" of no such user
            return False
        return Texts().admits(name) and path != "" and os.path.isdir(folder)


def option(default: object, help: str, *, domain: Domain, flag: str | None = None) -> Any:
    """A field of an option list: its default, the help text the CLI shows, the values it can mean (None
    too, where its type says `| None`) and, where `--field-name` will not do, its flag."""
    return field(default=default, metadata={"help": help, "domain": domain, "flag": flag})


@dataclass(slots=True)
class EngineConfig:
    """Every engine option, named once: `LLM(**options)`, the CLI flags and the server read this list."""

    model: str | Path | None = option(
        None, "HF folder or .gguf file (default: the embedded SmolLM2-135M)", domain=ExistingPaths()
    )
    task: str = option(
        "auto",
        "what the engine runs: generate (text), embed (a vector per prompt: /v1/embeddings, LLM.embed) or score "
        "(a relevance score per query and document: /v1/score, /v1/rerank, LLM.score); auto reads the checkpoint "
        "(a *ForSequenceClassification architecture or classifier_from_token: score; sentence-transformers' "
        "modules.json or a bare *Model: embed; else generate)",
        domain=Choices(TASKS),
    )
    pooling_stretch: float = option(
        0.5,
        "while generation runs, how much longer a step may take for the pooling prompts (embeddings, scores) beside "
        "it, as a share of its time without them: 0.5 lets a flood of embeddings cost a stream at most 1.5x its "
        "time per token (measured as the engine runs); pooling prompts alone get the whole token budget",
        domain=Reals(0.0, 100.0),
    )
    dtype: str | torch.dtype = option(
        "auto", "auto (bfloat16 where the CPU has native bf16, else float32), " + ", ".join(_DTYPES), domain=DTypes()
    )
    block_size: int = option(16, "tokens per KV block", domain=POSITIVE_INTS)
    num_kv_blocks: int | None = option(
        None, "KV blocks in the pool (default: from kv_cache_memory)", domain=POSITIVE_INTS
    )
    kv_cache_memory: int | None = option(None, "bytes of KV cache (default 4 GiB)", domain=Integers(1, INT64_MAX))
    max_model_len: int | None = option(
        None, "longest prompt + output (default: the model's, capped by the pool)", domain=POSITIVE_INTS
    )
    max_num_seqs: int = option(256, "most sequences running at once", domain=POSITIVE_INTS)
    max_num_batched_tokens: int | None = option(
        None,
        f"most tokens per step; longer prompts prefill in chunks (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
        domain=POSITIVE_INTS,
    )
    seed: int = option(0, "seed of the random generators of unseeded requests", domain=SEEDS)
    dequantize: bool | None = option(
        None,
        "a GGUF file's quantized weights dequantized to dtype at load (True), or held and computed as stored only "
        "(False); default: as stored, and where no integer kernel takes dtype on this CPU (bfloat16 with "
        "AVX512-VNNI does) a dequantized copy beside for products of more than a few rows, unless the copies would "
        "take over a quarter of the memory available",
        domain=Booleans(),
    )
    quantization: str | None = option(
        None,
        "quantize the linear layers and embedding of an HF checkpoint (or a GGUF file's unquantized ones) once at "
        "load: int8 (Q8_0, 8-bit values in blocks of 32 with a scale each) or int4 (Q4_0, 4-bit)",
        domain=Choices(QUANTIZATIONS),
    )
    int16_activations: bool | None = option(
        None,
        "products on a GGUF file's (or `quantization`'s) blocks quantize their activations to int16 per block of "
        "32 and multiply in integers, where this CPU has such a kernel for dtype: float32 on Q4_0, Q4_1 and Q8_0 "
        "blocks (AVX2), bfloat16 on repacked ones (AVX512-VNNI); default: yes; False: the product with the "
        "dequantized weights in dtype",
        domain=Booleans(),
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model's dtype) or int8 (8-bit K/V with a float32 scale per token and KV head: "
        "about twice the blocks in the same memory)",
        domain=Choices(KV_CACHE_DTYPES),
    )
    enable_prefix_caching: bool = option(True, "reuse cached prompt blocks", domain=Booleans())
    preemption_mode: str = option(
        "recompute", "what preemption does with a request's KV", domain=Choices(PREEMPTION_MODES)
    )
    swap_space: float = option(
        4.0,
        "GiB of CPU memory for blocks swapped out (preemption_mode swap)",
        domain=Reals(0.0, INT64_MAX >> 30),  # its bytes are an int64
    )
    device: str = option(
        "cpu", "cuda runs the model and KV cache on the GPU with the Triton kernels", domain=Choices(DEVICES)
    )
    tensor_parallel_size: int = option(
        1, "ranks that each hold a slice of every layer and of every KV block", domain=POSITIVE_INTS
    )
    threads_per_worker: int | None = option(
        None, "torch threads of each rank (default: the cores divided among them)", domain=POSITIVE_INTS
    )
    distributed_executor_backend: str = option(
        "mp",
        "how the ranks run: mp (processes on this machine, `pagedllm worker` on the others) or ray (Ray actors in a "
        "placement group; with `serve`, also what runs --data-parallel-size replicas)",
        domain=Choices(EXECUTOR_BACKENDS),
    )
    distributed_timeout: float = option(
        120.0, "seconds a rank waits for the others (start-up, each step) before the engine fails", domain=WAITS
    )
    master_addr: str = option("127.0.0.1", "address where the tensor-parallel ranks meet (rank 0's)", domain=Hosts())
    master_port: int | None = option(
        None, "port where the ranks meet (default: a free one; required with nnodes > 1)", domain=PORTS
    )
    kv_events_file: str | Path | None = option(
        None,
        "append KV events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared) to this JSON-lines file",
        domain=FilePaths(),
    )
    nnodes: int = option(
        1, "machines the tensor-parallel ranks are spread over (the engine runs on node 0)", domain=POSITIVE_INTS
    )
    node_rank: int = option(
        0, "this machine's index among nnodes (`pagedllm worker` on nodes 1 ..)", domain=NON_NEGATIVE_INTS
    )
    speculative_config: dict[str, Any] | None = option(
        None,
        "speculative decoding, vLLM's settings as JSON: "
        '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B} '
        "guesses K tokens from the sequence's own earlier text and checks them in one step; "
        f"disable_by_batch_size (default {speculative.DEFAULT_DISABLE_BY_BATCH_SIZE}) turns it off above that many "
        "running sequences",
        domain=JsonObjects(speculative.KEYS),
    )
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT folders) on top of the model, per request", domain=Booleans()
    )
    max_loras: int = option(1, "LoRA adapters one step may run (slots held in memory)", domain=POSITIVE_INTS)
    max_lora_rank: int = option(16, "highest rank of a LoRA adapter (every slot is this rank)", domain=POSITIVE_INTS)
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded in CPU memory (default: max_loras)", domain=POSITIVE_INTS
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora runs on one rank only (tensor_parallel_size 1)")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if (
            self.tensor_parallel_size > 1
            and self.device == "cuda"
            and self.tensor_parallel_size > torch.cuda.device_count()
        ):
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} exceeds the {torch.cuda.device_count()} GPUs"
            )
        if self.quantization is not None and (self.device != "cpu" or self.tensor_parallel_size > 1):
            raise ValueError(
                f"quantization {self.quantization!r} runs on one CPU rank only (device {self.device!r}, "
                f"tensor_parallel_size {self.tensor_parallel_size})"
            )
        if self.speculative_config is not None:
            settings = speculative.SpeculativeConfig.from_dict(self.speculative_config)
            if settings.model is not None and self.tensor_parallel_size > 1:
                raise ValueError("speculative_config: a draft model runs on one rank only (tensor_parallel_size 1)")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("with distributed_executor_backend ray, Ray places the ranks: leave nnodes at 1")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be below nnodes ({self.nnodes}), got {self.node_rank}")
        # Every node runs the same number of ranks (`worker.group.follower_specs`).
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes, got {self.nnodes}"
            )
        # A free port chosen on node 0 could not be told to the other nodes.
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(f"master_port is required with nnodes > 1 (nnodes is {self.nnodes})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)


# The names of entrypoints/openai's tool_parsers and reasoning_parsers (kept here, below them in the import order;
# tests/test_tool_parsers.py and tests/test_reasoning_parsers.py check that they agree).
TOOL_CALL_PARSERS = (
    "auto",
    "hermes",
    "llama3_json",
    "llama4_json",
    "mistral",
    "pythonic",
    "llama4_pythonic",
    "phi4_mini_json",
    "functiongemma",
)
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """The server's own options (`pagedllm serve` flags come from this list, as the engine's do)."""

    host: str = option("127.0.0.1", "address to listen on", domain=Hosts())
    port: int = option(8000, "port to listen on", domain=PORTS)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (not /health, /metrics)", domain=Texts())
    served_model_names: tuple[str, ...] = option(
        (), "default: the --model argument", domain=Tuples(Texts()), flag="--served-model-name"
    )
    shutdown_grace_s: float = option(
        5.0,
        "seconds in-flight requests get after SIGTERM",
        domain=Reals(0.0, WAITS.high),
        flag="--shutdown-grace",
    )
    log_level: str = option(
        "warning",
        "log level of pagedllm's messages and, under serve, uvicorn's",
        domain=Choices(LOG_LEVELS, fold_case=True),
    )
    max_body_bytes: int = option(
        16 << 20, "largest request body accepted; larger ones get HTTP 413 unread", domain=Integers(1, INT64_MAX)
    )
    # At 0 the server would refuse every request.
    max_waiting_requests: int = option(
        1024,
        "requests waiting for their first token beyond which new ones get HTTP 503 with Retry-After",
        domain=POSITIVE_INTS,
    )
    metrics_need_key: bool = option(
        False, "with --api-key, /metrics needs the key too (/health never does)", domain=Booleans()
    )
    tool_call_parser: str = option(
        "auto",
        "how replies' tool calls are read; auto: from the chat template's markers (hermes when none)",
        domain=Choices(TOOL_CALL_PARSERS),
    )
    reasoning_parser: str = option(
        "auto",
        "how a reasoning model's thinking is split from its answer (reasoning_content, reasoning items); auto: "
        "from the chat template where it is unambiguous (qwen3, deepseek_r1), none: never",
        domain=Choices(REASONING_PARSERS),
    )
    trust_request_chat_template: bool = option(
        False,
        "let requests bring their own chat_template (vLLM's flag; a template is code run on the server)",
        domain=Booleans(),
    )
    max_stored_responses: int = option(
        1000, "most /v1/responses kept for previous_response_id and GET (oldest out first)", domain=POSITIVE_INTS
    )
    max_stored_response_bytes: int = option(
        64 << 20,
        "most bytes of stored /v1/responses, their conversations included (oldest out first)",
        domain=Integers(1, INT64_MAX),
    )
    # What one request may ask for: over these, a 400 names the field and the flag.
    max_n: int = option(
        16, "largest n and best_of (and beam width): the sequences one prompt may run at once", domain=POSITIVE_INTS
    )
    max_logprobs: int = option(
        20, "largest logprobs, top_logprobs and prompt_logprobs (vLLM's --max-logprobs)", domain=NON_NEGATIVE_INTS
    )
    max_stop: int = option(64, "most stop strings, and most stop_token_ids, in one request", domain=POSITIVE_INTS)
    max_stop_len: int = option(1024, "longest stop string, in characters", domain=POSITIVE_INTS)
    max_prompts: int = option(
        2048,
        "most prompts in one completions request, and inputs in one embeddings request (each becomes a request)",
        domain=POSITIVE_INTS,
    )
    max_score_documents: int = option(
        1000,
        "most documents in one /v1/score or /v1/rerank request (each pair becomes a request)",
        domain=POSITIVE_INTS,
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters served from the start, each name=path (a PEFT folder); a request's model field names one "
        "(needs --enable-lora)",
        domain=Tuples(LoRAModules()),
    )

    # Replicas on Ray Serve (`--distributed-executor-backend ray`).
    data_parallel_size: int = option(
        1, "engine replicas behind the one endpoint (needs the ray backend)", domain=POSITIVE_INTS
    )
    ray_address: str | None = option(
        None, "the Ray cluster to run on (default: start a local one and stop it on exit)", domain=Texts()
    )
    min_replicas: int | None = option(
        None, "autoscale the replicas from this many (with --max-replicas)", domain=POSITIVE_INTS
    )
    max_replicas: int | None = option(None, "autoscale the replicas up to this many", domain=POSITIVE_INTS)
    target_ongoing_requests: float = option(
        16.0, "autoscaling adds replicas while each has more requests in flight than this", domain=Reals(0.1, 1e6)
    )

    def __post_init__(self) -> None:
        check_options(self)
        names = [name for name, _ in self.lora_module_paths()]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ValueError(f"lora_modules names the adapter {duplicate!r} more than once")

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """`lora_modules` as (name, path) pairs."""
        return [(name, path) for name, path in (module.split("=", 1) for module in self.lora_modules)]

    def model_names(self, model: str | Path | None) -> tuple[str, ...]:
        return self.served_model_names or (str(model) if model is not None else DEFAULT_SERVED_NAME,)


def check_options(options: Any) -> None:
    """ValueError naming the first field of the option list `options` (a dataclass instance) outside its domain."""
    for spec in fields(options):
        check_option(type(options), spec.name, getattr(options, spec.name))


def check_option(options: type, name: str, value: object) -> None:
    """ValueError naming `name` and `value` unless `value` is in the domain of field `name` of `options`, or is
    None where that field's type allows it (None is "not given": the default decides)."""
    domain = domain_of(options, name)
    if value is None and name in _optional_fields(options):
        return
    if not domain.admits(value):
        raise ValueError(f"{name} must be {domain.describe()}, got {value!r}")


def domain_of(options: type, name: str) -> Domain:
    spec = _field(options, name)
    if not isinstance(spec.metadata.get("domain"), Domain):
        raise TypeError(f"{options.__name__}.{name} has no domain: declare it with option(default, help, domain=...)")
    return spec.metadata["domain"]


def _field(options: type, name: str) -> Field:
    return next(spec for spec in fields(options) if spec.name == name)


@functools.cache
def _optional_fields(options: type) -> frozenset[str]:
    return frozenset(name for name, hint in get_type_hints(options).items() if type(None) in get_args(hint))


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
    """One flag per field of the option list `options` (a dataclass), as `add_option_flag` makes it."""
    for spec in fields(options):
        if spec.name not in skip:
            add_option_flag(parser, options, spec.name)


def add_option_flag(parser: argparse.ArgumentParser, options: type, name: str) -> None:
    """The flag of field `name` of `options`: `--field-name` (or its `flag`), with its default and help; its
    domain decides the rest (a value, several, or none for a boolean) and refuses text outside it."""
    spec = _field(options, name)
    flag = spec.metadata.get("flag") or "--" + name.replace("_", "-")
    default = spec.default if spec.default is not MISSING else None
    flag_kwargs = domain_of(options, name).flag_kwargs()
    parser.add_argument(flag, dest=name, default=default, help=spec.metadata["help"], **flag_kwargs)


def option_values(options: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the fields of `options` that `args` holds (the flags `add_dataclass_args` made)."""
    values = {spec.name: getattr(args, spec.name) for spec in fields(options) if hasattr(args, spec.name)}
    return {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}
