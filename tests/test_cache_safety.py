"""What pagedllm writes to its cache survives kills, damage and races: the GGUF conversion cache and the
compiled-library cache are published whole or not at all, damaged entries are rebuilt, and the
staging folders of killed builds are swept once stale. Builds here really are killed (SIGKILL) and
really race (two processes); nothing of the code under test is mocked."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagedllm import native
from pagedllm.models.gguf import conversion_key, gguf_to_hf_folder
from tests.test_gguf import write_tiny_llama_gguf

REPO = Path(__file__).resolve().parent.parent
CONVERT = "import sys; from pagedllm.models.gguf import gguf_to_hf_folder; print(gguf_to_hf_folder(sys.argv[1]))"
BUILD_NATIVE = "from pagedllm import native; assert native.load('fused_ops.c') is not None"
# Holds an exclusive lock on a folder, as a live build holds its staging folder's, until killed.
HOLD_LOCK = (
    "import fcntl, os, sys, time; fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX); "
    "print('locked', flush=True); time.sleep(600)"
)


def child(code: str, *args: str, cache: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, **popen)


def staging_folders(root: Path) -> list[Path]:
    return sorted(root.glob(f"{native.STAGING_PREFIX}*"))


def age(path: Path, seconds: float) -> None:
    """Set `path`'s modification time `seconds` into the past, as if a build had died that long ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def same_tensors(folder: Path, expected: Path) -> bool:
    ours, theirs = load_file(folder / "model.safetensors"), load_file(expected / "model.safetensors")
    return sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in ours)


def warnings_from(caplog: pytest.LogCaptureFixture, logger: str) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING)


# --- the GGUF conversion cache ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture(scope="module")
def clean_cache(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding one undisturbed conversion of `tiny_gguf`."""
    cache = tmp_path_factory.mktemp("clean_cache")
    gguf_to_hf_folder(tiny_gguf, cache_dir=cache)
    return cache


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(root))
    return root


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, what: str) -> None:
    while not condition():
        assert process.poll() is None, f"the child ended (exit {process.returncode}) before {what}"
        time.sleep(0.001)


def test_conversion_killed_midway_leaves_nothing_trusted(
    tiny_gguf: Path, clean_cache: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, entry = cache / "gguf", conversion_key(tiny_gguf)
    converting = child(CONVERT, str(tiny_gguf), cache=cache, stdout=subprocess.DEVNULL)
    # Killed once the weights are being written and before the manifest: the staging folder is half full.
    wait_for(lambda: any((s / "model.safetensors").exists() for s in staging_folders(root)), converting, "writing")
    converting.send_signal(signal.SIGKILL)
    assert converting.wait() == -signal.SIGKILL
    (leftover,) = staging_folders(root)
    assert not (root / entry).exists(), "the child was killed too late: it had published its folder"
    assert not (leftover / native.MANIFEST).exists()

    folder = gguf_to_hf_folder(tiny_gguf)  # from $PAGEDLLM_CACHE_DIR
    assert folder == root / entry
    assert same_tensors(folder, clean_cache / "gguf" / entry)
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # Too fresh to tell from a build that has not locked its folder yet: left alone for now ...
    assert staging_folders(root) == [leftover]

    # ... and swept once stale, on any later start.
    age(leftover, 2 * native.STALE_AFTER_S)
    with caplog.at_level(logging.WARNING, logger="pagedllm.native"):
        assert gguf_to_hf_folder(tiny_gguf) == folder
    assert staging_folders(root) == []
    assert "did not finish" in warnings_from(caplog, "pagedllm.native")


def truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)


def rewrite_config_same_size(folder: Path) -> None:
    config = folder / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"llama"', '"llamb"'))
    assert len(config.read_text()) == len(text)


DAMAGE = {
    "truncated weights": (truncate_weights, "model.safetensors has"),
    "deleted tokenizer": (lambda folder: (folder / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "edited config": (rewrite_config_same_size, "config.json does not match its sha256"),
    "no manifest": (lambda folder: (folder / native.MANIFEST).unlink(), f"it has no {native.MANIFEST}"),
    "garbled manifest": (lambda folder: (folder / native.MANIFEST).write_text("{"), "is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_conversion_is_detected_and_rebuilt(
    damage: str, tiny_gguf: Path, clean_cache: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(clean_cache, cache)
    entry = cache / "gguf" / conversion_key(tiny_gguf)
    harm, complaint = DAMAGE[damage]
    harm(entry)
    with caplog.at_level(logging.WARNING, logger="pagedllm.native"):
        folder = gguf_to_hf_folder(tiny_gguf)
    assert folder == entry
    assert complaint in warnings_from(caplog, "pagedllm.native")
    assert same_tensors(folder, clean_cache / "gguf" / entry.name)
    assert (folder / "tokenizer.json").read_bytes() == (
        clean_cache / "gguf" / entry.name / "tokenizer.json"
    ).read_bytes()
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]  # the damaged one is gone


def test_concurrent_conversions_both_succeed(tiny_gguf: Path, clean_cache: Path, cache: Path) -> None:
    racers = [child(CONVERT, str(tiny_gguf), cache=cache, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    printed = [racer.communicate(timeout=300)[0].strip() for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    entry = cache / "gguf" / conversion_key(tiny_gguf)
    assert printed == [str(entry)] * 2
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]  # the loser's staging folder is gone
    assert same_tensors(entry, clean_cache / "gguf" / entry.name)


def test_a_live_builders_staging_folder_is_kept_until_it_dies(tiny_gguf: Path, clean_cache: Path, cache: Path) -> None:
    shutil.copytree(clean_cache, cache)
    staging = cache / "gguf" / f"{native.STAGING_PREFIX}{conversion_key(tiny_gguf)}-live"
    staging.mkdir()
    holder = child(HOLD_LOCK, str(staging), cache=cache, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    age(staging, 10 * native.STALE_AFTER_S)  # a slow build, but a live one
    gguf_to_hf_folder(tiny_gguf)
    assert staging.is_dir()

    holder.send_signal(signal.SIGKILL)
    holder.wait()
    gguf_to_hf_folder(tiny_gguf)
    assert not staging.exists()


# --- the compiled-library cache ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding the compiled fused ops, built by another process: this one must not have
    loaded them from that path, since the dynamic loader would hand back the loaded copy by name."""
    cache = tmp_path_factory.mktemp("native_cache")
    assert child(BUILD_NATIVE, cache=cache).wait() == 0
    return cache


def replace_library(folder: Path, content: bytes, *, update_manifest: bool) -> None:
    library = folder / "fused_ops.so"
    library.write_bytes(content)
    if update_manifest:  # a manifest that vouches for the bad file, so only loading it can tell
        manifest = folder / native.MANIFEST
        data = json.loads(manifest.read_text())
        data["files"]["fused_ops.so"] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
        manifest.write_text(json.dumps(data))


LIBRARY_DAMAGE = {
    "truncated": (lambda f, size: os.truncate(f / "fused_ops.so", size // 3), "fused_ops.so has"),
    "garbage of the same size": (
        lambda f, size: replace_library(f, b"\x7fELF" + b"\0" * (size - 4), update_manifest=False),
        "fused_ops.so does not match its sha256",
    ),
    "garbage its manifest vouches for": (
        lambda f, size: replace_library(f, b"not a shared object\n", update_manifest=True),
        "ctypes cannot load it",
    ),
}


def silu_mul(lib: ctypes.CDLL, gate_up: np.ndarray) -> np.ndarray:
    rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((rows, dim), dtype=np.float32)
    kernel = lib.silu_mul_f32
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    kernel(gate_up.ctypes.data, out.ctypes.data, rows, dim)
    return out


@pytest.mark.parametrize("damage", list(LIBRARY_DAMAGE))
def test_damaged_library_is_detected_and_rebuilt(
    damage: str, built_native: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(built_native, cache)
    (folder,) = (cache / "native").iterdir()
    harm, complaint = LIBRARY_DAMAGE[damage]
    harm(folder, (built_native / "native" / folder.name / "fused_ops.so").stat().st_size)
    with caplog.at_level(logging.WARNING, logger="pagedllm.native"):
        lib = native.load("fused_ops.c")
    assert lib is not None
    assert complaint in warnings_from(caplog, "pagedllm.native")
    assert [p.name for p in (cache / "native").iterdir()] == [folder.name]

    gate_up = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    gate, up = gate_up[:, :8], gate_up[:, 8:]
    np.testing.assert_allclose(silu_mul(lib, gate_up), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def test_a_library_built_for_one_cpu_is_not_found_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """-march=native: the cache key carries the CPU's instruction sets, so a shared cache folder never hands
    a library to a machine that lacks them."""
    source = native.CSRC_DIR / "fused_ops.c"
    here = native._library_key(source, "gcc")
    assert native._library_key(source, "gcc") == here  # stable on one machine
    monkeypatch.setattr(native, "cpu_flags", lambda: "avx2 fma sse4_2")
    other = native._library_key(source, "gcc")
    assert other != here and other.startswith("fused_ops-")
