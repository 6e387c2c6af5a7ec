"""The user guide builds (`mkdocs build --strict`: no broken link or anchor, no page outside the nav), its command
reference holds every flag of every `pagedllm` command, and the README's runnable code blocks run."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.cli import make_parser

ROOT = Path(__file__).parents[1]
# A README block marked ```python runnable is run by the last test here; keep each one quick.
RUNNABLE = re.compile(r"^```python runnable\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_guide_builds_strict(site):
    assert (site / "index.html").is_file()
    assert (site / "reference" / "index.html").read_text().count('class="doc doc-heading"') > 10


def every_command(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pagedllm",)):
    """(command path, its flags) for `pagedllm` and every subcommand under it, read from argparse's own actions."""
    flags = [name for action in parser._actions for name in action.option_strings if name not in ("-h", "--help")]
    yield path, flags
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_command(sub, (*path, name))


def test_every_flag_of_every_command_is_in_the_generated_reference(site):
    page = (site / "cli" / "index.html").read_text()
    # Each command's section runs from its heading to the next one's.
    sections = dict(re.findall(r'<h2 id="(pagedllm[\w-]*)"(.*?)(?=<h2 id=|\Z)', page, re.DOTALL))
    missing = []
    commands = list(every_command(make_parser()))
    assert len(commands) > 10
    for path, flags in commands:
        section = sections.get("-".join(path), "")
        missing += [f"{' '.join(path)} {flag}" for flag in flags if f"<code>{flag}</code>" not in section]
    assert not missing, f"flags missing from docs/cli.md's generated reference: {missing}"


def test_the_readme_runnable_blocks_run(tmp_path):
    blocks = RUNNABLE.findall((ROOT / "README.md").read_text())
    assert blocks, "README.md has no ```python runnable block"
    for number, block in enumerate(blocks):
        script = tmp_path / f"block{number}.py"
        script.write_text(block)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, f"README block {number}:\n{block}\n{done.stdout}{done.stderr}"
