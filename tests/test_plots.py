"""The benchmark plots: each function writes a real PNG of the agreed pixel size with the data drawn on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.image import imread

from pagedllm.benchmarks.memory import MemoryResult
from pagedllm.benchmarks.plots import (
    DOUBLE,
    DPI,
    WIDE,
    plot_embed_throughput,
    plot_latency_cdfs,
    plot_memory,
    plot_throughput,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROWS = [
    {"engine": "pagedllm", "output_tok_per_s": 120.0, "total_tok_per_s": 480.0, "requests_per_s": 1.5},
    {"engine": "hf-static", "output_tok_per_s": 60.0, "total_tok_per_s": 200.0, "requests_per_s": 0.7},
    {"engine": "vllm", "output_tok_per_s": 100.0, "total_tok_per_s": 400.0, "requests_per_s": 1.2},
]


def read_png(path: Path, size: tuple[float, float]) -> np.ndarray:
    """The image, after checking it is a PNG of `size` inches at DPI, with more than a background on it."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[:2] == (round(size[1] * DPI), round(size[0] * DPI))
    assert len(np.unique(image.reshape(-1, image.shape[2]), axis=0)) > 10  # axes, text and data, not a blank
    return image


def memory_results() -> list[MemoryResult]:
    results = [MemoryResult(name) for name in ("orca-max", "orca-oracle", "paged-8", "paged-16")]
    for step in range(1, 40):
        for scale, result in enumerate(results, start=1):
            result.record(stored=step * scale, reserved=40 * 4, concurrency=scale + step % 3)
    return results


def test_throughput_plot_is_a_png_of_the_agreed_size(tmp_path):
    path = tmp_path / "nested" / "throughput.png"
    plot_throughput(ROWS, path)
    read_png(path, WIDE)


def test_throughput_plot_draws_the_numbers_it_is_given(tmp_path):
    plot_throughput(ROWS, tmp_path / "a.png")
    plot_throughput([ROWS[0], {**ROWS[1], "output_tok_per_s": 240.0}, ROWS[2]], tmp_path / "b.png")
    assert not np.array_equal(imread(tmp_path / "a.png"), imread(tmp_path / "b.png"))


def test_memory_plots_are_two_pngs_named_for_the_docs(tmp_path):
    paths = plot_memory(memory_results(), tmp_path)
    assert paths == [tmp_path / "memory_utilization.png", tmp_path / "memory_concurrency.png"]
    utilization, concurrency = (read_png(path, WIDE) for path in paths)
    assert not np.array_equal(utilization, concurrency)


def test_memory_plot_shows_paged_16_not_every_block_size(tmp_path):
    results = memory_results()
    plot_memory(results, tmp_path / "with_paged_8")
    # Another paged-8 series changes nothing: only the engine's default block size is drawn.
    results[2] = MemoryResult("paged-8", [1] * 5, [2] * 5, [1] * 5)
    plot_memory(results, tmp_path / "other_paged_8")
    for name in ("memory_utilization.png", "memory_concurrency.png"):
        assert np.array_equal(imread(tmp_path / "with_paged_8" / name), imread(tmp_path / "other_paged_8" / name))


def test_latency_cdfs_are_one_png_with_two_panels(tmp_path):
    path = tmp_path / "latency_cdf.png"
    plot_latency_cdfs([0.05, 0.08, 0.2, 0.21], [0.010, 0.012, 0.011], path)
    image = read_png(path, DOUBLE)
    plot_latency_cdfs([0.05, 0.08, 0.2, 0.9], [0.010, 0.012, 0.011], tmp_path / "other.png")
    other = imread(tmp_path / "other.png")
    # Only the TTFT panel (left half) moves when only the TTFTs change.
    half = image.shape[1] // 2
    assert not np.array_equal(image[:, :half], other[:, :half])
    assert np.array_equal(image[:, half + 20 :], other[:, half + 20 :])


def test_embed_plot_is_a_png_of_the_agreed_size_that_draws_its_numbers(tmp_path):
    sizes = [1, 8, 32, 128, 256]
    series = {"pagedllm": [10.0, 40.0, 60.0, 62.0, 61.0], "sentence-transformers": [8.0, 30.0, 50.0, 55.0, 54.0]}
    plot_embed_throughput(sizes, series, tmp_path / "a.png", "Embedding throughput")
    image = read_png(tmp_path / "a.png", WIDE)
    plot_embed_throughput(
        sizes, {**series, "pagedllm": [10.0, 40.0, 60.0, 62.0, 90.0]}, tmp_path / "b.png", "Embedding throughput"
    )
    assert not np.array_equal(image, imread(tmp_path / "b.png"))
