"""The KV cache tensor: private memory, or a shared file mapping that a second process maps too
(the worker's API process, which runs the KV transfer, beside its engine-core process).

Layout: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; see kv_transfer/layout.py.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      path: str | None = None) -> torch.Tensor:
    """A zeroed KV cache; with `path` (CPU only), a shared file mapping that another process
    maps with `map_kv_cache(path, shape, dtype)`."""
    if path is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    if device.type != "cpu":
        raise ValueError("a file-backed KV cache needs the CPU device")
    return map_kv_cache(path, shape, dtype).zero_()


def map_kv_cache(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map the file-backed KV cache at `path` (created if missing) with MAP_SHARED."""
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def num_blocks_for_memory(kv_bytes: int, cfg: ModelConfig, block_size: int,
                          dtype: torch.dtype) -> int:
    """How many blocks (every layer's K and V) fit in `kv_bytes`."""
    per_block = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
                 * torch.tensor([], dtype=dtype).element_size())
    return max(1, kv_bytes // per_block)
