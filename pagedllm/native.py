"""C sources built on first use with the system compiler, cached by content, loaded through ctypes.

Every C source and header lives in `pagedllm/csrc/` (the attention kernels, the model's fused
element-wise ops); a caller asks `load` for one by name. When no compiler is available, `load` returns
None and the caller falls back to torch ops. Set PAGEDLLM_NATIVE=0 to disable every native library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

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


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    return Path(root) / "native"


def load(source_name: str) -> ctypes.CDLL | None:
    """The compiled library of `csrc/<source_name>`, or None (with a warning) where it cannot be built."""
    if os.environ.get("PAGEDLLM_NATIVE", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(_build(CSRC_DIR / source_name)))
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("native library %s unavailable (%s); using the torch path", source_name, error)
        return None


def _build(source: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler found")
    key = hashlib.sha256(source.read_bytes() + " ".join((compiler, *FLAGS)).encode())
    for header in sorted(CSRC_DIR.glob("*.h")):
        key.update(header.read_bytes())
    digest = key.hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, f"-I{CSRC_DIR}", str(source), "-o", str(built), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(built, target)
    return target
