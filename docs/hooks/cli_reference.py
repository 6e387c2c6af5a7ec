"""mkdocs hook: the `pagedllm` command reference, rendered from the parsers `pagedllm.cli.make_parser` builds (whose
engine and server flags come from the option lists in `pagedllm/config.py`), so the guide cannot drift from the code.

`docs/cli.md` holds the marker; at build time it is replaced by one section per command with a row per flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

MARKER = "<!-- pagedllm-cli-reference -->"


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pagedllm",)) -> Iterator[tuple]:
    """(command path, its parser, its help line) for the top parser and every subcommand, depth first."""
    yield path, parser, parser.description or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                for found in commands(sub, (*path, name)):
                    # A subcommand's description is empty: its help line in the parent says what it is.
                    yield found if found[0] != (*path, name) else (found[0], found[1], helps.get(name, ""))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "(switch)"
    if action.choices is not None:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    shape = action.metavar or action.dest.upper()
    return f"`{shape} ...`" if action.nargs in ("+", "*") else f"`{shape}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def anchor(path: tuple[str, ...]) -> str:
    return "-".join(path)


def render(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from pagedllm.cli import make_parser  # imported at build time only: it loads torch

        parser = make_parser()
    out = []
    for path, sub, summary in commands(parser):
        flags = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        positionals = [
            a for a in sub._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
        ]
        if not flags and not positionals:
            continue
        out.append(f"## `{' '.join(path)}` {{#{anchor(path)}}}\n")
        if summary:
            out.append(f"{summary[0].upper()}{summary[1:]}.\n")
        out.append("| flag | value | default | what it does |\n|---|---|---|---|")
        for action in positionals:
            out.append(f"| `{action.dest}` (positional) | | | {_cell(action.help or '')} |")
        for action in flags:
            names = ", ".join(f"`{name}`" for name in action.option_strings)
            out.append(f"| {names} | {_value(action)} | {_default(action)} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
