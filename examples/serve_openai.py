"""`pagedllm serve` and the official openai client: chat (whole and streamed), a tool call, and the Responses API
continuing a stored conversation. The server runs in a subprocess on a free port, its log in a file."""

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server stopped:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit("the server did not come up in 120 s")


port = free_port()
log = Path(tempfile.mkdtemp()) / "server.log"
command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--served-model-name", "smol"]
with log.open("w") as sink:  # a file, not a pipe that nobody reads
    server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"
try:
    wait_healthy(url, server, log)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="smol", messages=question, max_tokens=24, temperature=0)
    print("chat:", reply.choices[0].message.content)
    stream = client.chat.completions.create(model="smol", messages=question, max_tokens=24, temperature=0, stream=True)
    print("streamed:", "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(
        model="smol", messages=asked, tools=[weather], tool_choice="required", max_tokens=48, temperature=0
    )
    print("tool call:", called.choices[0].message.tool_calls[0].function)

    first = client.responses.create(model="smol", input="Name a colour.", max_output_tokens=16, temperature=0)
    second = client.responses.create(
        model="smol", input="And another one?", previous_response_id=first.id, max_output_tokens=16, temperature=0
    )
    print("responses:", first.output_text, "|", second.output_text)
finally:
    server.terminate()
    server.wait(timeout=30)
