"""``AttentionPlan``: where one forward's new tokens go in the KV cache and what each of them sees.

Every forward of a decode step is the same shape of attention, per batch row b: the new tokens'
K/V are written to cache ``slots[b]``; every new token sees the cached keys ``[0, prefix[b])``;
key ``prefix[b] + j`` is visible to new token i iff ``block[b, i, j]`` (``block`` None: causal
over the T new tokens, j <= i, never built as a T x T tensor). One form serves them all::

    prefill           prefix = 0            block = None (causal)       slots = 0 .. T - 1
    one-token decode  prefix = length       block = [[True]]            slots = length
    tree verify       prefix = length       block = the tree's ancestor mask [N, N]
    drafter frontier  prefix = root slot+1  block = ancestry over the scratch slots after it

``prefix`` is a device tensor (each row of a batch has its own context length, and a step with
fixed shapes never reads it back); ``keys`` is the host's bound on the keys any row reads
(``prefix[b] + L <= keys <= cache slots``), what the torch reference attends over: the cache
length for a fixed-shape step, the longest row otherwise. The Triton kernel reads each row's
prefix on the device and never touches a key past it.

Built once per forward by ``causal`` / ``tree`` / ``explicit`` and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    slots: Tensor            # int64 [B, T]: cache slot of each new token's K/V
    prefix: Tensor           # int64 [B]: cached keys every new token of the row sees
    block: Tensor | None     # bool [B, T, L]: key prefix + j visible to token i; None: causal (L = T)
    keys: int                # host bound on prefix + L over the rows (the reference reads [0, keys))

    @property
    def width(self) -> int:
        """L: the masked block's columns."""
        return self.slots.shape[1] if self.block is None else self.block.shape[2]

    @classmethod
    def causal(cls, start: int, batch: int, T: int, device) -> "AttentionPlan":
        """T new tokens per row at slots ``start .. start + T - 1``, each seeing every cached key
        and the new tokens up to itself: a prefill (or a plain decode step of one request)."""
        prefix = torch.full((batch,), start, dtype=torch.long, device=device)
        return cls(prefix[:, None] + torch.arange(T, device=device), prefix, None, start + T)

    @classmethod
    def tree(cls, prefix: Tensor, block: Tensor, keys: int) -> "AttentionPlan":
        """A block of L = T new tokens per row at slots ``prefix .. prefix + T - 1`` (prefix [B]),
        token i seeing the cached prefix and the new tokens j with ``block[b, i, j]`` (a tree's
        ancestor-or-self mask: the verify)."""
        B, T, L = block.shape
        if L != T:
            raise InputError(f"a tree block is [B, T, T], got {list(block.shape)}")
        return cls(prefix[:, None] + torch.arange(T, device=prefix.device), prefix, block, keys)

    @classmethod
    def explicit(cls, slots: Tensor, prefix: Tensor, block: Tensor, keys: int) -> "AttentionPlan":
        """New tokens at any ``slots`` [B, T] (e.g. a drafter frontier's scratch slots, padding
        rows' trash slot) with the block [B, T, L] over ``prefix .. prefix + L - 1``."""
        return cls(slots, prefix, block, keys)

    def check(self, batch: int, T: int, cache_len: int) -> None:
        """Shapes and host-side bounds (no device value is read)."""
        if self.slots.shape != (batch, T) or self.prefix.shape != (batch,):
            raise InputError(f"the plan is for slots {list(self.slots.shape)}, prefix {list(self.prefix.shape)}; "
                             f"the forward has [B={batch}, T={T}] new tokens")
        if self.block is not None and (self.block.dtype != torch.bool or self.block.dim() != 3
                                       or self.block.shape[:2] != (batch, T)):
            raise InputError(f"the plan's block must be bool [B={batch}, T={T}, L], got {self.block.dtype} "
                             f"{list(self.block.shape)}")
        if not self.width <= self.keys <= cache_len:
            raise InputError(f"the plan reads {self.keys} keys with a block of {self.width}; the cache holds "
                             f"{cache_len} slots (call setup_cache first)")
