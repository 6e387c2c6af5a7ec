"""What the server examples share: `pagedllm serve` of the default model in a subprocess on a free port, its log in
a file (not a pipe nobody reads), waited for until `/health` answers, stopped when the block ends."""

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def local_server(name: str = "smol", ready_within_s: float = 120) -> Iterator[str]:
    """The server's URL, while it serves the default model as `name`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "server.log"
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--served-model-name", name]
    with log.open("w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log, ready_within_s)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server stopped:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit(f"the server did not come up in {within_s:.0f} s:\n{log.read_text()}")
