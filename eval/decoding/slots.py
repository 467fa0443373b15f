"""KV caches for a batch whose rows accept different numbers of tokens (eval/decoding/batch.py).

Each row owns a set of *valid slots* of the cache: a fed block appends slots, rejected drafts
are marked invalid in their row only, attention masks let a token see its own row's valid
slots alone, and position ids count them. Nothing is recomputed; once most slots are invalid
the cache is compacted (valid slots moved to the front, order kept: RoPE was applied when the
keys were written). Two layouts share that interface:

* :class:`SlotCache` (``padded``): one cache row per batch row; a block is ``(B, T)`` with
  padding where a row has fewer tokens, and padding is computed like real tokens.
* :class:`PackedSlotCache` (``packed``): every row's slots in ONE cache row, each slot tagged
  with its owner; a block feeds only the real tokens of all rows, side by side, so a row that
  drafts nothing (fallen back) adds one token to the verification, not ``K + 1``. Attention
  then spans every row's slots (masked), which grows with the batch: the layout for small
  batches, as measured by ``scripts/bench_batch.py``.

A block of tree nodes (:meth:`SlotCache.open_tree`, padded layout only) comes with its own
attention mask (each node its ancestors and itself, no causal order) and depths as positions;
:meth:`SlotCache.keep_mask` then keeps each row's accepted path.

Both take and return ``(B, T)`` blocks: :meth:`pack` turns the ids of a block into what the
model is fed and :meth:`unpack` its outputs back into ``(B, T, ...)`` (zeros at padding).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache

LAYOUTS = ("padded", "packed")


class SlotCache:
    """The padded layout: a transformers :class:`~transformers.DynamicCache` with one row per
    batch row, each keeping its own valid slots.

    Args:
        config: the model config (layers and heads of the cache).
        batch: rows.
        device: where the slot masks live (the model's device).
    """

    def __init__(self, config: object, batch: int, device: torch.device) -> None:
        self.cache = DynamicCache()  # every layer keeps all positions (windows: by masks)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    @property
    def width(self) -> int:
        """Slots per row, valid or not."""
        return int(self.valid.shape[1])

    def lengths(self) -> Tensor:
        """``(B,)`` valid slots per row: the tokens each row has in the cache."""
        return self.valid.sum(1)

    def open(self, new_valid: Tensor) -> tuple[Tensor, Tensor]:
        """Append a block of ``T`` slots to every row (real where ``new_valid (B, T)`` is True,
        padding elsewhere) and return what feeding it needs: the attention mask
        ``(B, 1, T, width + T)`` (bool, True = attend: the row's valid slots, its real tokens of
        the block up to the query; a padding query sees only itself) and position ids ``(B, T)``
        (valid slots before the token)."""
        b, t = new_valid.shape
        dev = new_valid.device
        pos = (self.lengths().unsqueeze(1) + new_valid.long().cumsum(1) - 1).clamp_min(0)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        block = (causal & new_valid.unsqueeze(1)) | torch.eye(t, dtype=torch.bool, device=dev)
        past = self.valid.unsqueeze(1).expand(b, t, self.width)
        mask = torch.cat([past, block], dim=-1).unsqueeze(1)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        return mask, pos

    def open_tree(self, new_valid: Tensor, tail: Tensor, offset: Tensor,
                  start: int) -> tuple[Tensor, Tensor]:
        """Append a block of tree nodes (``new_valid (B, T)``, padding where False). A node
        sees its row's valid slots before ``start``, and from ``start`` on (the slots fed since,
        then the block) exactly what ``tail (B, T, width - start + T)`` marks: its fed
        ancestors and itself (a padding node: itself alone). Its position id is the row's valid
        slots before ``start`` plus ``offset (B, T)`` (its depth below them).

        Returns the attention mask ``(B, 1, T, width + T)`` and position ids ``(B, T)``."""
        b, t = new_valid.shape
        head = self.valid[:, :start]
        mask = torch.cat([head.unsqueeze(1).expand(b, t, start), tail], dim=-1).unsqueeze(1)
        pos = head.sum(1, keepdim=True) + offset
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        return mask, pos

    def keep_mask(self, start: int, keep: Tensor) -> None:
        """Of the slots from ``start`` on, row ``b`` keeps those marked in ``keep (B, width -
        start)`` (a tree's accepted path)."""
        self.valid[:, start:] &= keep

    @staticmethod
    def pack(x: Tensor, valid: Tensor) -> Tensor:
        """What the model is fed for the block ``x (B, T)``: the block itself."""
        return x

    @staticmethod
    def unpack(y: Tensor, valid: Tensor) -> Tensor:
        """The model's output ``(B, T, ...)`` for the block: as it is."""
        return y

    def keep(self, start: int, counts: Tensor) -> None:
        """Of the slots from ``start`` on, row ``b`` keeps its first ``counts[b]`` valid ones."""
        tail = self.valid[:, start:]
        self.valid[:, start:] = tail & (tail.long().cumsum(1) <= counts.unsqueeze(1))

    @torch.inference_mode()
    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (the others finished), then compact if worth it."""
        for layer in self.cache.layers:
            if layer.keys is not None:  # layers are filled on their first forward
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self.valid = self.valid[rows]
        self.compact()

    @torch.inference_mode()
    def compact(self, slack: float = 2.0) -> None:
        """Move each row's valid slots to the front (in order) and drop the rest, once the cache
        is more than ``slack`` times as wide as its longest row."""
        n = self.lengths()
        longest = int(n.max()) if n.numel() else 0
        if self.width <= slack * longest + 16:
            return
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :longest]
        for layer in self.cache.layers:
            if layer.keys is None:
                continue
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                 layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, idx.to(layer.keys.device))
            layer.values = layer.values.gather(2, idx.to(layer.values.device))
        self.valid = torch.arange(longest, device=n.device) < n.unsqueeze(1)


class PackedSlotCache:
    """The packed layout: all rows' slots in one cache row, ``owner[s]`` the batch row of slot
    ``s`` (-1: dropped). Same interface as :class:`SlotCache`; the model is fed ``(1, N)``
    blocks of the ``N`` real tokens (row by row, in order)."""

    def __init__(self, config: object, batch: int, device: torch.device) -> None:
        self.cache = DynamicCache()  # every layer keeps all positions (windows: by masks)
        self.batch = batch
        self.owner = torch.zeros(0, dtype=torch.long, device=device)

    @property
    def width(self) -> int:
        """Slots of the one cache row, valid or not, all rows together."""
        return int(self.owner.shape[0])

    def lengths(self) -> Tensor:
        """``(B,)`` valid slots per row."""
        return torch.bincount(self.owner[self.owner >= 0], minlength=self.batch)

    def open(self, new_valid: Tensor) -> tuple[Tensor, Tensor]:
        """Append the real tokens of a ``(B, T)`` block (``new_valid``) as ``N`` slots; returns
        the mask ``(1, 1, N, width + N)`` (a token sees its row's valid slots and its row's
        earlier tokens of the block) and position ids ``(1, N)``."""
        b, t = new_valid.shape
        rows = torch.arange(b, device=new_valid.device).unsqueeze(1).expand(b, t)[new_valid]
        rank = (new_valid.long().cumsum(1) - 1)[new_valid]  # place within its row's block
        pos = self.lengths()[rows] + rank
        past = self.owner.unsqueeze(0) == rows.unsqueeze(1)  # (N, width); -1 matches nothing
        block = (rows.unsqueeze(0) == rows.unsqueeze(1)) & (rank.unsqueeze(0)
                                                            <= rank.unsqueeze(1))
        self.owner = torch.cat([self.owner, rows])
        return torch.cat([past, block], dim=1)[None, None], pos.unsqueeze(0)

    @staticmethod
    def pack(x: Tensor, valid: Tensor) -> Tensor:
        """``x (B, T)`` -> ``(1, N)``: the real tokens, row by row."""
        return x[valid].unsqueeze(0)

    @staticmethod
    def unpack(y: Tensor, valid: Tensor) -> Tensor:
        """``y (1, N, ...)`` -> ``(B, T, ...)``, zeros at padding."""
        out = y.new_zeros(*valid.shape, *y.shape[2:])
        out[valid] = y[0]
        return out

    def keep(self, start: int, counts: Tensor) -> None:
        """Of the slots from ``start`` on, row ``b`` keeps its first ``counts[b]`` valid ones."""
        tail = self.owner[start:]
        mine = tail.unsqueeze(1) == torch.arange(self.batch, device=tail.device)  # (S, B)
        rank = (mine.long().cumsum(0) * mine).sum(1)  # 1-based place in its row; 0 if dropped
        limit = counts.to(tail.device)[tail.clamp_min(0)]
        self.owner[start:] = torch.where((tail >= 0) & (rank <= limit), tail, -1)

    @torch.inference_mode()
    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (renumbered 0..), then compact if worth it."""
        new = torch.full((self.batch + 1,), -1, dtype=torch.long, device=self.owner.device)
        new[rows.to(new.device)] = torch.arange(len(rows), device=new.device)
        self.owner = new[self.owner]  # owner -1 reads new[-1] = -1
        self.batch = len(rows)
        self.compact()

    @torch.inference_mode()
    def compact(self, slack: float = 2.0) -> None:
        """Drop the invalid slots once the row is more than ``slack`` times its valid ones."""
        live = self.owner >= 0
        n = int(live.sum())
        if self.width <= slack * n + 16:
            return
        idx = live.nonzero().squeeze(1)
        for layer in self.cache.layers:
            if layer.keys is not None:
                layer.keys = layer.keys[:, :, idx.to(layer.keys.device)]
                layer.values = layer.values[:, :, idx.to(layer.values.device)]
        self.owner = self.owner[idx]


def pad_rows(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged token rows -> right-padded ``(B, T)`` ids (0 as padding) and their valid mask."""
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    valid = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        valid[i, :len(r)] = True
    return ids.to(device), valid.to(device)


def last_valid(x: Tensor, valid: Tensor) -> Tensor:
    """``x (B, T, ...)`` at each row's last valid position -> ``(B, ...)``."""
    idx = valid.long().sum(1) - 1
    return x[torch.arange(x.shape[0], device=x.device), idx.to(x.device)]


def check_layout(layout: str, name: str = "layout") -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ValueError naming the setting ``name``."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name}={layout}: use one of {', '.join(LAYOUTS)} (packed feeds only "
                         "each row's real tokens; padded pads every row to the longest)")
    return layout


def slot_cache(layout: str, config: object, batch: int,
               device: torch.device) -> SlotCache | PackedSlotCache:
    """The cache of ``layout`` (one of :data:`LAYOUTS`)."""
    return (PackedSlotCache if check_layout(layout) == "packed" else SlotCache)(config, batch,
                                                                                  device)
