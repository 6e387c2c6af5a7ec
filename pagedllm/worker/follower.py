"""The process of a tensor-parallel rank other than 0: joins the group, loads its shard of the model,
allocates its slice of every KV block, and carries out rank 0's steps until told to stop (or until rank 0
is gone, which breaks the group's connections)."""

from __future__ import annotations

import sys

import torch

from pagedllm.config import resolve_dtype
from pagedllm.distributed import parallel
from pagedllm.models.loader import load_model
from pagedllm.worker.cache_engine import KVShape
from pagedllm.worker.launcher import FollowerSpec
from pagedllm.worker.worker import Worker


def main(argv: list[str]) -> int:
    spec = FollowerSpec.from_json(argv[0])
    torch.set_num_threads(spec.threads)
    rendezvous = parallel.Rendezvous(spec.master_addr, spec.master_port, spec.timeout_s)
    shard = parallel.join(spec.rank, spec.world_size, rendezvous, spec.device)
    dtype = resolve_dtype(spec.dtype)
    loaded = load_model(spec.model, dtype, spec.device, shard)
    model = loaded.model
    shape = KVShape.of(
        model.num_layers, model.num_kv_heads, model.head_dim, spec.block_size, dtype, spec.kv_cache_dtype
    )
    worker = Worker(model, shape, spec.num_blocks, spec.num_cpu_blocks, spec.device, frozenset())
    try:
        worker.follow()
    except BaseException:
        parallel.leave()
        raise
    parallel.leave(synchronize=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
