"""The paged KV cache's memory: every layer's keys and values in blocks of `block_size` slots.

Head-major: each layer's cache is [Hkv, slots, D], so a head's keys of a run of blocks are one
[C, D] matrix (the attention matmuls read them without rearranging). Which blocks a request holds
is decided by the scheduler's block allocator (`scheduler/block_manager.py`); this object only
holds the memory and copies a block when the allocator forks a table.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        scratch_block: bool = False,
    ) -> None:
        """scratch_block: one more block, never handed to a request, whose first slot takes the
        K/V of the padding tokens of a CUDA graph's bucket (`scratch_slot`)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_slot: int | None = num_blocks * block_size if scratch_block else None
        slots = (num_blocks + int(scratch_block)) * block_size
        shape = (num_layers, num_kv_heads, slots, head_dim)
        self._maps: list[mmap.mmap] = []
        self.k = self._zeros(shape, device, dtype)
        self.v = self._zeros(shape, device, dtype)

    def _zeros(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Zeros. On a CPU in an anonymous memory map: the OS hands out zero pages as they are
        first written, so a start does not spend seconds writing gigabytes of zeros, and the
        cache's memory is committed as it fills."""
        if device.type != "cpu":
            return torch.zeros(shape, device=device, dtype=dtype)
        count = math.prod(shape)
        buf = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
        self._maps.append(buf)  # the tensor's memory: kept as long as the cache
        return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (a fork's partial block, `BlockManager.fork`)."""
        bs = self.block_size
        for cache in (self.k, self.v):
            cache[:, :, dst * bs : (dst + 1) * bs].copy_(cache[:, :, src * bs : (src + 1) * bs])

    @staticmethod
    def bytes_per_token(config: Any, dtype: torch.dtype) -> int:
        """K and V of one token in every layer, for a HF config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        elt = torch.tensor([], dtype=dtype).element_size()
        return int(2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elt)
