"""A CPU worker's malloc thresholds: a freed step-sized tensor is reused without fresh pages from the kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Touch a 64 MiB tensor and free it, three times: the third one's minor page faults (4 KiB pages). (The heap
# settles on its second: glibc places the second tensor beside the first before it reuses a freed one.)
_THIRD_TOUCH_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "engine":  # the worker of a CPU engine sets them
    from pagedllm import LLM
    LLM(num_kv_blocks=16)
torch.ones(16 << 20)
torch.ones(16 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(16 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = (64 << 20) // 4096


def third_touch_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _THIRD_TOUCH_FAULTS, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_reused_without_page_faults():
    assert third_touch_faults("default") > PAGES // 2  # glibc maps 64 MiB afresh and faults on every page
    assert third_touch_faults("engine") < PAGES // 20
