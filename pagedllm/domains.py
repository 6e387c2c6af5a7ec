"""The values an option can mean. Each option field (`config.option`) and each hand-written flag carries
a `Domain`; the checks of `LLM(**options)`, of the dataclasses and of every command's flags all come
from it, so an option cannot be checked in one place and not in another."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# Counts of tokens, blocks, sequences, ranks and threads travel in int32 tensors and C ints.
INT32_MAX = 2**31 - 1
# Byte counts travel as int64 (torch sizes, file offsets).
INT64_MAX = 2**63 - 1
# Linux's PID_MAX_LIMIT: no process id is larger.
PID_MAX = 2**22


class Domain(ABC):
    """`admits` judges a Python value; `parse` turns a flag's text into a value (ValueError where it cannot);
    `describe` completes "<option> must be ..."."""

    __slots__ = ()

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def admits(self, value: object) -> bool: ...

    def parse(self, text: str) -> object:
        return text

    def flag_kwargs(self) -> dict[str, Any]:
        """What `argparse.add_argument` needs for a flag whose values are this domain."""
        return {"type": ArgType(self)}


@dataclass(frozen=True, slots=True)
class ArgType:
    """argparse's `type` for a flag of `domain`: text outside it is argparse's error (exit status 2, the flag
    and the text named) while the command line is read, before any model loads or any port opens."""

    domain: Domain

    def __call__(self, text: str) -> object:
        with contextlib.suppress(ValueError):
            value = self.domain.parse(text)
            if self.domain.admits(value):
                return value
        raise argparse.ArgumentTypeError(f"must be {self.domain.describe()}, got {text!r}")


@dataclass(frozen=True, slots=True)
class Integers(Domain):
    low: int
    high: int

    def describe(self) -> str:
        return f"an integer from {self.low} to {self.high}"

    def admits(self, value: object) -> bool:
        # A bool is an int to Python, never to someone who wrote True for a count.
        return isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high

    def parse(self, text: str) -> object:
        return int(text)


@dataclass(frozen=True, slots=True)
class Reals(Domain):
    low: float
    high: float  # math.inf: no bound above, and inf itself is a value (e.g. "all at once")
    low_open: bool = False

    def describe(self) -> str:
        bounds = [f"above {self.low:.15g}" if self.low_open else f"at least {self.low:.15g}"]
        if self.high != math.inf:
            bounds.append(f"at most {self.high:.15g}")
        return "a number " + " and ".join(bounds)

    def admits(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high  # NaN fails both comparisons

    def parse(self, text: str) -> object:
        return float(text)


@dataclass(frozen=True, slots=True)
class Choices(Domain):
    values: tuple[str, ...]
    fold_case: bool = False  # log levels: WARNING and warning are one level

    def describe(self) -> str:
        return "one of " + ", ".join(self.values)

    def admits(self, value: object) -> bool:
        return isinstance(value, str) and (value.lower() if self.fold_case else value) in self.values

    def flag_kwargs(self) -> dict[str, Any]:
        return {"type": ArgType(self), "metavar": "{" + ",".join(self.values) + "}"}


@dataclass(frozen=True, slots=True)
class Booleans(Domain):
    def describe(self) -> str:
        return "True or False"

    def admits(self, value: object) -> bool:
        return isinstance(value, bool)

    def flag_kwargs(self) -> dict[str, Any]:
        return {"action": argparse.BooleanOptionalAction}


@dataclass(frozen=True, slots=True)
class Texts(Domain):
    """Names and keys: an empty one, or one with stray spaces around it, is a mistake no server would match."""

    def describe(self) -> str:
        return "a non-empty text without surrounding whitespace"

    def admits(self, value: object) -> bool:
        return isinstance(value, str) and value != "" and value == value.strip()


@dataclass(frozen=True, slots=True)
class Hosts(Domain):
    def describe(self) -> str:
        return "a host name or address that resolves"

    def admits(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        try:
            socket.getaddrinfo(value, None)
        except (OSError, ValueError):  # gaierror, or the IDNA codec's UnicodeError for a malformed name
            return False
        return True


@dataclass(frozen=True, slots=True)
class Urls(Domain):
    def describe(self) -> str:
        return "an http:// or https:// URL with a host (and a port from 1 to 65535, if any)"

    def admits(self, value: object) -> bool:
        if not isinstance(value, str) or value != value.strip():
            return False
        try:
            parts = urlsplit(value)
            port = parts.port  # ValueError when it is not a number from 0 to 65535
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (port is None or port >= 1)


# Path("") is the current folder: an empty text is refused, never read as one.
def _path(value: object) -> Path | None:
    """`value` as a path (with ~ expanded), or None where it is not one."""
    if isinstance(value, str) and value:
        return Path(value).expanduser()
    return value.expanduser() if isinstance(value, Path) else None


def _parse_path(text: str) -> Path:
    if not text:
        raise ValueError("an empty path")
    return Path(text)


# The os.path predicates below, not Path's methods: they answer False (not raise) for a NUL byte in a path.
@dataclass(frozen=True, slots=True)
class ExistingPaths(Domain):
    def describe(self) -> str:
        return "an existing file or folder"

    def admits(self, value: object) -> bool:
        path = _path(value)
        return path is not None and os.path.exists(path)

    def parse(self, text: str) -> object:
        return _parse_path(text)


@dataclass(frozen=True, slots=True)
class FilePaths(Domain):
    """A file written (or appended to): its folder must be there already."""

    def describe(self) -> str:
        return "a file (existing, or new in an existing folder)"

    def admits(self, value: object) -> bool:
        path = _path(value)
        return path is not None and not os.path.isdir(path) and os.path.isdir(path.parent)

    def parse(self, text: str) -> object:
        return _parse_path(text)


@dataclass(frozen=True, slots=True)
class FolderPaths(Domain):
    """A folder written into, made with its parents where missing: no file may stand in the way."""

    def describe(self) -> str:
        return "a folder (existing, or new under existing folders)"

    def admits(self, value: object) -> bool:
        path = _path(value)
        if path is None:
            return False
        existing = next((p for p in (path, *path.parents) if os.path.exists(p)), None)
        return existing is not None and os.path.isdir(existing)

    def parse(self, text: str) -> object:
        return _parse_path(text)


@dataclass(frozen=True, slots=True)
class Tuples(Domain):
    """Several values of `of`; as a flag, one or more of them after it."""

    of: Domain

    def describe(self) -> str:
        return f"a tuple whose every item is {self.of.describe()}"

    def admits(self, value: object) -> bool:
        return isinstance(value, tuple) and all(self.of.admits(item) for item in value)

    def flag_kwargs(self) -> dict[str, Any]:
        return self.of.flag_kwargs() | {"nargs": "+"}


@dataclass(frozen=True, slots=True)
class CommaLists(Domain):
    """Several values of `of` in one flag, separated by commas; parsed into a tuple."""

    of: Domain

    def describe(self) -> str:
        return f"a comma-separated list whose every item is {self.of.describe()}"

    def admits(self, value: object) -> bool:
        return isinstance(value, tuple) and len(value) > 0 and all(self.of.admits(item) for item in value)

    def parse(self, text: str) -> object:
        return tuple(self.of.parse(item.strip()) for item in text.split(","))


@dataclass(frozen=True, slots=True)
class JsonObjects(Domain):
    """A JSON object (a dict from Python) whose keys are among `keys`; what each key's value may be is for the
    option's reader to check (its ValueError names the key)."""

    keys: tuple[str, ...]

    def describe(self) -> str:
        return f"a JSON object with keys among {', '.join(self.keys)}"

    def admits(self, value: object) -> bool:
        return isinstance(value, dict) and all(key in self.keys for key in value)

    def parse(self, text: str) -> object:
        return json.loads(text)


POSITIVE_INTS = Integers(1, INT32_MAX)
NON_NEGATIVE_INTS = Integers(0, INT32_MAX)
PORTS = Integers(1, 65535)
# torch.Generator.manual_seed's range, as SamplingParams.seed's.
SEEDS = Integers(-(2**63), 2**64 - 1)
# Waits in seconds: a zero wait cannot succeed, and Python's locks and sleeps take no longer one than this.
WAITS = Reals(0.0, threading.TIMEOUT_MAX, low_open=True)
