"""What protects a running server, over real HTTP against `pagedllm serve` on the embedded default model (slow
enough per token that a request can be made to outlast a grace period): backpressure, the metrics key, the
SIGTERM grace period, and the engine core's death."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from pagedllm.models.default import default_model_file
from tests.test_server import ServerProcess, sse_data, start_server, stop_server
from tests.test_tensor_parallel import children_of

KEY = "sk-limits"


AUTH = {"Authorization": f"Bearer {KEY}"}


def long_stream(server: ServerProcess, max_tokens: int, seen: list[str], started: threading.Event) -> None:
    """Stream a greedy completion of exactly `max_tokens` tokens, recording every data line."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        for data in sse_data(response):
            seen.append(data)
            started.set()


def finish_reason(seen: list[str]) -> str:
    assert seen[-1] == "[DONE]"
    return json.loads(seen[-2])["choices"][0]["finish_reason"]


def start(tmp_path: Path, *flags: str) -> ServerProcess:
    return start_server(default_model_file(), tmp_path / "server.log", *flags)


def test_a_full_queue_gets_503_with_retry_after_health_says_overloaded_and_metrics_need_the_key(tmp_path):
    flags = ["--max-num-seqs", "1", "--max-waiting-requests", "2", "--api-key", KEY, "--metrics-need-key"]
    server = start(tmp_path, *flags)
    try:
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        scraped = httpx.get(f"{server.url}/metrics", headers=AUTH)
        assert scraped.status_code == 200 and "pagedllm:kv_blocks_total" in scraped.text
        assert httpx.get(f"{server.url}/kv/snapshot").status_code == 401
        seen: list[list[str]] = [[], [], []]
        started = [threading.Event() for _ in seen]
        # The first runs long enough for the checks below; the two queued behind it are short.
        lengths = [200, 16, 16]
        threads = [
            threading.Thread(target=long_stream, args=(server, n, seen[i], started[i])) for i, n in enumerate(lengths)
        ]
        threads[0].start()
        assert started[0].wait(60)
        for thread in threads[1:]:  # one runs (max-num-seqs 1), two wait: the queue is at its bound
            thread.start()
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health").json())["status"] != "overloaded":  # no key needed
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert health == {"status": "overloaded", "num_waiting": 2, "max_waiting": 2}
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "server_overloaded" and "--max-waiting-requests 2" in error["message"]
        for thread in threads:
            thread.join(120)
        assert [finish_reason(s) for s in seen] == ["length"] * 3  # the queued ones were served, not dropped
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    finally:
        assert stop_server(server) == 0, server.log.read_text()


def half_sent_request(server: ServerProcess) -> tuple[socket.socket, bytes]:
    """A completion request whose headers and half its body are sent; the rest is returned to send later."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
    return sock, body[5:]


def read_response(sock: socket.socket) -> str:
    """Everything the server sends until it closes the connection (as it does while shutting down)."""
    sock.settimeout(10)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received.decode()


def test_sigterm_refuses_new_requests_finishes_short_ones_and_aborts_at_the_grace_period(tmp_path):
    """Grace 5 s: a request one token from its end finishes ("length"), a long one is cut ("abort") no sooner
    than the grace period, a request that arrives meanwhile gets 503, and the server exits 0."""
    server = start(tmp_path, "--shutdown-grace", "5")
    long_seen: list[str] = []
    short_seen: list[str] = []
    long_started, short_started = threading.Event(), threading.Event()
    long_thread = threading.Thread(target=long_stream, args=(server, 2000, long_seen, long_started))
    long_thread.start()
    assert long_started.wait(60)
    late, rest = half_sent_request(server)
    short_thread = threading.Thread(target=long_stream, args=(server, 2, short_seen, short_started))
    short_thread.start()
    assert short_started.wait(60)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    late.sendall(rest)
    answer = read_response(late)
    short_thread.join(30)
    long_thread.join(30)
    long_ended = time.monotonic() - signalled
    assert server.process.wait(timeout=20) == 0, server.log.read_text()
    assert answer.startswith("HTTP/1.1 503"), answer
    assert "shutting down" in answer
    assert finish_reason(short_seen) == "length"
    assert finish_reason(long_seen) == "abort"
    assert 5.0 <= long_ended < 15.0
    assert len(long_seen) < 2000  # it was cut, not finished


def test_when_the_engine_core_dies_its_requests_fail_and_the_server_exits_1(tmp_path):
    """Nothing hangs: in-flight requests, streamed or not, get a server error naming the cause, and the server
    exits non-zero so that a supervisor restarts it."""
    server = start(tmp_path)
    try:
        outcomes: dict[bool, tuple[int, str]] = {}

        def request(streamed: bool) -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": streamed}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                outcomes[streamed] = (response.status_code, "\n".join(response.iter_lines()))

        threads = [threading.Thread(target=request, args=(streamed,)) for streamed in (True, False)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while server.metric("pagedllm:generation_tokens_total") < 10:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (core,) = children_of(server.process.pid)  # the engine core, forked from the server
        os.kill(core, signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert outcomes[True][0] == 200 and "engine core exited unexpectedly" in outcomes[True][1]
        assert outcomes[False][0] == 500 and "engine core exited unexpectedly" in outcomes[False][1]
        assert server.process.wait(timeout=20) == 1, server.log.read_text()
    finally:
        server.process.kill()
