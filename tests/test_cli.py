"""The command line, run as a real subprocess on the tiny model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.cli import main


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_generate_prints_the_greedy_answer(tiny_llama):
    from pagedllm import LLM, SamplingParams

    expected = LLM(model=tiny_llama).generate(
        "Hello world", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    result = run_cli("generate", "Hello world", "--model", str(tiny_llama), "--raw", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected[0].outputs[0].text + "\n"


def test_chat_streams_replies_and_keeps_the_conversation(tiny_llama):
    result = run_cli("chat", "--model", str(tiny_llama), "--max-tokens", "6", stdin="Hello\nHow are you?\n\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two turns answered, then the empty line ends the chat
    assert len(result.stdout.strip().splitlines()) >= 2


def test_bad_option_is_a_clear_error(tiny_llama, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "hi", "--model", str(tiny_llama), "--temperature", "-1"])
    assert exit.value.code == 2
    assert "--temperature" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "hi", "--model", str(tmp_path / "nowhere")])
    assert exit.value.code == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_folder_without_a_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_every_engine_option_is_a_flag_of_every_engine_command() -> None:
    """EngineConfig is the one list: each field reaches generate, chat and serve as a flag, with its
    default, and a flag sets the field (booleans get --no-... as well)."""
    from dataclasses import MISSING, fields

    from pagedllm.cli import make_parser
    from pagedllm.config import EngineConfig, option_values

    parser = make_parser()
    for command in ("generate", "chat", "serve"):
        prompt = ["hi"] if command == "generate" else []
        defaults = option_values(EngineConfig, parser.parse_args([command, *prompt]))
        assert defaults == {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}
        args = parser.parse_args([command, *prompt, "--block-size", "8", "--no-enable-prefix-caching"])
        config = EngineConfig(**option_values(EngineConfig, args))
        assert (config.block_size, config.enable_prefix_caching) == (8, False)


def test_llm_takes_exactly_the_engine_options() -> None:
    import pytest

    from pagedllm import LLM

    with pytest.raises(TypeError, match="blocksize"):
        LLM(blocksize=8)
