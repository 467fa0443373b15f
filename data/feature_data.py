"""Reading a feature cache (:mod:`data.features` builds it): the manifest, integrity checks, the
datasets training draws from, and batch collation.

:class:`FeatureDataset` reads sequences lazily from the shards; :class:`OnlineFeatures` reads the
tokens of a tokens-only cache and runs the target on each batch instead (``data.features=online``);
:class:`RecomputedFinal` reads a cache without the final hidden state and recomputes it per batch
from the last cached layer (``data.features=recompute_final``).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.data import features
from draftsmith.data.cache_spec import DTYPES, TOKEN_COUNTS, FeatureCacheError
from draftsmith.data.final_layer import final_from_layer
from draftsmith.data.identity import TargetIdentity, sha256_file


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    """The manifest of a complete cache (FeatureCacheError when missing)."""
    path = Path(cache_dir) / "manifest.json"
    if not path.exists():
        raise FeatureCacheError(f"{cache_dir} is not a complete feature cache (no manifest.json); "
                                "build it with build_feature_cache")
    return json.loads(path.read_text())


def verify_cache(cache_dir: str | Path, rank: int | None = None,
                 world: int | None = None) -> None:
    """Check every shard's sha256 against the manifest (FeatureCacheError naming the file); with
    ``rank`` and ``world``, only that rank's shards (``k % world == rank``: a machine-local
    folder holds no others)."""
    m = read_manifest(cache_dir)
    for k, s in enumerate(m["shards"]):
        p = Path(cache_dir) / s["file"]
        if rank is not None and k % world != rank:
            continue
        if not p.exists() or sha256_file(p) != s["sha256"]:
            raise FeatureCacheError(f"shard {p} is missing or does not match its sha256")
    counts = Path(cache_dir) / TOKEN_COUNTS
    if "token_counts_sha256" in m and sha256_file(counts) != m["token_counts_sha256"]:
        raise FeatureCacheError(f"{counts} does not match its sha256 in the manifest")


class FeatureDataset(torch.utils.data.Dataset):
    """Sequences of a feature cache, read lazily from the shards.

    Each item: ``input_ids (T,) long``, ``loss_mask (T,) bool``, ``hidden (T, H)`` fp16/bf16,
    ``teacher_lse (T,)`` float32 (caches of format 2) and, when the cache has extra layers,
    ``layers (L, T, H)``.
    """

    def __init__(self, cache_dir: str | Path, target: TargetIdentity | None = None,
                 rank: int | None = None, world: int | None = None) -> None:
        self.dir = Path(cache_dir)
        self.manifest = read_manifest(self.dir)
        self.identity = TargetIdentity.from_dict(self.manifest["target"])
        if target is not None:
            self.identity.check_compatible(target, where=f"feature cache {self.dir}")
        self.layers: list[int] = self.manifest["layers"]
        # the shards read: all, or one rank's own (k % world == rank) of a machine-local cache
        n = len(self.manifest["shards"])
        self.shards = list(range(n)) if rank is None else list(range(rank, n, world))
        counts = [self.manifest["shards"][k]["sequences"] for k in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._offsets: dict[int, np.ndarray] = {}
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, k: int) -> Any:
        """The ``k``-th shard this dataset reads (manifest shard ``self.shards[k]``)."""
        if k not in self._handles:  # opened lazily, so DataLoader workers open their own
            f = safe_open(str(self.dir / self.manifest["shards"][self.shards[k]]["file"]),
                          framework="pt")
            self._handles[k] = f
            self._offsets[k] = f.get_tensor("offsets").numpy()
        return self._handles[k]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"index {idx} out of range for {len(self)} sequences")
        k = int(np.searchsorted(self._starts, idx, side="right") - 1)
        f = self._shard(k)
        j = idx - int(self._starts[k])
        a, b = int(self._offsets[k][j]), int(self._offsets[k][j + 1])
        item = {"input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b]}
        if self.manifest.get("online"):
            return item  # tokens only: OnlineFeatures adds the hidden states per batch
        if self.manifest.get("final_from") is None:  # else RecomputedFinal adds it per batch
            item["hidden"] = f.get_slice("hidden")[a:b]
        if self.manifest["format_version"] >= 2:
            item["teacher_lse"] = f.get_slice("teacher_lse")[a:b]
        if self.layers:
            final = self.identity.num_layers
            item["layers"] = torch.stack([item["hidden"] if i == final
                                          else f.get_slice(f"layer_{i}")[a:b]
                                          for i in self.layers])
        return item

    def lengths(self) -> list[int]:
        """Token count of every sequence, in index order (from the shards' offsets)."""
        out: list[int] = []
        for k in range(len(self.shards)):
            self._shard(k)
            out += np.diff(self._offsets[k]).tolist()
        return out

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """``(vocab_size,)`` counts of the loss-masked tokens of the whole split (what a draft
        learns to predict): the cache's ``token_counts.safetensors`` (every rank's shards, also
        on a machine that holds only its own), else read shard by shard."""
        path = self.dir / TOKEN_COUNTS
        if "token_counts_sha256" in self.manifest:
            if sha256_file(path) != self.manifest["token_counts_sha256"]:
                raise FeatureCacheError(f"{path} does not match its sha256 in the manifest; "
                                        "delete the cache folder to rebuild it")
            counts = load_file(str(path))["counts"]
            if counts.numel() != vocab_size:
                raise FeatureCacheError(f"{self.dir}: token counts for a vocabulary of "
                                        f"{counts.numel()}, not {vocab_size}; the cache was built "
                                        "for another vocabulary")
            return counts
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for k in range(len(self.shards)):
            f = self._shard(k)
            ids = f.get_tensor("input_ids").long()[f.get_tensor("loss_mask").bool()]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise FeatureCacheError(f"{self.dir}: token ids outside 0..{vocab_size - 1}; the "
                                        "cache was built for another vocabulary")
            counts += torch.bincount(ids, minlength=vocab_size)
        return counts

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state


class OnlineFeatures(torch.utils.data.Dataset):
    """A tokens-only cache whose hidden states the target computes per batch, in
    :meth:`collate` (``data.features=online``): for caches too large for the disk.

    The features are those :func:`build_feature_cache` would store (the same forward and the same
    cast to the cache dtype), computed for each batch as it is drawn; items and batches look like
    :class:`FeatureDataset`'s.
    """

    def __init__(self, tokens: FeatureDataset, model: torch.nn.Module) -> None:
        if not tokens.manifest.get("online"):
            raise FeatureCacheError(f"{tokens.dir} is an offline feature cache; open it with "
                                    "FeatureDataset (or rebuild with data.features=online)")
        self._over(tokens, model)

    def _over(self, cached: FeatureDataset, model: torch.nn.Module) -> None:
        """Read items from ``cached``; compute what it lacks with ``model``."""
        self.tokens, self.model = cached, model
        self.layers, self.manifest, self.dir = cached.layers, cached.manifest, cached.dir
        self.dtype = DTYPES[cached.manifest["dtype"]]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.tokens[idx]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        return self.tokens.token_counts(vocab_size)

    def lengths(self) -> list[int]:
        return self.tokens.lengths()

    @torch.no_grad()
    def collate(self, batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run the target on the batch, then :func:`collate_features`."""
        final = self.model.config.num_hidden_layers
        pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        rows = [{"input_ids": x["input_ids"].tolist()} for x in batch]
        feats = features.target_features(self.model, rows, self.layers, self.dtype, pad_id)
        items = []
        for x, f in zip(batch, feats):
            item = {**x, "hidden": f["hidden"], "teacher_lse": f["teacher_lse"]}
            if self.layers:
                item["layers"] = torch.stack([f["hidden"] if i == final else f[f"layer_{i}"]
                                              for i in self.layers])
            items.append(item)
        return collate_features(items)


class RecomputedFinal(OnlineFeatures):
    """A cache without the final hidden state (``data.features=recompute_final``): each batch's
    final hidden states come from its cached layer ``final_from`` through the target's last
    layers and final norm (:func:`~data.final_layer.final_from_layer`), cast to the cache dtype as
    a stored one would be; the rest is read from the cache."""

    def __init__(self, cached: FeatureDataset, model: torch.nn.Module) -> None:
        self._over(cached, model)
        self.final_from = int(cached.manifest["final_from"])

    @torch.no_grad()
    def collate(self, batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Recompute the batch's final hidden states, then :func:`collate_features`."""
        row = self.layers.index(self.final_from)
        h = torch.nn.utils.rnn.pad_sequence([x["layers"][row] for x in batch], batch_first=True)
        final = final_from_layer(self.model, h, self.final_from).to(self.dtype).cpu()
        return collate_features([{**x, "hidden": final[b, :len(x["input_ids"])]}
                                 for b, x in enumerate(batch)])


def open_features(cache_dir: str | Path, model: torch.nn.Module | None = None,
                  rank: int | None = None, world: int | None = None
                  ) -> FeatureDataset | OnlineFeatures:
    """The dataset of a cache: :class:`FeatureDataset`, or over the target ``model``
    :class:`OnlineFeatures` for a tokens-only (online) cache and :class:`RecomputedFinal` for
    one without the final hidden state; with ``rank`` and ``world`` only that rank's own
    shards."""
    ds = FeatureDataset(cache_dir, rank=rank, world=world)
    kind = ("online" if ds.manifest.get("online") else
            "recompute_final" if ds.manifest.get("final_from") is not None else None)
    if kind is None:
        return ds
    if model is None:
        raise FeatureCacheError(f"{cache_dir} was built with data.features={kind}: its hidden "
                                "states need the target model")
    return OnlineFeatures(ds, model) if kind == "online" else RecomputedFinal(ds, model)


def collate_features(batch: Sequence[dict[str, torch.Tensor]], pad_id: int = 0
                     ) -> dict[str, torch.Tensor]:
    """Right-pad a list of `FeatureDataset` items to the longest sequence.

    Returns:
        ``input_ids (B, T)``, ``loss_mask (B, T)`` (False on padding), ``attention_mask (B, T)``,
        ``hidden (B, T, H)`` and, if present, ``teacher_lse (B, T)`` and ``layers (B, L, T, H)``.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    lens = [len(x["input_ids"]) for x in batch]
    B, T = len(batch), max(lens)
    H = batch[0]["hidden"].shape[-1]
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "attention_mask": torch.zeros(B, T, dtype=torch.long),
           "hidden": torch.zeros(B, T, H, dtype=batch[0]["hidden"].dtype)}
    has_layers, has_lse = "layers" in batch[0], "teacher_lse" in batch[0]
    if has_lse:
        out["teacher_lse"] = torch.zeros(B, T, dtype=torch.float32)
    if has_layers:
        L = batch[0]["layers"].shape[0]
        out["layers"] = torch.zeros(B, L, T, H, dtype=batch[0]["layers"].dtype)
    for b, (x, n) in enumerate(zip(batch, lens)):
        out["input_ids"][b, :n] = x["input_ids"]
        out["loss_mask"][b, :n] = x["loss_mask"]
        out["attention_mask"][b, :n] = 1
        out["hidden"][b, :n] = x["hidden"]
        if has_lse:
            out["teacher_lse"][b, :n] = x["teacher_lse"]
        if has_layers:
            out["layers"][b, :, :n] = x["layers"]
    return out
