"""Starting and stopping the processes of ranks 1 .. N-1 of a tensor-parallel group on this machine.

Each is `python -m pagedllm.worker.follower SPEC` (rank 0 is the engine's own process). Their output goes
to the engine's stderr, never to a pipe nobody reads.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FollowerSpec:
    """Everything a rank other than 0 needs to build its shard of the model and of the KV pool."""

    model: str | None
    dtype: str
    kv_cache_dtype: str
    device: str
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    timeout_s: float
    threads: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FollowerSpec:
        return cls(**json.loads(text))


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """A port in use is refused before any worker starts, with the address named."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            raise ValueError(f"master port {host}:{port} is not free: {error.strerror}") from error


def threads_per_rank(world_size: int, asked: int | None) -> int:
    if asked is not None:
        return asked
    cores = os.cpu_count() or 1
    if world_size > cores:
        logger.warning("%d tensor-parallel ranks on %d cores: one thread each, the cores shared", world_size, cores)
    return max(1, cores // world_size)


class Followers:
    """The follower processes of one engine."""

    def __init__(self, specs: list[FollowerSpec]) -> None:
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "pagedllm.worker.follower", spec.to_json()]) for spec in specs
        ]

    def dead(self) -> list[int]:
        """Exit codes of followers that have stopped."""
        return [code for process in self.processes if (code := process.poll()) is not None]

    def stop(self, grace_s: float) -> None:
        """Wait `grace_s` for each to leave after the stop message, then kill what is left: no orphans."""
        for process in self.processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
