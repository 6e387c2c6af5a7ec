"""The live KV-cache page over real HTTP: `pagedllm serve` as a subprocess under load, `/kv/snapshot` checked
against its own tables, the API key (header or `?api_key=`), unknown paths, clients that stop reading
`/kv/events`, and the page itself in headless Chromium (Debian's `chromium` and `chromedriver`, driven by
Selenium pointed at both, so nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_server import ServerProcess, start_server, stop_server

KEY = "sk-kv"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 96  # small enough that the load below preempts (by swap)
SCREENSHOT = Path(__file__).parents[1] / "docs" / "img" / "kv_page.png"
WINDOW_S = 6.0
SHARED = "Paged attention stores the key value cache in fixed size blocks. " * 3


class Load:
    """Completions sent back to back from a few threads until stopped: shared prefixes, forks (n=2). A thread
    keeps what failed it, and leaving the `with` raises it in the test's thread: an assert failing inside a
    thread only prints a warning, and the test would pass."""

    def __init__(self, server: ServerProcess, threads: int = 4, max_tokens: int = 64) -> None:
        self._server = server
        self._stop = threading.Event()
        self._body = {"model": "tiny", "max_tokens": max_tokens, "n": 2, "temperature": 1.0, "ignore_eos": True}
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        self.errors: list[Exception] = []
        self.completed = 0  # requests answered, over all threads (an int's += is atomic enough for a count)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self._threads), "a load thread is stuck in a request"
        if self.errors:
            raise AssertionError(f"{len(self.errors)} load thread(s) failed, the first as above") from self.errors[0]

    def _run(self, index: int) -> None:
        try:
            self._send_until_stopped(index)
        except Exception as error:  # any: raised again in the test's thread by __exit__
            self.errors.append(error)

    def _send_until_stopped(self, index: int) -> None:
        with httpx.Client(base_url=self._server.url, headers=AUTH, timeout=60) as client:
            round_ = 0
            while not self._stop.is_set():
                prompt = f"{SHARED}{index} {round_}"
                response = client.post("/v1/completions", json=self._body | {"prompt": prompt})
                assert response.status_code == 200, response.text
                self.completed += 1
                round_ += 1


def snapshot(server: ServerProcess) -> dict:
    response = httpx.get(f"{server.url}/kv/snapshot", headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while (state := snapshot(server))["sequences"] or any(state["ref_counts"]):
        assert time.monotonic() < deadline, "the engine never fell idle"
        time.sleep(0.05)
    return state


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("kv_server") / "server.log"
    flags = ["--api-key", KEY, "--served-model-name", "tiny", "--num-kv-blocks", str(NUM_BLOCKS)]
    process = start_server(tiny_llama, log, *flags, "--preemption-mode", "swap", "--swap-space", "0.001")
    yield process
    assert stop_server(process) == 0, log.read_text()


def test_snapshot_under_load_is_consistent(server):
    statuses: Counter[str] = Counter()
    with Load(server):
        for _ in range(40):
            state = snapshot(server)
            assert state["num_blocks"] == len(state["ref_counts"]) == NUM_BLOCKS
            entries = Counter(b for seq in state["sequences"] for b in seq["block_table"] if b >= 0)
            assert state["ref_counts"] == [entries.get(block, 0) for block in range(NUM_BLOCKS)]
            swapped = {b for seq in state["sequences"] for b in seq["swapped_blocks"]}
            assert state["swapped_out_blocks"] == len(swapped)
            assert set(state["cached"]) <= set(range(NUM_BLOCKS))
            statuses.update(seq["status"] for seq in state["sequences"])
            statuses["shared"] += any(count > 1 for count in state["ref_counts"])
            time.sleep(0.05)
    assert statuses["running"] and statuses["shared"]
    idle = wait_idle(server)
    assert idle["kv_utilization"] == 0.0 and idle["cached"]  # finished requests' blocks stay findable


@pytest.mark.parametrize("path", ["/kv", "/kv/snapshot", "/kv/events"])
def test_kv_paths_need_the_key(server, path):
    url = f"{server.url}{path}"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, params={"api_key": "wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, params={"api_key": KEY}).status_code == 401
    refusal = httpx.get(url, params={"api_key": ""})
    assert refusal.status_code == 401 and refusal.json()["error"]["code"] == "invalid_api_key"
    with httpx.stream("GET", url, params={"api_key": KEY}, timeout=10) as response:
        assert response.status_code == 200
    with httpx.stream("GET", url, headers=AUTH, timeout=10) as response:
        assert response.status_code == 200
    # The query key opens only the /kv paths.
    assert httpx.get(f"{server.url}/v1/models", params={"api_key": KEY}).status_code == 401


@pytest.mark.parametrize("path", ["/kv/nope", "/kv/snapshot/1", "/kv/static/kv.js", "/kv/events/x"])
def test_unknown_kv_paths_are_404_json(server, path):
    response = httpx.get(f"{server.url}{path}", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


def test_the_event_stream_sends_history_snapshots_and_kv_events(server):
    wait_idle(server)
    seen: Counter[str] = Counter()
    with Load(server, threads=2), httpx.stream("GET", f"{server.url}/kv/events", headers=AUTH, timeout=30) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                seen[event] += 1
                if event == "kv_events":
                    seen.update(item["type"] for item in data["events"])
            if seen["BlockStored"] and seen["snapshot"] >= 5:
                break
    assert seen["history"] == 1 and seen["BlockStored"]


def rss_bytes(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def stalled_client(server: ServerProcess) -> socket.socket:
    """A /kv/events client that reads until the stream has started sending snapshots, then never reads another
    byte, with a tiny receive buffer so that the server's side fills up quickly. A stream that sent nothing
    would stall no one, so it fails here."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /kv/events?api_key={KEY} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    received = b""
    while b"event: snapshot" not in received:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            chunk = b""
        assert chunk, f"/kv/events sent no snapshot before it went quiet or closed, only {received[:300]!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200 "), received[:300]
    assert b"event: history" in received
    return sock


@pytest.mark.slow  # about 25 s of steady load: in scripts/test_slow.sh
def test_stalled_event_clients_neither_grow_memory_nor_stop_the_engine(tiny_llama, tmp_path):
    """Under steady load, on a pool of 60,000 blocks (an 80 kB frame ten times a second per client), sixteen clients
    that stop reading once their stream has sent its first snapshot: buffered, their frames would add
    16 × 10 × 80 kB = 12.8 MB a second, and a send that waited on them would stop the engine. Compared with a
    window of the same load without them, the server's memory grows no faster, and the engine keeps stepping and
    answering requests. How fast it steps is a benchmark's question (a timed ratio here failed on a busy
    2-core machine with nothing wrong)."""
    log = tmp_path / "server.log"
    flags = ["--api-key", KEY, "--served-model-name", "tiny", "--num-kv-blocks", "60000", "--dtype", "bfloat16"]
    server = start_server(tiny_llama, log, *flags)
    try:
        with Load(server, threads=3, max_tokens=128) as load:
            time.sleep(3)  # warm up
            start = rss_bytes(server)
            time.sleep(WINDOW_S)
            grown_before = rss_bytes(server) - start
            clients = [stalled_client(server) for _ in range(16)]
            time.sleep(2)  # long enough to fill every socket buffer and the event queues
            start, step, completed = rss_bytes(server), snapshot(server)["step"], load.completed
            time.sleep(WINDOW_S)
            grown_during = rss_bytes(server) - start
            steps, answered = snapshot(server)["step"] - step, load.completed - completed
            for client in clients:
                client.close()
        assert steps > 0 and answered > 0, f"while clients stalled: {steps} steps, {answered} requests answered"
        extra = grown_during - grown_before
        assert extra < 24 << 20, f"RSS grew {grown_before >> 10} kB in {WINDOW_S} s, then {grown_during >> 10} kB"
    finally:
        assert stop_server(server) == 0, log.read_text()


# ---- the page in a real browser ---------------------------------------------------------------------


def chromium_driver():
    """Headless Chromium from Debian's packages, driven by its own chromedriver: Selenium Manager never runs."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and chromedriver, "scripts/test.sh installs Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))


def page_state(driver) -> dict:
    return driver.execute_script(
        "return {cells: document.querySelectorAll('#kv-grid .cell').length,"
        " step: Number(document.getElementById('kv-step').textContent),"
        " used: Number(document.getElementById('kv-used').textContent),"
        " cached: Number(document.getElementById('kv-cached').textContent),"
        " eta: document.getElementById('kv-eta').textContent,"
        " rows: document.querySelectorAll('#kv-requests tbody tr').length}"
    )


def hover_a_request(driver, timeout: float = 5.0) -> None:
    """Hover a request's row (the page then marks its blocks), for the screenshot. The table is redrawn up to ten
    times a second, and between two requests of the load it may have no row at all: the row found may be gone
    before the pointer reaches it, so look again until `timeout`."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while True:
        try:
            row = driver.find_element(By.CSS_SELECTOR, "#kv-requests tbody tr")
            ActionChains(driver).move_to_element(row).perform()
            return
        except (NoSuchElementException, StaleElementReferenceException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def wait_page(driver, accept, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not accept(state := page_state(driver)):
        assert time.monotonic() < deadline, f"the page stayed at {state}"
        time.sleep(0.02)
    return state


def test_the_page_draws_the_pool_and_follows_the_server(server):
    driver = chromium_driver()
    try:
        with Load(server, threads=5):
            driver.get(f"{server.url}/kv?api_key={KEY}")
            wait_page(driver, lambda page: page["cells"] == NUM_BLOCKS, timeout=10)
            used_seen = 0
            for _ in range(10):
                # One update is at most 0.1 s behind the engine; allow for a busy two-core machine.
                server_step = snapshot(server)["step"]
                page = wait_page(driver, lambda page, step=server_step: page["step"] >= step, timeout=1.5)
                used_seen = max(used_seen, page["used"])
            assert used_seen > 0
            wait_page(driver, lambda page: page["rows"] > 0, timeout=5)
            hover_a_request(driver)
            time.sleep(1)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(SCREENSHOT))
        idle = wait_idle(server)
        used = sum(1 for count in idle["ref_counts"] if count)
        page = wait_page(driver, lambda page: page["step"] == idle["step"], timeout=1.5)
        assert (page["used"], page["cached"], page["cells"]) == (used, len(idle["cached"]), NUM_BLOCKS)
        assert float(page["eta"]) == round(idle["kv_utilization"], 3)
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
