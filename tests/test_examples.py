"""Every script in examples/ runs as a user would run it (its own process, the default model) and prints what it
promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"
# What each example's output must hold: the default model's greedy answers, or the shape of what it prints.
EXPECTED = {
    "offline_batch.py": ["Paris", "KV blocks:"],
    "chat.py": ["Paris", "Rome"],
    "structured_output.py": ["'city':", "'population':"],
    "speculative.py": ["guessed tokens accepted"],
    "serve_openai.py": ["chat: The capital of France is Paris.", "tool call:", "get_weather", "responses:"],
    "agent.py": ["Paris"],
    "embeddings.py": ["retrieved: Paris is the capital", "answer: Paris"],
    "lora.py": ["base model: The capital of France is Paris.", "the adapter changed the answer: True"],
    "tools.py": ['tool call: get_weather {"city": "Paris"} (finish_reason tool_calls)', "answer: ", "Paris"],
}


# Imported by the examples that start a server, not run on its own.
HELPERS = {"local_server.py"}


def test_every_example_is_run_here():
    assert sorted(EXPECTED) == sorted(path.name for path in EXAMPLES.glob("*.py") if path.name not in HELPERS)
    assert all((EXAMPLES / name).is_file() for name in HELPERS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs_and_prints_what_it_promises(name, tmp_path):
    log = tmp_path / "out.txt"
    with log.open("w") as sink:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / name)], stdout=sink, stderr=subprocess.STDOUT, timeout=300
        )
    output = log.read_text()
    assert done.returncode == 0, output
    for expected in EXPECTED[name]:
        assert expected in output, output
