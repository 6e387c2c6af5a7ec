"""`pagedllm bench throughput`: one seeded workload, offline, on each engine in turn.

    pagedllm bench throughput --workload synthetic --num-prompts 128 \\
        --engines pagedllm,hf-static,hf-cb,vllm --vllm-python .venv-vllm/bin/python --out bench-results

Every engine loads the same Hugging Face folder (for the GGUF default, the dequantized folder
pagedllm writes once), in the same dtype with the same thread count, and must return exactly the
tokens the workload asks for (EOS ignored); a run that returns another count is an error, not a
row. Engines:

- pagedllm: `LLM.generate` / `LLM.beam_search`;
- hf-static: `transformers` `generate` in static batches (left padding; each batch runs to its
  longest output), the baseline of the vLLM paper;
- hf-cb: `transformers`' continuous batching on its paged cache (`init_continuous_batching`);
- vllm: vLLM in its own interpreter (`--vllm-python`), driven by `vllm_runner.py`;
- openvino: OpenVINO GenAI's `ContinuousBatchingPipeline` in its own interpreter (`--openvino-python`, a venv
  made by `scripts/install_openvino.sh`), driven by `openvino_runner.py`, on the folder exported once with
  `optimum-cli export openvino --weight-format fp16` (cached under pagedllm's cache) and computed in bf16, or
  with `--dtype float32` exported in fp32 and computed in f32. Greedy single-sample workloads only.

Load time is measured from nothing to an engine ready to take requests; throughput from the first
request to the last token. Counting tokens is not enough: on greedy workloads each engine's outputs for
the first `--check` requests are compared with `transformers` in the same dtype, and must agree up to a
first divergence where the float32 model's log-probabilities of the two tokens are within 0.2 nats (a
near-tie, `near_tie.py`), and more than half of them exactly; anything else fails the run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedllm.beam_search import BeamSearchParams
from pagedllm.benchmarks.near_tie import compare_sequences, float32_logprobs
from pagedllm.benchmarks.workloads import WORKLOADS, Workload, make_workload
from pagedllm.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEVICES,
    DTypes,
    EngineConfig,
    add_option_flag,
    resolve_dtype,
)
from pagedllm.domains import (
    NON_NEGATIVE_INTS,
    POSITIVE_INTS,
    SEEDS,
    Booleans,
    Choices,
    CommaLists,
    ExistingPaths,
    FolderPaths,
)
from pagedllm.entrypoints.llm import LLM
from pagedllm.models.config import ModelConfig
from pagedllm.models.default import default_model_file
from pagedllm.models.loader import reads_lean_folder, resolve_model_folder
from pagedllm.native import cache_root, cached_folder
from pagedllm.sampling_params import SamplingParams

ENGINES = ("pagedllm", "hf-static", "hf-cb", "vllm", "openvino")
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
OPENVINO_RUNNER = Path(__file__).with_name("openvino_runner.py")
MAX_MODEL_LEN = 4096  # the default --max-model-len, which also bounds the workloads' lengths


@dataclass(frozen=True, slots=True)
class BenchSetup:
    folder: Path  # what the peers read (a GGUF file's weights dequantized to float32)
    dtype: torch.dtype
    threads: int
    seed: int
    device: str
    max_model_len: int
    hf_batch_size: int = 16
    vllm_python: str | None = None
    openvino_python: str | None = None
    check: int = 4  # requests whose outputs are compared with the reference (greedy workloads)
    model: str | Path | None = None  # what pagedllm reads, as named (a GGUF file runs quantized); None: `folder`
    dequantize: bool | None = None  # None: the engine's default (`EngineConfig.dequantize`)
    speculative_config: dict | None = None  # pagedllm's speculative decoding, as `LLM(speculative_config=...)`
    kv_cache_dtype: str = "auto"  # "int8": pagedllm's int8 cache, OpenVINO's u8 one; the other engines have none


@dataclass(slots=True)
class EngineResult:
    engine: str
    load_seconds: float
    seconds: float
    requests_per_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    detail: dict = field(default_factory=dict)
    sample: list[list[int]] = field(default_factory=list)  # the first requests' output tokens, for the check
    check: str = "-"  # how the sample compared with the reference
    failed: bool = False  # the sample is not the reference's: the run's figures are printed, then it fails


class UnsupportedWorkload(Exception):
    """The engine has no way to run this workload (e.g. beam search in transformers' continuous batching)."""


def measure(
    engine: str, load_seconds: float, seconds: float, generated: int, workload: Workload, sample: list[list[int]]
) -> EngineResult:
    if generated != workload.output_tokens:
        raise RuntimeError(f"{engine} returned {generated} tokens where the workload asks for {workload.output_tokens}")
    return EngineResult(
        engine=engine,
        load_seconds=load_seconds,
        seconds=seconds,
        requests_per_s=len(workload.requests) / seconds,
        output_tok_per_s=workload.output_tokens / seconds,
        total_tok_per_s=(workload.prompt_tokens + workload.output_tokens) / seconds,
        sample=sample,
    )


def run_pagedllm(setup: BenchSetup, workload: Workload) -> EngineResult:
    start = time.perf_counter()
    llm = LLM(
        model=setup.folder if setup.model is None else setup.model,
        dtype=setup.dtype,
        seed=setup.seed,
        max_model_len=setup.max_model_len,
        device=setup.device,
        dequantize=setup.dequantize,
        speculative_config=setup.speculative_config,
        kv_cache_dtype=setup.kv_cache_dtype,
    )
    load_seconds = time.perf_counter() - start
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in workload.requests]
    start = time.perf_counter()
    if workload.beam_width > 1:
        params = BeamSearchParams(workload.beam_width, _single_output_len(workload), ignore_eos=True)
        outputs = llm.beam_search(prompts, params)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        sample = [o.outputs[0].token_ids for o in outputs[: setup.check]]
    else:
        sampling = [
            SamplingParams(
                n=workload.n,
                temperature=workload.temperature,
                max_tokens=r.output_len,
                ignore_eos=True,
                seed=setup.seed + i,
            )
            for i, r in enumerate(workload.requests)
        ]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        sample = [o.outputs[0].token_ids for o in outputs[: setup.check]]
    result = measure("pagedllm", load_seconds, time.perf_counter() - start, generated, workload, sample)
    stats = llm.stats()
    result.detail = {
        "steps": stats.num_steps,
        "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
        "peak_kv_blocks": stats.kv_blocks_peak,
        "preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "spec_acceptance_rate": stats.spec_acceptance_rate,
        "spec_mean_accepted_length": stats.spec_mean_accepted_length,
        "step_seconds": stats.step_seconds,
    }
    return result


def _single_output_len(workload: Workload) -> int:
    lengths = {r.output_len for r in workload.requests}
    if len(lengths) != 1:
        raise ValueError("beam search workloads ask one output length of every request")
    return lengths.pop()


def _load_hf(setup: BenchSetup, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(setup.folder, dtype=dtype).to(setup.device).eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_sampling(workload: Workload) -> dict:
    """transformers' generate arguments that match the workload's decoding: greedy, plain sampling
    at temperature 1 (no top-k / top-p, as the other engines), or beam search."""
    if workload.beam_width > 1:
        return {"do_sample": False, "num_beams": workload.beam_width, "num_return_sequences": 1}
    if workload.n > 1:
        return {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_return_sequences": workload.n}
    return {"do_sample": False}


def run_hf_static(setup: BenchSetup, workload: Workload) -> EngineResult:
    start = time.perf_counter()
    model = _load_hf(setup, setup.dtype)
    load_seconds = time.perf_counter() - start
    torch.manual_seed(setup.seed)
    generated = 0
    sample: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(workload.requests), setup.hf_batch_size):
        batch = workload.requests[first : first + setup.hf_batch_size]
        longest = max(r.output_len for r in batch)
        ids, mask = left_pad([r.prompt for r in batch])
        with torch.inference_mode():
            out = model.generate(
                ids.to(setup.device),
                attention_mask=mask.to(setup.device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
                **_hf_sampling(workload),
            )
        # The batch runs to its longest output; each request is served the tokens it asked for.
        new_tokens = out.shape[1] - ids.shape[1]
        generated += sum(min(r.output_len, new_tokens) for r in batch) * workload.n
        for row, r in enumerate(batch[: setup.check - len(sample)]):
            sample.append(out[row * workload.n, ids.shape[1] : ids.shape[1] + r.output_len].tolist())
    return measure("hf-static", load_seconds, time.perf_counter() - start, generated, workload, sample)


def left_pad(prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_hf_cb(setup: BenchSetup, workload: Workload) -> EngineResult:
    if workload.beam_width > 1:
        raise UnsupportedWorkload("transformers' continuous batching has no beam search")
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    start = time.perf_counter()
    model = _load_hf(setup, setup.dtype)
    sampling = _hf_sampling(workload)
    config = GenerationConfig(max_new_tokens=max(r.output_len for r in workload.requests), eos_token_id=-1, **sampling)
    cb_config = ContinuousBatchingConfig(
        max_batch_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS, seed=setup.seed, num_blocks=_hf_cb_blocks(workload)
    )
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.start()
    load_seconds = time.perf_counter() - start
    expected = len(workload.requests) * workload.n
    generated = finished = 0
    checked: dict[str, list[int]] = {}
    start = time.perf_counter()
    try:
        for i, r in enumerate(workload.requests):
            manager.add_request(list(r.prompt), request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1)
        while finished < expected:
            output = manager.get_result(timeout=1)
            if output is not None:
                finished += 1
                generated += len(output.generated_tokens)
                checked.setdefault(output.request_id, list(output.generated_tokens))
            elif not manager.is_running():
                raise RuntimeError("transformers' continuous batching manager stopped before finishing")
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    sample = [checked[f"r{i}"] for i in range(min(setup.check, len(workload.requests)))]
    return measure("hf-cb", load_seconds, seconds, generated, workload, sample)


def _hf_cb_blocks(workload: Workload) -> int:
    """Pages of 256 tokens enough for every sequence at once: the CPU has no GPU memory to size
    the cache from, and the harness compares batching, not preemption."""
    return sum(-(-r.final_len // 256) for r in workload.requests) * workload.n


def run_vllm(setup: BenchSetup, workload: Workload) -> EngineResult:
    if setup.vllm_python is None:
        raise ValueError("--engines vllm needs --vllm-python (the interpreter of a venv with vLLM installed)")
    job = _workload_job(setup, workload) | {
        "model": str(setup.folder),
        "dtype": str(setup.dtype).removeprefix("torch."),
        "seed": setup.seed,
        "max_model_len": setup.max_model_len,
    }
    answer = run_peer(setup.vllm_python, VLLM_RUNNER, job, vllm_env(setup.threads))
    return measure(
        "vllm", answer["load_seconds"], answer["seconds"], answer["generated_tokens"], workload, answer["sample"]
    )


def _workload_job(setup: BenchSetup, workload: Workload) -> dict:
    """What every peer's runner reads of the workload and the setup."""
    return {
        "threads": setup.threads,
        "max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        # Throughput runs without caching unless the workload is about sharing a prefix.
        "enable_prefix_caching": workload.name == "shared-prefix",
        "requests": [[list(r.prompt), r.output_len] for r in workload.requests],
        "n": workload.n,
        "temperature": workload.temperature,
        "beam_width": workload.beam_width,
        "check": setup.check,
    }


def run_peer(python: str, runner: Path, job: dict, env: dict[str, str] | None = None) -> dict:
    """Run a peer's runner script in the peer's own interpreter on `job`, and return its JSON answer."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        subprocess.run([python, str(runner), str(job_path), str(result_path)], check=True, env=env)
        return json.loads(result_path.read_text())


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's best CPU settings here: OpenMP threads bound to every core and no core reserved for
    the front end (its default binding leaves one of two cores idle). Settings already in the
    environment win, so a user can try others."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def run_openvino(setup: BenchSetup, workload: Workload) -> EngineResult:
    if setup.openvino_python is None:
        raise ValueError("--engines openvino needs --openvino-python (scripts/install_openvino.sh's python)")
    if workload.temperature > 0 or workload.n > 1 or workload.beam_width > 1:
        raise UnsupportedWorkload("measured on greedy single-sample workloads only")
    job = _workload_job(setup, workload) | {
        "model": str(openvino_export(setup.folder, Path(setup.openvino_python), _openvino_weights(setup.dtype))),
        "precision": "f32" if setup.dtype == torch.float32 else "bf16",
        "kv_cache_precision": "u8" if setup.kv_cache_dtype == "int8" else None,
        "kv_cache_gb": 4,
        "max_num_seqs": 256,
    }
    answer = run_peer(setup.openvino_python, OPENVINO_RUNNER, job)
    return measure(
        "openvino", answer["load_seconds"], answer["seconds"], answer["generated_tokens"], workload, answer["sample"]
    )


def _openvino_weights(dtype: torch.dtype) -> str:
    """fp32 weights for a float32 run (the same model as transformers'), else fp16 (OpenVINO's own choice for
    bf16 compute)."""
    return "fp32" if dtype == torch.float32 else "fp16"


def openvino_export(folder: Path, python: Path, weight_format: str) -> Path:
    """The model folder as OpenVINO IR, exported once by the venv's `optimum-cli` and kept in pagedllm's cache
    (keyed by the folder, its weights' sizes and times, and the weight format)."""
    weights = sorted(folder.glob("*.safetensors"))
    stamp = [str(folder.resolve()), weight_format]
    stamp += [f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights]
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]

    def export(staging: Path) -> dict:
        cli = python.parent / "optimum-cli"
        task = ["--task", "text-generation-with-past", "--weight-format", weight_format]
        subprocess.run([str(cli), "export", "openvino", "--model", str(folder), *task, str(staging)], check=True)
        return {"source": str(folder), "weight_format": weight_format}

    return cached_folder(cache_root() / "openvino", key, export)


# The engines with an int8 KV cache: pagedllm's symmetric rows (`kv_quant`), OpenVINO's u8 (asymmetric groups).
INT8_KV_ENGINES = ("pagedllm", "openvino")
RUNNERS = {
    "pagedllm": run_pagedllm,
    "hf-static": run_hf_static,
    "hf-cb": run_hf_cb,
    "vllm": run_vllm,
    "openvino": run_openvino,
}


def run_engines(setup: BenchSetup, workload: Workload, engines: list[str]) -> list[EngineResult | str]:
    """One result per engine, in order; an engine that cannot run the workload gives its reason instead.
    Each result's sample is then checked against the reference."""
    results: list[EngineResult | str] = []
    for engine in engines:
        if setup.kv_cache_dtype == "int8" and engine not in INT8_KV_ENGINES:
            results.append(f"{engine}: no int8 KV cache")
            continue
        try:
            results.append(RUNNERS[engine](setup, workload))
        except UnsupportedWorkload as reason:
            results.append(f"{engine}: {reason}")
        gc.collect()  # each engine's model and cache go before the next one loads
    check_samples(setup, workload, [r for r in results if isinstance(r, EngineResult)])
    return results


def check_samples(setup: BenchSetup, workload: Workload, results: list[EngineResult]) -> None:
    """Compare each engine's sample with `transformers` greedy in the same dtype: equal, or parted at a
    near-tie of the float32 model (`near_tie.py`), and more than half of them equal; any other divergence, or
    fewer equal, fails the engine's result (its figures are still printed; the command then exits 1).
    Sampled and beam workloads are not checked (their tokens depend on each engine's random numbers or beam
    rules).

    pagedllm holding a GGUF file's weights quantized, in a reduced precision, is not the model transformers
    holds in that precision (which rounds the weights): it is compared with the float32 model, whose weights
    are its own, where every divergence must be a near-tie but none need be equal: on so few sequences a bf16
    model parts at a near-tie about as often as not (transformers bf16 itself: 7 of 12 equal on the default
    model), and `bench accuracy` is what measures how near this path is to float32. OpenVINO's fp16 export
    computed in bf16 is judged the same way, and so is every engine on an int8 KV cache."""
    if workload.temperature > 0 or workload.beam_width > 1 or setup.check == 0 or not results:
        for result in results:
            result.check = "not checked"
        return
    requests = workload.requests[: setup.check]
    judge = _Float32Judge(setup)
    references = {setup.dtype: _references(setup, setup.dtype, requests)}
    for result in results:
        dtype, needed = setup.dtype, min_exact(len(requests))
        reduced = _rounds_other_weights(result.engine, setup) and setup.dtype != torch.float32
        if reduced or setup.kv_cache_dtype == "int8":
            dtype, needed = torch.float32, 0
            references.setdefault(dtype, _references(setup, dtype, requests))
        comparison = _compare(result.sample, references[dtype], requests, judge)
        near = f", {comparison.near_ties} near-tie" + "s" * (comparison.near_ties != 1) if comparison.near_ties else ""
        against = "" if dtype == setup.dtype else " against float32"
        result.check = f"{comparison.exact}/{len(requests)} exact{near}{against}"
        if comparison.failures:
            result.check, result.failed = "FAILED: " + "; ".join(comparison.failures), True
        elif comparison.exact < needed:
            result.check, result.failed = f"FAILED: {result.check}, at least {needed} exact needed", True


def _rounds_other_weights(engine: str, setup: BenchSetup) -> bool:
    """Whether the engine's weights are not transformers' in the workload's dtype: pagedllm holding a GGUF
    file's quantized blocks, or OpenVINO's fp16 export computed in bf16."""
    return (engine == "openvino" and setup.dtype != torch.float32) or (engine == "pagedllm" and _holds_quantized(setup))


def _holds_quantized(setup: BenchSetup) -> bool:
    """Whether pagedllm holds a GGUF file's weights as stored (the default for a GGUF file)."""
    model = setup.model
    return model is not None and Path(model).suffix == ".gguf" and reads_lean_folder(setup.device, 1, setup.dequantize)


def _references(setup: BenchSetup, dtype: torch.dtype, requests: list) -> list[list[int]]:
    model = _load_hf(setup, dtype)
    return [_reference(model, r.prompt, r.output_len) for r in requests]


def _compare(samples: list, references: list[list[int]], requests: list, judge: _Float32Judge):
    pairs = list(zip(samples, references, strict=True))
    return compare_sequences(pairs, lambda i, at: judge.logprobs([*requests[i].prompt, *references[i][:at]]))


def min_exact(checked: int) -> int:
    """Most of the checked sequences: a near-tie excuses a rounding difference now and then, but an engine
    whose every sequence parts at one is off everywhere, by a little."""
    return checked // 2 + 1


class _Float32Judge:
    """The float32 model's log-probabilities after a context, loaded on the first divergence only."""

    def __init__(self, setup: BenchSetup) -> None:
        self.setup = setup
        self.model = None

    def logprobs(self, context: list[int]) -> torch.Tensor:
        if self.model is None:
            self.model = _load_hf(self.setup, torch.float32)
        return float32_logprobs(self.model, context)


def _reference(model, prompt: tuple[int, ...], output_len: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def add_bench_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="synthetic", **Choices(WORKLOADS).flag_kwargs())
    parser.add_argument("--num-prompts", default=128, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--engines",
        default=("pagedllm", "hf-static"),
        help=f"comma-separated, from {','.join(ENGINES)}",
        **CommaLists(Choices(ENGINES)).flag_kwargs(),
    )
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf (default: embedded SmolLM2-135M)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument("--dtype", default="auto", **DTypes().flag_kwargs())
    parser.add_argument(
        "--dequantize",
        default=None,
        help="pagedllm dequantizes a GGUF file's weights at load (default: the engine's choice, see `pagedllm "
        "generate --help`)",
        **Booleans().flag_kwargs(),
    )
    add_option_flag(parser, EngineConfig, "speculative_config")
    add_option_flag(parser, EngineConfig, "kv_cache_dtype")
    parser.add_argument("--threads", default=torch.get_num_threads(), **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--seed", default=0, **SEEDS.flag_kwargs())
    parser.add_argument("--device", default="cpu", **Choices(DEVICES).flag_kwargs())
    parser.add_argument("--max-model-len", default=MAX_MODEL_LEN, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--hf-batch-size", default=16, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of the venv holding vLLM (see docs/VLLM_CPU.md)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument(
        "--openvino-python",
        default=None,
        help="python of the venv holding OpenVINO GenAI (scripts/install_openvino.sh)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument(
        "--check", default=4, help="requests checked against transformers (greedy)", **NON_NEGATIVE_INTS.flag_kwargs()
    )
    parser.add_argument(
        "--out", default=None, help="folder for throughput.json and throughput.png", **FolderPaths().flag_kwargs()
    )


def run_bench_throughput(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    folder = resolve_model_folder(args.model)
    model_config = ModelConfig.from_folder(folder)
    max_model_len = min(args.max_model_len, model_config.max_position_embeddings)
    setup = BenchSetup(
        folder=folder,
        dtype=resolve_dtype(args.dtype),
        threads=args.threads,
        seed=args.seed,
        device=args.device,
        max_model_len=max_model_len,
        hf_batch_size=args.hf_batch_size,
        vllm_python=args.vllm_python,
        openvino_python=args.openvino_python,
        check=args.check,
        model=default_model_file() if args.model is None else args.model,
        dequantize=args.dequantize,
        speculative_config=args.speculative_config,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    workload = make_workload(args.workload, args.num_prompts, model_config.vocab_size, max_model_len, args.seed)
    results = run_engines(setup, workload, list(args.engines))
    print(format_table(workload, setup, results))
    if args.out is not None:
        write_results(args.out, workload, setup, results)
    failed = [r for r in results if isinstance(r, EngineResult) and r.failed]
    for result in failed:
        print(f"{result.engine}: outputs {result.check}", file=sys.stderr)
    return 1 if failed else 0


def format_table(workload: Workload, setup: BenchSetup, results: list[EngineResult | str]) -> str:
    rows = [r for r in results if isinstance(r, EngineResult)]
    paged = next((r for r in rows if r.engine == "pagedllm"), None)
    lines = [
        f"workload {workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens} prompt tokens, "
        f"{workload.output_tokens} output tokens; {setup.dtype}, KV cache {setup.kv_cache_dtype}, "
        f"{setup.threads} threads, {setup.device}",
        f"{'engine':<10} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'load s':>7} {'run s':>8} "
        f"{'pagedllm ×':>11}  outputs",
    ]
    for r in rows:
        ratio = f"{paged.output_tok_per_s / r.output_tok_per_s:>10.2f}×" if paged else f"{'-':>11}"
        lines.append(
            f"{r.engine:<10} {r.requests_per_s:>8.3f} {r.output_tok_per_s:>10.1f} {r.total_tok_per_s:>12.1f} "
            f"{r.load_seconds:>7.1f} {r.seconds:>8.1f} {ratio}  {r.check}"
        )
    lines += [f"not run: {r}" for r in results if isinstance(r, str)]
    return "\n".join(lines)


def write_results(out: Path, workload: Workload, setup: BenchSetup, results: list[EngineResult | str]) -> None:
    from pagedllm.benchmarks.plots import plot_throughput

    out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in results if isinstance(r, EngineResult)]
    report = {
        "workload": workload.name,
        "num_requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
        "model": str(setup.folder),
        "dtype": str(setup.dtype),
        "kv_cache_dtype": setup.kv_cache_dtype,
        "threads": setup.threads,
        "device": setup.device,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "results": rows,
        "not_run": [r for r in results if isinstance(r, str)],
    }
    (out / "throughput.json").write_text(json.dumps(report, indent=2))
    if rows:
        plot_throughput(rows, out / "throughput.png")
