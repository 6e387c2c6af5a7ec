"""The OpenAI Agents SDK on `pagedllm serve`: an agent on the Responses API calls a function tool and answers."""

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "server.log"
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--served-model-name", "smol"]
    with log.open("w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    sys.exit(f"the server did not come up:\n{log.read_text()}")


server, url = start_server()
try:
    set_tracing_disabled(True)  # nothing leaves this machine
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    agent = Agent(
        name="weather",
        instructions="Use the tool, then answer in one sentence.",
        model=OpenAIResponsesModel(model="smol", openai_client=client),
        tools=[get_weather],
        # The small model rarely calls a tool on its own; the SDK lets it answer freely after the call.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    print(result.final_output)
finally:
    server.terminate()
    server.wait(timeout=30)
