"""C sources built on first use with the system compiler, cached by content, loaded through ctypes; and
the crash-safe cache entries that cache (and the GGUF conversion cache, `models/gguf.py`) is made of.

Every C source and header lives in `pagedllm/csrc/` (the attention kernels, the model's fused
element-wise ops); a caller asks `load` for one by name. When no compiler is available, `load` returns
None and the caller falls back to torch ops. Set PAGEDLLM_NATIVE=0 to disable every native library.

A cache entry is a folder `<root>/<name>/`. It is built in a locked staging folder beside it, given a
manifest last (each file's size, and a sha256 of the small ones), and published by one rename, so a
kill at any moment leaves either no entry or a complete one. An entry is trusted only while it matches
its manifest; one that does not is removed, with a warning that says why, and built again.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The sources, and the headers every one may include (`#include "bf16.h"`): those are part of every
# library's cache key.
CSRC_DIR = Path(__file__).parent / "csrc"

# The parts of -ffast-math that let reductions vectorize, but not -ffast-math itself: linking with it
# sets flush-to-zero for the whole process.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
    "-shared",
    "-fPIC",
)

# Written last into a cache entry: an entry without it was never completed.
MANIFEST = "pagedllm_manifest.json"
# Files up to this size (configs, tokenizers, compiled libraries) are hashed when an entry is written
# and again every time it is opened: ~3 ms for the default model's folder. Larger ones (its 540 MB of
# float32 weights) are checked by size only: hashing them would add over 0.5 s to every start, and
# what a kill, a full disk or a cut-short copy leaves behind has the wrong size; bit rot inside a file
# of the right size is left to the filesystem.
HASHED_UP_TO = 16 << 20
# Staging folders (and entries set aside for removal) are named with this prefix, so they are never
# taken for entries. One that nobody holds a lock on was left by a process that died; the grace period
# covers the instant between creating a staging folder and locking it.
STAGING_PREFIX = ".staging-"
STALE_AFTER_S = 60.0


def cache_root() -> Path:
    """pagedllm's cache root: `$PAGEDLLM_CACHE_DIR` if set, else `~/.cache/pagedllm`."""
    configured = os.environ.get("PAGEDLLM_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pagedllm"


def load(source_name: str) -> ctypes.CDLL | None:
    """The compiled library of `csrc/<source_name>`, or None (with a warning) where it cannot be built."""
    if os.environ.get("PAGEDLLM_NATIVE", "1") == "0":
        return None
    try:
        return _load(CSRC_DIR / source_name)
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("native library %s unavailable (%s); using the torch path", source_name, error)
        return None


def _load(source: Path) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler found")
    root, name = cache_root() / "native", _library_key(source, compiler)
    build = partial(_compile, source, compiler)
    folder = cached_folder(root, name, build)
    try:
        return ctypes.CDLL(str(folder / f"{source.stem}.so"))
    except OSError as error:
        # The file is as its manifest says, so the manifest vouches for a bad build (or came from
        # elsewhere): build it once more; a second failure is the compiler's or the system's, and
        # `load` reports it.
        _discard(folder, f"ctypes cannot load it ({error})")
        return ctypes.CDLL(str(cached_folder(root, name, build) / f"{source.stem}.so"))


def _library_key(source: Path, compiler: str) -> str:
    """The source, its headers, the compiler and flags, and the CPU's instruction sets: built with
    -march=native, a library from one machine must never be loaded on another that lacks its instructions
    (a cache folder on a shared home directory)."""
    key = hashlib.sha256(source.read_bytes() + " ".join((compiler, *FLAGS)).encode())
    for header in sorted(CSRC_DIR.glob("*.h")):
        key.update(header.read_bytes())
    key.update(cpu_flags().encode())
    return f"{source.stem}-{key.hexdigest()[:16]}"


def cpu_flags() -> str:
    """The CPU's feature flags, sorted ('' where /proc/cpuinfo cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    flags = next((line.split(":", 1)[1] for line in lines if line.startswith("flags")), "")
    return " ".join(sorted(flags.split()))


def _compile(source: Path, compiler: str, out_dir: Path) -> dict[str, Any]:
    library = out_dir / f"{source.stem}.so"
    command = [compiler, *FLAGS, f"-I{CSRC_DIR}", str(source), "-o", str(library), "-lm"]
    subprocess.run(command, check=True, capture_output=True)
    return {"source": source.name, "compiler": compiler}


# --- crash-safe cache entries --------------------------------------------------------------------


def cached_folder(root: Path, name: str, build: Callable[[Path], Mapping[str, Any]]) -> Path:
    """`root/name`, first built by `build` unless a complete and intact one is there already.

    `build(folder)` writes the entry's files into an empty folder and returns what the manifest should
    record about them. Processes that build the same entry at once all end with a valid one.
    """
    folder = root / name
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale(root)
    if folder.exists():
        problem = _entry_problem(folder)
        if problem is None:
            return folder
        _discard(folder, problem)
    with _staging(root, name) as staging:
        record = build(staging)
        _write_manifest(staging, record)
        _publish(staging, folder)
    return folder


def _entry_problem(folder: Path) -> str | None:
    """What is wrong with the published entry `folder`, or None when it matches its manifest."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        files = {name: (int(entry["size"]), entry.get("sha256")) for name, entry in listed.items()}
    except FileNotFoundError:
        return f"it has no {MANIFEST} (made by an older pagedllm, or not by pagedllm)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"its {MANIFEST} is unreadable ({error!r})"
    for relative, (written, digest) in files.items():
        path = folder / relative
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{relative} is missing"
        if size != written:
            return f"{relative} has {size} bytes where {written} were written"
        if digest is not None and _sha256(path) != digest:
            return f"{relative} does not match its sha256"
    return None


def _discard(folder: Path, problem: str) -> None:
    """Remove the entry `folder`, saying why. It is first renamed aside, so no process can take it for
    an entry while it is half deleted, and a kill mid-removal leaves a stale staging folder behind."""
    logger.warning("cache entry %s is damaged: %s; removing it to build it again", folder, problem)
    aside = folder.with_name(f"{STAGING_PREFIX}{folder.name}-bad-{secrets.token_hex(4)}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return  # another process removed it first
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def _staging(root: Path, name: str) -> Iterator[Path]:
    """An empty folder in `root`, locked while this process lives, removed unless published."""
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-", dir=root))
    # The lock is what tells a live build from a dead one's leftovers: the kernel drops it when the
    # process ends, however it ends. Where folders cannot be locked (NFS), no sweeper can lock them
    # either, so leftovers are kept rather than live builds removed.
    lock = os.open(staging, os.O_RDONLY)
    try:
        with suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # already gone once published
        os.close(lock)


def _sweep_stale(root: Path) -> None:
    """Remove the staging folders that processes killed mid-build left in `root`."""
    for path in root.glob(f"{STAGING_PREFIX}*"):
        lock = _lock_if_stale(path)
        if lock is None:
            continue
        logger.warning("removing %s, left by a cache build that did not finish", path)
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)


def _lock_if_stale(path: Path) -> int | None:
    """A lock on the staging folder `path` if it is a dead build's, else None."""
    try:
        if time.time() - path.stat().st_mtime < STALE_AFTER_S:
            return None
        lock = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # published or removed meanwhile
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its builder is still at work (or folders cannot be locked here)
        os.close(lock)
        return None
    return lock


def _write_manifest(staging: Path, record: Mapping[str, Any]) -> None:
    """Every file's size (and small files' sha256), written after the files are on disk, so a power
    loss cannot leave a manifest that vouches for data still in the page cache."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        _fsync(path)
        size = path.stat().st_size
        files[path.relative_to(staging).as_posix()] = (
            {"size": size, "sha256": _sha256(path)} if size <= HASHED_UP_TO else {"size": size}
        )
    manifest = staging / MANIFEST
    manifest.write_text(json.dumps({"files": files, "record": dict(record)}, indent=2) + "\n")
    _fsync(manifest)
    _fsync(staging)


def _publish(staging: Path, folder: Path) -> None:
    """Rename `staging` to `folder`, unless another process published an intact `folder` first."""
    while True:
        try:
            os.rename(staging, folder)
            break
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        problem = _entry_problem(folder)
        if problem is None:
            return  # theirs is as good as ours, which `_staging` removes
        _discard(folder, problem)
    _fsync(folder.parent)  # the rename itself, durable


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
