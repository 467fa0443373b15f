"""A preallocated KV cache for the decoding loop: a crop moves a length, a kept tree path is one
gather per layer, and appending writes into place instead of concatenating.

transformers' ``DynamicCache`` concatenates every layer's keys and values on each forward (a copy
of the whole context per layer and step) and its crops rebuild the tensors; its ``StaticCache``
is sized once and applies sliding windows itself. :class:`SlabCache` is a ``DynamicCache`` whose
layers (:class:`SlabLayer`) keep keys and values in one buffer ``(2, B, heads, capacity, d)``
that doubles when full (rarely: a request's capacity is reserved up front, :meth:`reserve`).
Every layer keeps all positions, sliding-window layers included, so that index ``i`` holds
position ``i`` (windows come from the attention masks, as with :func:`target_model.new_cache`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # positions allocated at the first write when nothing was reserved


class SlabLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer; ``keys`` / ``values`` are views of
    its first ``length`` positions (what attention reads)."""

    def __init__(self, capacity: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.capacity = int(capacity)
        self.buf: torch.Tensor | None = None  # (2, B, heads, capacity, d)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, t, d = key_states.shape
        cap = max(self.capacity, MIN_CAPACITY, t)
        self.buf = key_states.new_empty((2, b, h, cap, d))
        self.length = 0
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self.buf[0, :, :, :self.length]
        self.values = self.buf[1, :, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.buf.shape[3]:
            self._grow(end)
        self.buf[0, :, :, self.length:end] = key_states
        self.buf[1, :, :, self.length:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.buf.shape[3])
        new = self.buf.new_empty((*self.buf.shape[:3], cap, self.buf.shape[4]))
        new[:, :, :, :self.length] = self.buf[:, :, :, :self.length]
        self.buf = new

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions (before the first write: the allocation)."""
        self.capacity = max(self.capacity, int(capacity))
        if self.buf is not None and self.buf.shape[3] < capacity:
            self._grow(capacity)

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        if self.buf is not None:
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got "
                             f"{tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._views()

    def keep(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Move positions ``src`` to ``dst`` (one gather, one scatter), then keep ``length``."""
        if dst.numel():
            self.buf.index_copy_(3, dst, self.buf.index_select(3, src))
        self.length = length
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.buf = self.buf[:, indices]
        self._views()


class SlabCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SlabLayer` (layers made on first use, as ``DynamicCache()``
    makes its own), with a path keep of one gather per layer (:meth:`keep`)."""

    def __init__(self, capacity: int = 0) -> None:
        self._capacity = int(capacity)
        super(DynamicCache, self).__init__(layer_class_to_replicate=self._layer)

    def _layer(self) -> SlabLayer:
        return SlabLayer(self._capacity)

    def reserve(self, capacity: int) -> None:
        """Room for ``capacity`` positions in every layer, present and future."""
        self._capacity = max(self._capacity, int(capacity))
        for layer in self.layers:
            layer.reserve(capacity)

    def keep(self, n_prefix: int, indices: Sequence[int]) -> None:
        """Keep the first ``n_prefix`` positions and then positions ``indices`` (ascending,
        each ``>= n_prefix``), in that order: a tree's accepted path after its block."""
        src = [int(i) for i in indices]
        moved = [(d, s) for d, s in enumerate(src, start=n_prefix) if d != s]
        length = n_prefix + len(src)
        if not moved:
            for layer in self.layers:
                layer.crop(length - layer.length)
            return
        device = self.layers[0].buf.device
        dst_idx = torch.tensor([d for d, _ in moved], device=device)
        src_idx = torch.tensor([s for _, s in moved], device=device)
        for layer in self.layers:
            layer.keep(dst_idx, src_idx, length)
