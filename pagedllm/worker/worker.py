"""The worker: carries out one `SchedulerOutput` on the tensors and returns one `ModelOutput`.

It moves and copies blocks, runs the model once over the step's flat batch, and picks a token (or a
beam's candidates) for every sample row. Every path from logits to tokens and log-probabilities goes
through the sampler here; nothing above the worker touches logits.
"""

from __future__ import annotations

import time

import torch

from pagedllm.models.decoder import CausalLM
from pagedllm.outputs import Logprob
from pagedllm.sequence import Sequence
from pagedllm.step import ModelOutput, RowOutput, SampleRow, SchedulerOutput
from pagedllm.worker.cache_engine import CacheEngine, KVShape
from pagedllm.worker.model_runner import ModelRunner, PromptRows, build_batch
from pagedllm.worker.sampler import Sampler, SamplingRow, token_logprobs, top_logprobs

# Prompt positions scored per logits pass: bounds the [rows, vocab] float32 temporaries (~50 MB at 256).
_PROMPT_LOGITS_ROWS = 256


class StepTimer:
    """Accumulates wall time per phase of a step, so a benchmark can say where the time goes."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


class Worker:
    def __init__(
        self,
        model: CausalLM,
        shape: KVShape,
        num_blocks: int,
        num_cpu_blocks: int,
        device: str,
        eos_ids: frozenset[int],
    ) -> None:
        self.block_size = shape.block_size
        self.cache = CacheEngine(shape, num_blocks, num_cpu_blocks, device)
        self.runner = ModelRunner(model, self.cache.kv_caches, shape.block_size)
        self.sampler = Sampler()
        self.eos_ids = eos_ids

    def execute(self, out: SchedulerOutput, timer: StepTimer) -> ModelOutput:
        self.cache.swap_out(out.swap_out)
        self.cache.copy(out.copies)
        self.cache.swap_in(out.swap_in)
        timer.lap("swap/copy")
        if not out.scheduled:
            return ModelOutput()
        batch = build_batch(out.scheduled, self.block_size)
        timer.lap("prepare")
        logits, prompt_hidden = self.runner.run(batch)
        timer.lap("forward")
        with torch.inference_mode():
            rows = self._pick(logits, out.samples)
            prompt = [] if batch.prompt is None else self._prompt_logprobs(prompt_hidden, batch.prompt)
        timer.lap("sample")
        return ModelOutput(rows, prompt)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt: PromptRows
    ) -> list[tuple[Sequence, list[dict[int, Logprob]]]]:
        ks = [seq.params.prompt_logprobs for seq, count in prompt.spans for _ in range(count)]
        entries: list[dict[int, Logprob] | None] = []
        for start in range(0, len(ks), _PROMPT_LOGITS_ROWS):
            end = start + _PROMPT_LOGITS_ROWS
            logits = self.runner.compute_logits(hidden[start:end])
            entries.extend(token_logprobs(logits, prompt.targets[start:end], ks[start:end])[1])
        result, at = [], 0
        for seq, count in prompt.spans:
            result.append((seq, entries[at : at + count]))
            at += count
        return result

    def _pick(self, logits: torch.Tensor, samples: list[SampleRow]) -> list[RowOutput]:
        """Beams first: the sampler overwrites the logits it is given, and beams read them unchanged."""
        rows = [RowOutput() for _ in samples]
        beams = [i for i, sample in enumerate(samples) if sample.num_beam_candidates]
        if beams:
            k = max(samples[i].num_beam_candidates for i in beams)
            for i, top in zip(beams, top_logprobs(logits[[samples[i].logits_row for i in beams]], k), strict=True):
                rows[i].candidates = top[: samples[i].num_beam_candidates]
        drawn = [i for i, sample in enumerate(samples) if not sample.num_beam_candidates]
        if drawn:
            picked = [samples[i].logits_row for i in drawn]
            # Parallel samples share their parent's row: they need copies, since sampling works in place.
            own = logits if picked == list(range(len(logits))) else logits[picked]
            result = self.sampler(own, [self._sampling_row(samples[i].seq) for i in drawn])
            for j, i in enumerate(drawn):
                rows[i] = RowOutput(result.token_ids[j], result.logprobs[j], result.sampled_logprobs[j])
        return rows

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        banned: tuple[int, ...] = ()
        # A complete structure may only stop: min_tokens cannot lengthen it.
        if seq.num_output_tokens < params.min_tokens and (seq.grammar is None or not seq.grammar.is_completed()):
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_ids))
        return SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, banned, seq.grammar)
