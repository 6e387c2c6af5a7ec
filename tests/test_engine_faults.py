"""Faults inside the engine, injected here only: an exception in the forward pass, in sampling, in a
grammar matcher, in detokenization or in the block moves, and requests the KV pool cannot hold. The
requests a fault belongs to fail with an error naming the stage; the others produce exactly what they
produce without the fault (greedy); every block comes back; the engine serves the next request."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

import pagedllm.output_processor
from pagedllm import LLMEngine, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine import DETOKENIZATION, GRAMMAR, SCHEDULING, RequestsFailedError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sequence import Sequence
from pagedllm.step import SchedulerOutput
from pagedllm.worker.worker import FORWARD, MOVING_BLOCKS, SAMPLING, StageError
from tests.kv_invariants import check_kv_invariants

Requests = dict[str, tuple[list[int], SamplingParams]]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256))


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(length)]


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# Three healthy requests of different lengths, one of them with two greedy samples forked on shared blocks.
HEALTHY: Requests = {
    "a": (prompt(9, 1), greedy()),
    "b": (prompt(22, 2), greedy(16)),
    "pair": (prompt(14, 3), greedy(10, n=2)),
}


@dataclass
class Run:
    """Steps an engine, collecting finished requests' token ids and failed requests' errors, and checking the
    KV invariants after every step."""

    engine: LLMEngine
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)

    def add(self, requests: Requests) -> Run:
        for request_id, (prompt_ids, params) in requests.items():
            self.engine.add_request(request_id, prompt_ids, params)
        return self

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except RequestsFailedError as failure:
            assert not self.errors.keys() & failure.errors.keys(), "a request failed twice"
            self.errors |= failure.errors
            outputs = failure.outputs
        self.outputs |= {out.request_id: [c.token_ids for c in out.outputs] for out in outputs if out.finished}
        check_kv_invariants(self.engine.scheduler.kv)

    def finish(self, max_steps: int = 300) -> Run:
        """Step until nothing is left (never hanging), then check that every block came back."""
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert not self.engine.has_unfinished_requests(), f"still unfinished after {max_steps} steps"
        assert not self.engine.requests
        stats = self.engine.stats()
        assert stats.kv_blocks_used == 0 and stats.num_swapped_out_blocks == 0
        return self


def run_alone(engine: LLMEngine, requests: Requests) -> dict[str, list[list[int]]]:
    run = Run(engine).add(requests).finish()
    assert not run.errors
    return run.outputs


def assert_failed_at(error: Exception, stage: str, cause: str) -> None:
    assert isinstance(error, StageError) and error.stage == stage, error
    assert str(error).startswith(f"{stage} failed:") and cause in str(error), error


def assert_serves_next(engine: LLMEngine, expected: dict[str, list[list[int]]]) -> None:
    assert run_alone(engine, {"next": HEALTHY["a"]}) == {"next": expected["a"]}


def spy_on_steps(engine: LLMEngine, monkeypatch) -> tuple[list[SchedulerOutput], list[SchedulerOutput]]:
    """The steps the scheduler planned, and what the worker ran (whole steps, or parts of a failed one)."""
    planned: list[SchedulerOutput] = []
    ran: list[SchedulerOutput] = []
    schedule, execute = engine.scheduler.schedule, engine.worker.execute

    def spy_schedule() -> SchedulerOutput:
        planned.append(schedule())
        return planned[-1]

    def spy_execute(out, timer):
        ran.append(out)
        return execute(out, timer)

    monkeypatch.setattr(engine.scheduler, "schedule", spy_schedule)
    monkeypatch.setattr(engine.worker, "execute", spy_execute)
    return planned, ran


def holds(out: SchedulerOutput, request_id: str) -> bool:
    return any(item.seq.request_id == request_id for item in out.scheduled)


def fail_forward(
    engine: LLMEngine, monkeypatch, when: Callable[[SchedulerOutput, SchedulerOutput], bool]
) -> list[SchedulerOutput]:
    """The forward pass raises, after writing every token's K/V, whenever `when(step, part)` holds for the
    step planned and the part of it the worker runs (all of it, or one request's); returns the parts run."""
    planned, ran = spy_on_steps(engine, monkeypatch)
    run = engine.worker.runner.run

    def faulty_run(batch):
        result = run(batch)
        if when(planned[-1], ran[-1]):
            raise RuntimeError("injected forward fault")
        return result

    monkeypatch.setattr(engine.worker.runner, "run", faulty_run)
    return ran


# ---- the forward pass -------------------------------------------------------------------------


def test_a_forward_fault_fails_only_its_request(engine, monkeypatch):
    expected = run_alone(engine, HEALTHY)
    ran = fail_forward(engine, monkeypatch, lambda step, part: holds(part, "bad"))
    run = Run(engine).add(HEALTHY)
    run.step()
    run.step()
    run.add({"bad": (prompt(17, 4), greedy())})  # joins while the others decode
    run.finish()
    assert run.outputs == expected
    assert run.errors.keys() == {"bad"}
    assert_failed_at(run.errors["bad"], FORWARD, "injected forward fault")
    # The failed step was run again request by request: the healthy ones alone, then the faulty one.
    assert [sorted({item.seq.request_id for item in out.scheduled}) for out in ran[2:7]] == [
        ["a", "b", "bad", "pair"],
        ["a"],
        ["b"],
        ["pair"],
        ["bad"],
    ]
    monkeypatch.undo()
    assert_serves_next(engine, expected)


def test_a_retry_does_not_redo_the_copy_on_write_of_the_failed_step(engine, monkeypatch):
    """The pair's forks first write into their shared partial prompt block in the step that fails: the copy
    made before the forward pass must be used as it is by the pair's run alone, not made again or lost."""
    expected = run_alone(engine, HEALTHY)
    ran = fail_forward(engine, monkeypatch, lambda step, part: holds(part, "bad"))
    run = Run(engine).add({"pair": HEALTHY["pair"]})
    run.step()  # the prompt, and the fork at its first token
    run.add({"bad": (prompt(17, 4), greedy())})
    copies = engine.stats().num_cow_copies
    run.step()
    assert engine.stats().num_cow_copies == copies + 1
    assert ran[1].copies and not ran[2].copies  # the failed step copied; the pair's run alone did not
    run.finish()
    assert run.outputs == {"pair": expected["pair"]} and run.errors.keys() == {"bad"}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_forward_fault_in_a_step_that_preempts_fails_only_its_request(tiny_llama, monkeypatch, mode):
    """A tight pool: requests are swapped out (or dropped) and back while one of them fails in a step that
    moved blocks; the others still produce what they produce on a roomy pool."""
    requests = {str(i): (prompt(length, i), greedy(20)) for i, length in enumerate([13, 30, 9, 25, 18])}
    expected = run_alone(roomy_engine(tiny_llama), requests)
    config = EngineConfig(
        model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=36, preemption_mode=mode, swap_space=0.01
    )
    tight = LLMEngine(config)

    def when(step: SchedulerOutput, part: SchedulerOutput) -> bool:
        return bool(step.swap_out or step.swap_in or step.preempted) and holds(part, "1")

    fail_forward(tight, monkeypatch, when)
    run = Run(tight).add(requests).finish()
    assert run.errors.keys() == {"1"}
    assert_failed_at(run.errors["1"], FORWARD, "injected forward fault")
    assert run.outputs == {rid: out for rid, out in expected.items() if rid != "1"}
    assert tight.stats().num_preemptions > 0
    assert (tight.stats().num_swap_preemptions > 0) == (mode == "swap")


def test_a_fault_every_request_has_fails_the_step_and_the_engine_goes_on(engine, monkeypatch):
    expected = run_alone(engine, HEALTHY)
    broken = [True]
    fail_forward(engine, monkeypatch, lambda step, part: broken[0])
    run = Run(engine).add(HEALTHY)
    run.step()
    assert run.errors.keys() == set(HEALTHY)
    for error in run.errors.values():
        assert_failed_at(error, FORWARD, "injected forward fault")
    assert engine.stats().kv_blocks_used == 0
    broken[0] = False
    assert run_alone(engine, HEALTHY) == expected


# ---- sampling and grammars --------------------------------------------------------------------


def test_a_sampler_fault_in_one_row_fails_only_its_request(engine, monkeypatch):
    expected = run_alone(engine, HEALTHY)
    bad_params = greedy(10, n=2)
    sampler = engine.worker.sampler

    def faulty_sampler(logits, rows):
        if any(row.params is bad_params for row in rows):
            raise RuntimeError("injected sampler fault")
        return sampler(logits, rows)

    monkeypatch.setattr(engine.worker, "sampler", faulty_sampler)
    run = Run(engine).add({**HEALTHY, "bad": (prompt(11, 5), bad_params)}).finish()
    assert run.outputs == expected and run.errors.keys() == {"bad"}
    assert_failed_at(run.errors["bad"], SAMPLING, "injected sampler fault")
    monkeypatch.undo()
    assert_serves_next(engine, expected)


class FaultyMatcher:
    """A grammar matcher whose `method` raises from its `after`-th call on."""

    def __init__(self, matcher, method: str, after: int) -> None:
        self._matcher, self._method, self._calls_left = matcher, method, after

    def __getattr__(self, name: str):
        real = getattr(self._matcher, name)
        if name != self._method:
            return real

        def call(*args):
            self._calls_left -= 1
            if self._calls_left < 0:
                raise RuntimeError(f"injected fault in {name}")
            return real(*args)

        return call


@pytest.mark.parametrize(
    ("method", "stage"), [("accept_token", GRAMMAR), ("fill_next_token_bitmask", SAMPLING)], ids=["accept", "mask"]
)
def test_a_grammar_matcher_fault_fails_only_its_request(engine, method, stage):
    regex = StructuredOutputsParams(regex=r"[a-z ]{1,40}")
    constrained = {"word": (prompt(12, 6), greedy(8, structured_outputs=regex))}
    expected = run_alone(engine, HEALTHY | constrained)
    run = Run(engine).add(HEALTHY | constrained | {"bad": (prompt(15, 7), greedy(8, structured_outputs=regex))})
    bad: Sequence = engine.requests["bad"].seqs[0]
    bad.grammar = FaultyMatcher(bad.grammar, method, after=3)
    run.finish()
    assert run.outputs == expected and run.errors.keys() == {"bad"}
    assert_failed_at(run.errors["bad"], stage, f"injected fault in {method}")
    assert_serves_next(engine, expected)


# ---- detokenization and block moves -----------------------------------------------------------


def test_a_detokenization_fault_fails_only_its_request(engine, monkeypatch):
    expected = run_alone(engine, HEALTHY)
    next_text = pagedllm.output_processor.next_text

    bad_prompt = prompt(11, 5)

    def faulty_next_text(tokenizer, state, *args, **kwargs):
        # The "bad" request's text state starts from its prompt's last tokens; fail after its third token.
        if state.token_ids[: len(state.token_ids) - 3] == bad_prompt[-5:]:
            raise RuntimeError("injected detokenizer fault")
        return next_text(tokenizer, state, *args, **kwargs)

    monkeypatch.setattr(pagedllm.output_processor, "next_text", faulty_next_text)
    run = Run(engine).add({**HEALTHY, "bad": (bad_prompt, greedy())}).finish()
    assert run.outputs == expected and run.errors.keys() == {"bad"}
    assert_failed_at(run.errors["bad"], DETOKENIZATION, "injected detokenizer fault")
    monkeypatch.undo()
    assert_serves_next(engine, expected)


def test_a_block_move_fault_fails_the_requests_of_its_step(engine, monkeypatch):
    """Blocks half copied hold unknown KV: every request the step ran fails, and the engine goes on."""
    expected = run_alone(engine, HEALTHY)
    copy = engine.worker.cache.copy

    def faulty_copy(pairs):
        if pairs:
            raise RuntimeError("injected copy fault")
        copy(pairs)

    monkeypatch.setattr(engine.worker.cache, "copy", faulty_copy)
    run = Run(engine).add({"pair": HEALTHY["pair"], "a": HEALTHY["a"]})
    run.step()  # the prompts, and the pair's fork
    run.step()  # the forks write into their shared block: the copy fails
    assert run.errors.keys() == {"pair", "a"}
    for error in run.errors.values():
        assert_failed_at(error, MOVING_BLOCKS, "injected copy fault")
    assert engine.stats().kv_blocks_used == 0
    monkeypatch.undo()
    assert run_alone(engine, HEALTHY) == expected


# ---- the pool ---------------------------------------------------------------------------------


def small_engine(tiny_llama, **options) -> LLMEngine:
    """40 blocks of 4 tokens."""
    return LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=40, **options))


def roomy_engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=256))


def test_samples_that_could_never_all_fit_are_refused_at_add_time(tiny_llama):
    engine = small_engine(tiny_llama, max_num_seqs=64)
    # 64 samples of a 30-token prompt share its 7 full blocks, and each needs one more block of its own.
    with pytest.raises(ValueError, match=r"needs 71 KV blocks for its 64 sequences .* whole pool has 40"):
        engine.add_request("huge", prompt(30, 8), greedy(2, n=64))
    with pytest.raises(ValueError, match="request runs 65 sequences .* max_num_seqs is 64"):
        engine.add_request("many", prompt(3, 8), greedy(1, n=65))
    # 4 samples of an 18-token prompt share its 4 full blocks: 4 + 4 * 9 blocks at 34 tokens each, not 35.
    with pytest.raises(ValueError, match="needs 44 KV blocks for its 4 sequences"):
        engine.add_request("over", prompt(18, 9), greedy(35, n=4))
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0
    run = Run(engine).add({"edge": (prompt(18, 9), greedy(34, n=4))}).finish()
    assert [len(tokens) for tokens in run.outputs["edge"]] == [34] * 4 and not run.errors
    assert engine.stats().kv_blocks_peak == 40


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_preempted_past_what_the_pool_holds_unshared_never_hang(tiny_llama, prefix_caching):
    """Eight samples share their prompt's blocks, and fit beside an older request only while they do. Once
    preempted, they come back sharing the prompt through the prefix cache; without it each sample needs
    its own copy, more than the whole pool: the request fails alone instead of waiting forever."""
    requests = {"old": (prompt(60, 10), greedy(20)), "eight": (prompt(32, 11), greedy(8, n=8))}
    expected = run_alone(roomy_engine(tiny_llama), requests)
    engine = small_engine(tiny_llama, enable_prefix_caching=prefix_caching)
    run = Run(engine)
    for request_id, request in requests.items():  # the older one first
        run.add({request_id: request})
        run.step()
    run.finish()
    assert engine.stats().num_preemptions > 0
    if prefix_caching:
        assert run.outputs == expected and not run.errors
        return
    assert run.outputs == {"old": expected["old"]} and run.errors.keys() == {"eight"}
    assert_failed_at(run.errors["eight"], SCHEDULING, "cannot run in the whole KV pool of 40 blocks")
    assert run_alone(engine, {"again": requests["eight"]}) == {"again": expected["eight"]}
