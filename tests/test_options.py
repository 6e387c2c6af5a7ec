"""Every option refuses what it cannot mean and takes each value at the edges of what it can. The cases are
generated from the option lists (each field's domain) and from the command-line parser itself (each flag's
domain), so an option or flag added later is covered by being there."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import signal
import string
import subprocess
import sys
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM
from pagedllm.cli import SamplingFlags, make_parser
from pagedllm.config import DTypes, EngineConfig, LoRAModules, ServeOptions, check_option, domain_of
from pagedllm.domains import (
    ArgType,
    Booleans,
    Choices,
    CommaLists,
    Domain,
    ExistingPaths,
    FilePaths,
    FolderPaths,
    Hosts,
    Integers,
    JsonObjects,
    Reals,
    Texts,
    Tuples,
    Urls,
)

OPTION_LISTS = (EngineConfig, ServeOptions, SamplingFlags)
# Its flags are another change's to give domains (benchmarks/accuracy.py is being edited beside this one);
# test_every_flag_of_every_command_has_a_domain fails once they have them, so the exception cannot outlive that.
UNCOVERED_COMMANDS: set[tuple[str, ...]] = set()
EXAMPLES = settings(max_examples=20, deadline=None)

HERE = Path(__file__).resolve()
MISSING = HERE.parent / "no-such-folder"
LETTERS = st.text(string.ascii_letters, min_size=1, max_size=8)  # no Unicode digits: int("٣") is 3
DTYPE_NAMES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# speculative_config with every key at an edge of its range.
SPECULATIVE_EDGE = {
    "method": "ngram",
    "num_speculative_tokens": 32,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 1024,
    "disable_by_batch_size": 1,
}


# ---- values at and beyond the edges of each kind of domain --------------------------------------------


def bad_texts(domain: Domain) -> st.SearchStrategy[str]:
    """Text a flag of `domain` must refuse: just outside it, huge, not a value of its kind at all, empty."""
    match domain:
        case Integers(low=low, high=high):
            outside = st.integers(max_value=low - 1) | st.integers(min_value=high + 1)
            return outside.map(str) | st.floats().map(repr) | LETTERS | st.just("")
        case Reals(high=high):
            # float() reads "inf" and "infinity" in any case: inside a domain with no upper bound.
            words = LETTERS.filter(lambda text: high < math.inf or text.lower() not in ("inf", "infinity"))
            return outside_reals(domain).map(repr) | st.sampled_from(["nan", "-inf", ""]) | words
        case Choices(values=values, fold_case=fold_case):
            unknown = st.text().filter(lambda text: (text.lower() if fold_case else text) not in values)
            shouted = [] if fold_case else [value.upper() for value in values if value.upper() != value]
            return unknown | st.sampled_from(["", *shouted])
        case Texts():
            return st.just("") | st.text().map(lambda text: " " + text) | st.text().map(lambda text: text + "\n")
        case Hosts():
            # Malformed names the resolver refuses without asking a DNS server: an empty label, a long one.
            long_label = st.text(string.ascii_lowercase, min_size=64, max_size=80)
            empty_label = st.tuples(LETTERS, LETTERS).map("..".join)
            return long_label | empty_label | st.sampled_from(["", " "])
        case Urls():
            ports = st.integers(min_value=65536) | st.integers(max_value=0)
            return ports.map(lambda port: f"http://127.0.0.1:{port}") | st.sampled_from(
                ["", "http://", "ftp://127.0.0.1", "127.0.0.1:8000", " http://127.0.0.1"]
            )
        case ExistingPaths():
            return LETTERS.map(lambda name: str(MISSING / name)) | st.just("")
        case FilePaths():
            return LETTERS.map(lambda name: str(MISSING / name / "events.jsonl")) | st.sampled_from(
                ["", str(HERE.parent)]
            )
        case FolderPaths():
            return LETTERS.map(lambda name: str(HERE / name)) | st.sampled_from(["", str(HERE)])
        case CommaLists(of=of):
            # One bad item among good ones (stray spaces around an item are forgiven, so none are added).
            item = bad_texts(of).filter(lambda text: "," not in text and text == text.strip())
            good = st.lists(st.sampled_from(good_texts(of)), max_size=2)
            return st.tuples(good, item).map(lambda parts: ",".join([*parts[0], parts[1]])) | st.just(",")
        case DTypes():
            return st.text().filter(lambda text: text not in DTYPE_NAMES)
        case JsonObjects(keys=keys):
            unknown = st.text(min_size=1).filter(lambda key: key not in keys).map(lambda key: json.dumps({key: 1}))
            return unknown | LETTERS | st.sampled_from(["", "[]", "1", "null", '"ngram"', "{", "{'method': 1}"])
        case LoRAModules():
            # No '=', an empty or padded name, an empty path, a path that is no folder.
            missing = LETTERS.map(lambda name: f"{name}={HERE.parent / name}")
            folder = HERE.parent
            return LETTERS | missing | st.sampled_from([f"={folder}", f" a={folder}", "a=", f"a={HERE}"])
    raise AssertionError(f"no cases for {domain!r}: add its kind here")


def outside_reals(domain: Reals) -> st.SearchStrategy[float]:
    # Bounds by nextafter, not exclude_min/exclude_max: the float next to 0.0 is -0.0, which equals 0.0.
    below = st.floats(max_value=domain.low if domain.low_open else math.nextafter(domain.low, -math.inf))
    if domain.high == math.inf:
        return below
    return below | st.floats(min_value=math.nextafter(domain.high, math.inf))


def bad_values(domain: Domain) -> st.SearchStrategy[object]:
    """Python values `LLM(**options)` and the option lists must refuse: the bad texts' values, wrong types."""
    wrong_types = st.booleans() | st.binary(min_size=1) | st.lists(st.integers(), max_size=1)
    match domain:
        case Integers(low=low, high=high):
            outside = st.integers(max_value=low - 1) | st.integers(min_value=high + 1)
            return outside | st.floats() | st.just(str(low)) | wrong_types
        case Reals(high=high):
            return outside_reals(domain) | st.just(math.nan) | st.just(str(high)) | wrong_types
        case Booleans():
            return st.integers() | st.floats() | st.sampled_from(["yes", "True", ""])
        case Tuples(of=of):
            return bad_values(of).map(lambda item: (item,)) | st.just(list(good_values(of))) | LETTERS
        case DTypes():
            return bad_texts(domain) | st.sampled_from([torch.int8, torch.int64, torch.float64]) | wrong_types
    return bad_texts(domain) | st.integers() | wrong_types


def good_texts(domain: Domain) -> list[str]:
    """Text a flag of `domain` must take: its edges, and each of its values where it has few."""
    match domain:
        case Integers(low=low, high=high):
            return [str(low), str(high)]
        case Reals(low=low, high=high, low_open=low_open):
            return [repr(math.nextafter(low, math.inf) if low_open else low), repr(high)]
        case Choices(values=values, fold_case=fold_case):
            return [*values, *(value.upper() for value in values if fold_case)]
        case Texts():
            return ["x", "a b"]
        case Hosts():
            return ["localhost", "127.0.0.1", "0.0.0.0"]
        case Urls():
            return ["http://127.0.0.1:8000", "https://localhost", "http://127.0.0.1:1", "http://127.0.0.1:65535"]
        case ExistingPaths():
            return [str(HERE), str(HERE.parent)]
        case FilePaths():
            return [str(HERE), str(HERE.parent / "new-events.jsonl")]
        case FolderPaths():
            return [str(HERE.parent), str(HERE.parent / "new" / "deeper")]
        case CommaLists(of=of):
            return [good_texts(of)[0], ",".join(good_texts(of))]
        case DTypes():
            return list(DTYPE_NAMES)
        case JsonObjects():  # the one such option: speculative_config, whose reader checks the values
            return ['{"method": "ngram", "num_speculative_tokens": 1}', json.dumps(SPECULATIVE_EDGE)]
        case LoRAModules():
            return [f"a={HERE.parent}", f"a b={HERE.parent.parent}"]
    raise AssertionError(f"no cases for {domain!r}: add its kind here")


def good_values(domain: Domain) -> list[object]:
    match domain:
        case Integers(low=low, high=high):
            return [low, high]
        case Reals(low=low, high=high, low_open=low_open):
            return [math.nextafter(low, math.inf) if low_open else low, high]
        case Booleans():
            return [True, False]
        case Tuples(of=of):
            return [(), tuple(good_values(of))]
        case ExistingPaths() | FilePaths() | FolderPaths():
            return [*good_texts(domain), *map(Path, good_texts(domain))]
        case DTypes():
            return [*DTYPE_NAMES, torch.float32, torch.bfloat16, torch.float16]
        case JsonObjects():
            return [json.loads(text) for text in good_texts(domain)]
    return list(good_texts(domain))


# ---- the option lists: LLM(**options), EngineConfig, ServeOptions, the CLI's sampling flags ------------


def option_fields() -> list[tuple[type, Field]]:
    return [(options, spec) for options in OPTION_LISTS for spec in fields(options)]


def optional(options: type, name: str) -> bool:
    return type(None) in get_args(get_type_hints(options)[name])


FIELD_IDS = [f"{options.__name__}.{spec.name}" for options, spec in option_fields()]


@pytest.mark.parametrize(("options", "spec"), option_fields(), ids=FIELD_IDS)
def test_every_option_has_a_domain(options, spec):
    assert isinstance(spec.metadata.get("domain"), Domain), f"give {options.__name__}.{spec.name} a domain"


@pytest.mark.parametrize(("options", "spec"), option_fields(), ids=FIELD_IDS)
def test_a_value_outside_an_options_domain_is_refused_naming_option_and_value(options, spec):
    domain = spec.metadata["domain"]
    build = LLM if options is EngineConfig else options  # LLM: refused before any model is loaded

    @EXAMPLES
    @given(bad_values(domain) | (st.nothing() if optional(options, spec.name) else st.none()))
    def refused(value):
        with pytest.raises(ValueError) as raised:
            build(**{spec.name: value})
        assert spec.name in str(raised.value) and repr(value) in str(raised.value)

    refused()


@pytest.mark.parametrize(("options", "spec"), option_fields(), ids=FIELD_IDS)
def test_each_value_at_the_edge_of_an_options_domain_is_accepted(options, spec):
    # Checked as the list's own __post_init__ checks each field; the rules between options are below.
    for value in good_values(spec.metadata["domain"]) + ([None] if optional(options, spec.name) else []):
        check_option(options, spec.name, value)


def test_ports_are_1_to_65535():
    """The cases above come from the domains themselves; this pins the one the issue was about."""
    for options, name in [(ServeOptions, "port"), (EngineConfig, "master_port")]:
        assert domain_of(options, name) == Integers(1, 65535)
    for port in (0, -1, 65536, 99999):
        with pytest.raises(ValueError, match=f"port must be an integer from 1 to 65535, got {port}"):
            ServeOptions(port=port)
    assert ServeOptions(port=1).port == 1 and ServeOptions(port=65535).port == 65535


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2, "master_port": 29500}, "node_rank"),
        ({"nnodes": 2, "tensor_parallel_size": 3, "master_port": 29500}, "nnodes"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "master_port"),
        ({"num_kv_blocks": 8, "kv_cache_memory": 1 << 20}, "kv_cache_memory"),
    ],
)
def test_options_that_cannot_go_together_are_refused_naming_them(options, named):
    with pytest.raises(ValueError, match=named):
        LLM(**options)
    EngineConfig(**(options | {"nnodes": 1, "node_rank": 0, "num_kv_blocks": None}))  # the clash taken out: taken


# ---- every flag of every command, read by the real parser in-process --------------------------------


@dataclass(frozen=True)
class Site:
    """One flag of one command: the words that name the command, and what the command also requires."""

    command: tuple[str, ...]
    action: argparse.Action
    required: tuple[str, ...]  # arguments the command cannot parse without

    @property
    def flag(self) -> str:
        return self.action.option_strings[0]

    def argv(self, *flag_args: str) -> list[str]:
        if self.command:
            return [*self.command, *flag_args, *self.required]
        return [*flag_args, "generate", "hi"]  # a flag of `pagedllm` itself, before any command

    @property
    def domain(self) -> Domain | None:
        return self.action.type.domain if isinstance(self.action.type, ArgType) else None


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*words, name))


def required_args(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    args: list[str] = []
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            args.append("hi")  # the prompt: free text, not an option
        elif action.required and action.option_strings:
            args += [action.option_strings[0], good_texts(action.type.domain)[0]]
    return tuple(args)


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of `parser`: not its positional arguments, sub-commands or --help."""
    return [
        action for action in parser._actions if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]


def sites() -> list[Site]:
    return [
        Site(words, action, required_args(parser))
        for words, parser in commands(make_parser())
        if words not in UNCOVERED_COMMANDS
        for action in flags(parser)
    ]


SITES = sites()
SITE_IDS = [" ".join([*site.command, site.flag]) for site in SITES]
PARSER = make_parser()


def parse(argv: list[str]) -> tuple[argparse.Namespace | None, int | None, str]:
    """`pagedllm argv` read as the CLI reads it: the namespace, or argparse's exit status; and its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return PARSER.parse_args(argv), None, err.getvalue()
        except SystemExit as exit:
            return None, exit.code, err.getvalue()


def test_every_flag_of_every_command_has_a_domain():
    """A flag takes no value (a switch) or checks its value against a domain; `--flag TEXT` with a plain
    `type=int` would take -1 for a port."""
    for words, parser in commands(make_parser()):
        unchecked = [a.option_strings[0] for a in flags(parser) if a.nargs != 0 and not isinstance(a.type, ArgType)]
        if words in UNCOVERED_COMMANDS:
            assert unchecked, f"every flag of {' '.join(words)} has a domain now: take it out of UNCOVERED_COMMANDS"
        else:
            assert not unchecked, f"give these flags of `pagedllm {' '.join(words)}` a domain: {unchecked}"


@pytest.mark.parametrize("site", SITES, ids=SITE_IDS)
def test_a_flag_value_outside_its_domain_is_argparses_error_naming_flag_and_value(site):
    # A switch given a value: `--enable-prefix-caching=yes`.
    texts = bad_texts(site.domain) if site.domain else st.text()

    @EXAMPLES
    @given(texts)
    def refused(text):
        namespace, status, err = parse(site.argv(f"{site.flag}={text}"))
        assert status == 2, f"{site.flag}={text!r} was taken: {namespace}"
        assert site.flag in err and repr(text) in err

    refused()
    if site.domain is not None and site.action.nargs is None:
        # argparse drops a `--` value and left such a flag an unchecked empty list (`--log-level=--`).
        namespace, status, err = parse(site.argv(f"{site.flag}=--"))
        assert status == 2 and site.flag in err and "'--'" in err, f"{site.flag}=-- was taken: {namespace}"


@pytest.mark.parametrize("site", SITES, ids=SITE_IDS)
def test_each_flag_value_at_the_edge_of_its_domain_is_taken(site):
    if site.domain is None:  # a switch: each of its spellings
        for spelling in site.action.option_strings:
            namespace, status, err = parse(site.argv(spelling))
            assert status is None, err
        return
    for text in good_texts(site.domain):
        namespace, status, err = parse(site.argv(site.flag, text))
        assert status is None, err
        value = getattr(namespace, site.action.dest)
        assert site.domain.admits(value[0] if site.action.nargs == "+" else value)


# ---- the real command, as a user runs it ---------------------------------------------------------------


def test_serve_refuses_a_port_outside_1_to_65535_before_starting(tmp_path):
    """99999 used to listen on 34463 (modulo 65536), and -1 to fail deep in uvicorn."""
    ports = ("99999", "-1")
    logs = [tmp_path / f"serve-{port}.log" for port in ports]
    with contextlib.ExitStack() as stack:
        sinks = [stack.enter_context(log.open("w")) for log in logs]
        # Both at once: each pays the CLI's imports, and nothing more if it is refused as it must be.
        runs = [
            subprocess.Popen(
                [sys.executable, "-m", "pagedllm", "serve", "--port", port],
                stdout=sink,
                stderr=sink,
                start_new_session=True,
            )
            for port, sink in zip(ports, sinks, strict=True)
        ]
        for run in runs:
            stack.callback(kill_group, run)
        codes = [run.wait(timeout=60) for run in runs]
    for port, log, code in zip(ports, logs, codes, strict=True):
        output = log.read_text()
        assert code == 2, output
        assert f"argument --port: must be an integer from 1 to 65535, got '{port}'" in output
        assert "pagedllm: serving" not in output


def kill_group(run: subprocess.Popen) -> None:
    """A server that started after all must not outlive the test, nor must its engine core."""
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
