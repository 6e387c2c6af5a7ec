"""How many threads a step's operators get, chosen by measuring steps.

Torch's OpenMP threads (shared by the C kernels) split every operator. A small step's operators are too short
to pay for the split, and when something else takes a core (the server's HTTP process, a neighbour on a
shared machine) every parallel operator waits for the thread that lost it: on 2 cores with a busy neighbour a
decode step ran 5-10x slower with 2 threads than with 1. No fixed threshold is right for every model, batch
and machine, so for each size of step (its token count, in power-of-two classes) the chooser times the
steps it runs with all threads and, from the ninth step of a size on, with one; it runs the faster and
retries the slower at growing intervals, so that a change (the neighbour left) is noticed at a small cost.
All threads come first: on a quiet machine they win every step big enough to matter. Steps of more than
`LARGEST_TRIAL` tokens always run on all threads: their operators are long enough to pay for the split even
beside a neighbour, and a trial of one thread there cost every waiting request: a 2048-token step ran 1.4 s
instead of 0.8 in a burst of 64 requests, and its first tokens came that much later.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

_SMOOTHING = 0.3  # weight of the newest step in each arm's running mean
_FIRST_RETRY = 8  # steps of a class between retries of the slower arm, at first
_LAST_RETRY = 512  # and at most, after the slower arm kept losing
LARGEST_TRIAL = 256  # tokens: the largest step that may be tried on one thread (max_num_seqs' default)


@dataclass(slots=True)
class _Arm:
    threads: int
    seconds_per_token: float = 0.0
    samples: int = 0

    def record(self, seconds_per_token: float, fresh: bool) -> None:
        """`fresh`: the mean so far is stale (as old as this arm's last retry), the new time replaces it."""
        if self.samples == 0 or fresh:
            self.seconds_per_token = seconds_per_token
        else:
            self.seconds_per_token += _SMOOTHING * (seconds_per_token - self.seconds_per_token)
        self.samples += 1


@dataclass(slots=True)
class _SizeClass:
    arms: tuple[_Arm, _Arm]  # all threads, one thread
    retry_every: int = _FIRST_RETRY
    since_retry: int = 0
    retrying: bool = False

    def best(self) -> _Arm:
        return min(self.arms, key=lambda arm: arm.seconds_per_token)

    def other(self, arm: _Arm) -> _Arm:
        return self.arms[1] if arm is self.arms[0] else self.arms[0]


@dataclass
class ThreadChooser:
    max_threads: int
    _classes: dict[int, _SizeClass] = field(default_factory=dict)

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Run the block (a step's forward pass and sampling) on the chosen number of threads, and time it."""
        if self.max_threads == 1:
            yield
            return
        threads = self.choose(num_tokens)
        torch.set_num_threads(threads)
        started = time.perf_counter()
        yield
        self.record(num_tokens, threads, time.perf_counter() - started)

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens; report its time with `record`."""
        if self.max_threads == 1 or num_tokens > LARGEST_TRIAL:
            return self.max_threads
        size = self._class(num_tokens)
        all_threads, one = size.arms
        if all_threads.samples == 0:
            return all_threads.threads
        size.since_retry += 1
        if one.samples == 0:  # tried first only after a few steps on all threads, and once
            size.retrying = size.since_retry >= _FIRST_RETRY
            return one.threads if size.retrying else all_threads.threads
        best = size.best()
        size.retrying = size.since_retry >= size.retry_every
        return size.other(best).threads if size.retrying else best.threads

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if self.max_threads == 1 or not 1 <= num_tokens <= LARGEST_TRIAL:
            return
        size = self._class(num_tokens)
        # Until one thread has been tried, all threads is the incumbent it must beat.
        best_before = size.best() if all(arm.samples for arm in size.arms) else size.arms[0]
        next(arm for arm in size.arms if arm.threads == threads).record(seconds / num_tokens, fresh=size.retrying)
        if not size.retrying:
            return
        size.retrying, size.since_retry = False, 0
        # The slower arm lost again: look less often. It won: it is the best now, and the other is retried soon.
        if size.best() is best_before:
            size.retry_every = min(2 * size.retry_every, _LAST_RETRY)
        else:
            size.retry_every = _FIRST_RETRY

    def _class(self, num_tokens: int) -> _SizeClass:
        key = max(num_tokens, 1).bit_length()
        if key not in self._classes:
            self._classes[key] = _SizeClass((_Arm(self.max_threads), _Arm(1)))
        return self._classes[key]
