"""The per-step thread chooser: it runs the faster arm of each step size and notices when that changes."""

from itertools import pairwise

from pagedllm.worker.threads import LARGEST_TRIAL, ThreadChooser


def drive(chooser: ThreadChooser, num_tokens: int, cost: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps of one size, each costing `cost[threads]` seconds per token; the thread counts used."""
    used = []
    for _ in range(steps):
        threads = chooser.choose(num_tokens)
        chooser.record(num_tokens, threads, cost[threads] * num_tokens)
        used.append(threads)
    return used


def test_each_size_runs_its_faster_arm():
    chooser = ThreadChooser(max_threads=4)
    small = drive(chooser, 3, {1: 1.0, 4: 2.0}, 200)
    large = drive(chooser, 200, {1: 1.0, 4: 0.3}, 200)
    assert small[-100:].count(1) >= 95 and large[-100:].count(4) >= 95
    assert small.count(4) < 20 and 0 < large.count(1) < 20  # the loser is retried, rarely


def test_steps_past_the_largest_trial_always_run_on_all_threads():
    # Even where one thread would win: a trial there would cost every waiting request a slow step.
    chooser = ThreadChooser(max_threads=2)
    assert set(drive(chooser, LARGEST_TRIAL + 1, {1: 0.1, 2: 1.0}, 300)) == {2}
    assert set(drive(chooser, 2048, {1: 0.1, 2: 1.0}, 300)) == {2}
    assert 1 in drive(chooser, LARGEST_TRIAL, {1: 0.1, 2: 1.0}, 300)


def test_a_change_is_noticed_and_losing_retries_grow_rarer():
    chooser = ThreadChooser(max_threads=2)
    busy_neighbour = drive(chooser, 64, {1: 1.0, 2: 5.0}, 600)
    retries = [i for i, threads in enumerate(busy_neighbour) if threads == 2 and i > 4]
    gaps = [b - a for a, b in pairwise(retries)]
    assert gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0]
    quiet = drive(chooser, 64, {1: 1.0, 2: 0.5}, 600)
    assert quiet[-100:].count(2) >= 95  # once the neighbour left, all threads again


def test_one_thread_machines_never_ask():
    assert set(drive(ThreadChooser(max_threads=1), 50, {1: 1.0}, 10)) == {1}
