"""Seconds from process start to an answer (`pagedllm generate`) and to `/health` 200 (`pagedllm serve`), on the
default model with warm disk caches (one untimed start first), for this checkout and, with `--vs DIR`, another one
(an older commit's worktree, say), taking turns so that both meet the same machine.

    python scripts/start_times.py [--rounds 3] [--vs /tmp/base]

Each checkout runs as `python -m pagedllm` from its own folder, with this interpreter (its packages)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = "What is the capital of France?"


def generate_seconds(checkout: Path) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pagedllm", "generate", PROMPT]
    subprocess.run(command, cwd=checkout, check=True, capture_output=True)
    return time.perf_counter() - started


def serve_seconds(checkout: Path, log: Path) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.perf_counter()
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "pagedllm", "serve", "--port", str(port)], cwd=checkout, stdout=out, stderr=out
        )
    try:
        while not _healthy(port):
            if server.poll() is not None:
                raise RuntimeError(f"the server in {checkout} exited ({server.returncode}): see {log}")
            time.sleep(0.02)
        return time.perf_counter() - started
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vs", type=Path, default=None, help="another checkout, timed in turn with this one")
    args = parser.parse_args()
    checkouts = [Path.cwd(), *([args.vs.resolve()] if args.vs else [])]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "start_times_serve.log"
    for checkout in checkouts:  # warm disk caches, a built C library, a converted GGUF file
        generate_seconds(checkout)
    times: dict[tuple[Path, str], list[float]] = {}
    for _ in range(args.rounds):
        for checkout in checkouts:
            times.setdefault((checkout, "generate"), []).append(generate_seconds(checkout))
            times.setdefault((checkout, "serve"), []).append(serve_seconds(checkout, log))
    for (checkout, what), seconds in times.items():
        each = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"{checkout}  {what:8}  median {statistics.median(seconds):.2f} s  ({each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
