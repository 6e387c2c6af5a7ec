"""Tool calling over `pagedllm serve` with the openai client: the model calls a function, the script runs it and
sends its result back as a `role: "tool"` message, and the model answers with it.

SmolLM2's chat template knows no tools, so pagedllm renders them in the Hermes `<tool_call>` form and reads the call
back out of the reply; `tool_choice="required"` holds the first reply to a call with a JSON schema built from the
tool's parameters, so even a 135M model calls it well-formed."""

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai


def get_weather(city: str) -> dict:
    """The tool itself: here a fixed answer, in practice an API call."""
    return {"city": city, "forecast": "sunny", "temperature_c": 24}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


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
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    reason = first.choices[0].finish_reason
    print("tool call:", call.function.name, call.function.arguments, f"(finish_reason {reason})")

    result = get_weather(**json.loads(call.function.arguments))
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    # A small model needs telling what to do with the result; a larger one answers from it unasked.
    messages.append({"role": "user", "content": "Now tell me the weather in one sentence."})
    final = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=48, temperature=0
    )
    print("tool result:", result)
    print("answer:", final.choices[0].message.content)
finally:
    server.terminate()
    server.wait(timeout=30)
