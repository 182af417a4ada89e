"""How many KV blocks a replica's pools get: the device pool from its byte budget (or the GPU's free
memory), the host tier from the swap and host-cache budgets (``EngineConfig``'s fields say the defaults)."""

from __future__ import annotations

import torch

from kvmesh.core.engine_config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_HOST_CACHE_FRACTION,
    GPU_KV_FRACTION,
    MAX_DEFAULT_HOST_CACHE_BYTES,
    MAX_DEFAULT_SWAP_BYTES,
    EngineConfig,
)


def device_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    """``num_kv_blocks``, else ``kv_cache_bytes``, else ``GPU_KV_FRACTION`` of the free GPU memory (CPU:
    ``DEFAULT_CPU_KV_BYTES``), in blocks."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    return max(1, budget // bytes_per_block)


def host_blocks(config: EngineConfig, device: torch.device, num_blocks: int, bytes_per_block: int) -> tuple[int, int]:
    """(swap blocks, host prefix-cache blocks): room for swapped-out sequences (by default half the device
    pool's bytes, at most ``MAX_DEFAULT_SWAP_BYTES``; none with ``preemption_mode: recompute``) and for
    prefix blocks the device pool evicts (by default, on CUDA, ``DEFAULT_HOST_CACHE_FRACTION`` of the
    pool's bytes, at most ``MAX_DEFAULT_HOST_CACHE_BYTES``; on the CPU a quarter of the pool's bytes when a
    disk tier needs it, else none)."""
    pool_bytes = num_blocks * bytes_per_block
    swap = config.swap_space_bytes
    if swap is None:
        swap = min(pool_bytes // 2, MAX_DEFAULT_SWAP_BYTES)
    if config.preemption_mode == "recompute":
        swap = 0
    cache = config.host_cache_bytes
    if cache is None:
        default = min(int(pool_bytes * DEFAULT_HOST_CACHE_FRACTION), MAX_DEFAULT_HOST_CACHE_BYTES)
        cache = default if device.type == "cuda" else pool_bytes // 4 if config.disk_cache_dir else 0
    return swap // bytes_per_block, cache // bytes_per_block
