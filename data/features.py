"""The target-feature cache: the target's final hidden states per token, stored once.

The LM head is linear and frozen, so the teacher distribution ``softmax(lm_head(h_t) / T)`` is
recomputed exactly from the cached final-norm hidden state ``h_t``; 576 fp16 numbers per token
replace 49,152 logits.

Layout of a cache directory:
    ``shard-00000.safetensors``: ``input_ids (N,) int32``, ``loss_mask (N,) bool``,
    ``offsets (n_seq+1,) int64``, ``hidden (N, H)`` fp16/bf16 and ``layer_{i} (N, H)`` for chosen
    layer ids (``hidden_states[i]``; 0 = embeddings). The last id (``num_layers``) is the final
    hidden state itself (transformers returns the final-norm output there), so it is not stored
    twice: ``hidden`` serves it (an EAGLE-3 head fusing low, mid and final layers caches three
    H-wide rows per token, 3,461 bytes for SmolLM2-135M).
    ``spec.json``: target identity and a fingerprint of the inputs (written first).
    ``manifest.json``: identity, layer ids, dtype, per-shard counts and sha256, bytes_per_token
    (written last: its presence means the cache is complete).

Building is resumable (shards are written atomically; a restarted run skips shards on disk),
idempotent (a complete cache with the same spec is returned as is) and refuses to mix targets.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from data.target import TargetIdentity, TargetMismatchError, sha256_file

FORMAT_VERSION = 1
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


log = logging.getLogger(__name__)


class FeatureCacheError(ValueError):
    """A feature cache directory is incomplete, corrupt or built from other inputs."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def inputs_fingerprint(rows: Sequence[dict]) -> str:
    """sha256 over the token ids and loss masks of all rows, in order."""
    h = hashlib.sha256()
    for r in rows:
        ids = np.asarray(r["input_ids"], dtype=np.int64)
        mask = np.asarray(r["loss_mask"], dtype=bool)
        h.update(len(ids).to_bytes(8, "little") + ids.tobytes() + mask.tobytes())
    return h.hexdigest()


@torch.no_grad()
def _forward(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
             dtype: torch.dtype, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Run the target on right-padded rows; returns per-row ``hidden (T,H)`` and layers."""
    device = next(model.parameters()).device
    lens = [len(r["input_ids"]) for r in rows]
    ids = torch.full((len(rows), max(lens)), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : lens[b]] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        attn[b, : lens[b]] = 1
    n_layers = model.config.num_hidden_layers
    layers = [i for i in layers if i != n_layers]  # hidden_states[n_layers] is the final hidden
    out = model.model(input_ids=ids.to(device), attention_mask=attn.to(device),
                      output_hidden_states=bool(layers), use_cache=False)
    hidden = out.last_hidden_state  # (B, T, H) final-norm output
    res = []
    for b, n in enumerate(lens):
        item = {"hidden": hidden[b, :n]}
        for i in layers:
            item[f"layer_{i}"] = out.hidden_states[i][b, :n]
        res.append(item)
    for item in res:
        for k, v in item.items():
            cast = v.to(dtype)
            if not torch.isfinite(cast).all():
                raise FeatureCacheError(
                    f"'{k}' overflows {dtype}; use cache dtype 'bfloat16' instead")
            item[k] = cast.cpu()
    return res


def _write_shard(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
                 dtype: torch.dtype, batch_size: int, pad_id: int, path: Path,
                 on_batch: Callable[[int], Any] | None = None, online: bool = False) -> None:
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    feats: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for s in range(0, 0 if online else len(order), batch_size):
        idx = order[s: s + batch_size]
        for i, f in zip(idx, _forward(model, [rows[i] for i in idx], layers, dtype, pad_id)):
            feats[i] = f
        if on_batch is not None:
            on_batch(sum(len(rows[i]["input_ids"]) for i in idx))
    lens = [len(r["input_ids"]) for r in rows]
    tensors = {
        "input_ids": torch.as_tensor(np.concatenate([np.asarray(r["input_ids"]) for r in rows]),
                                     dtype=torch.int32),
        "loss_mask": torch.as_tensor(np.concatenate([np.asarray(r["loss_mask"], dtype=bool)
                                                     for r in rows])),
        "offsets": torch.as_tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64),
    }
    for key in feats[0]:
        tensors[key] = torch.cat([f[key] for f in feats]).contiguous()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"sequences": str(len(rows))})
    os.replace(tmp, path)


def build_feature_cache(target: Any, rows: Sequence[dict], out_dir: str | Path,
                        layers: Sequence[int] = (), dtype: str = "float16", batch_size: int = 8,
                        shard_size: int = 256, progress: bool = True,
                        on_shard: Callable[[int], None] | None = None,
                        ranks: tuple[int, int, Callable[[], None]] | None = None,
                        online: bool = False) -> dict[str, Any]:
    """Run the target once over tokenized rows and store its hidden states as shards.

    Args:
        target: `LoadedTarget` (``model``, ``identity``; ``tokenizer`` may be None).
        rows: Sequence of ``{"input_ids": list[int] (T,), "loss_mask": list[bool] (T,)}``.
        out_dir: Cache directory (created).
        layers: Extra hidden-state ids to store (0..num_layers; 0 = embeddings).
        dtype: ``"float16"`` or ``"bfloat16"``.
        batch_size: Sequences per forward pass.
        shard_size: Sequences per shard.
        progress: Show a tqdm bar over tokens.
        on_shard: Called with the shard index after each shard is written (for tests/logging).
        ranks: ``(rank, world, barrier)`` when ``world`` processes build the cache together
            (all calling this at once): rank ``r`` writes shards ``r, r + world, ...``, rank 0
            the spec and the manifest, ``barrier`` waits for all ranks. The shards are those one
            process would write (same rows, batches and order).
        online: store the tokens only (5 bytes per token); :class:`OnlineFeatures` computes the
            hidden states of each batch with the target during training.

    Returns:
        The manifest dict (also written to ``manifest.json``).

    Raises:
        TargetMismatchError: the directory holds a cache of another target or tokenizer.
        FeatureCacheError: the directory holds a cache of other inputs/settings.
    """
    if dtype not in DTYPES:
        raise ValueError(f"cache dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1 (got {batch_size}, {shard_size})")
    n_layers = target.identity.num_layers
    layers = sorted({int(i) for i in layers})
    bad = [i for i in layers if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{n_layers} for this target")
    rows = [r for r in rows]
    if not rows:
        raise ValueError("no sequences to cache")
    out = Path(out_dir)
    spec = {"format_version": FORMAT_VERSION, "target": target.identity.to_dict(),
            "layers": layers, "dtype": dtype, "shard_size": shard_size,
            "inputs_sha256": inputs_fingerprint(rows), "sequences": len(rows)}
    if online:
        spec["online"] = True
    spec_path, manifest_path = out / "spec.json", out / "manifest.json"
    rank, world, barrier = ranks if ranks is not None else (0, 1, lambda: None)
    if rank != 0:
        barrier()  # rank 0 checks or writes the spec first
    if spec_path.exists():
        old = json.loads(spec_path.read_text())
        TargetIdentity.from_dict(old["target"]).check_compatible(
            target.identity, where=f"feature cache {out}")
        diff = sorted(k for k in spec if k != "target" and old.get(k) != spec[k])
        if diff:
            raise FeatureCacheError(
                f"{out} holds a feature cache built with different {diff}; "
                "delete it or choose another directory")
        if manifest_path.exists():
            if rank == 0 and world > 1:
                barrier()
            return json.loads(manifest_path.read_text())
    else:
        out.mkdir(parents=True, exist_ok=True)
        tmp = spec_path.with_name(f"spec.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(spec, indent=2))
        os.replace(tmp, spec_path)
    if rank == 0 and world > 1:
        barrier()

    model = target.model.eval()
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    n_shards = (len(rows) + shard_size - 1) // shard_size
    todo = [k for k in range(n_shards) if not (out / shard_name(k)).exists()]
    mine = [k for k in todo if k % world == rank]
    ntok = [len(r["input_ids"]) for r in rows]
    done = sum(sum(ntok[k * shard_size:(k + 1) * shard_size]) for k in range(n_shards)
               if k not in todo)
    hidden = target.identity.hidden_size
    elem = torch.finfo(DTYPES[dtype]).bits // 8
    per_token = 5 if online else bytes_per_token(hidden, elem, layers, n_layers)
    if todo and rank == 0:
        check_space(out, sum(ntok) * per_token, (sum(ntok) - done) * per_token, sum(ntok),
                    per_token)
    bar = tqdm(total=sum(ntok), initial=done, desc=f"feature cache ({n_shards} shards)",
               unit="tok", unit_scale=True, disable=not progress)
    for k in mine:
        _write_shard(model, rows[k * shard_size:(k + 1) * shard_size], layers, DTYPES[dtype],
                     batch_size, pad_id, out / shard_name(k), on_batch=bar.update, online=online)
        if on_shard is not None:
            on_shard(k)
    bar.close()
    if world > 1:
        log.info("rank %d of %d wrote shards %s of %s", rank, world, mine, out)
        barrier()  # every rank's shards are written
        if rank != 0:
            barrier()  # rank 0 writes the manifest
            return json.loads(manifest_path.read_text())

    shards = []
    for k in range(n_shards):
        chunk = rows[k * shard_size:(k + 1) * shard_size]
        shards.append({"file": shard_name(k), "sequences": len(chunk),
                       "tokens": int(sum(len(r["input_ids"]) for r in chunk)),
                       "sha256": sha256_file(out / shard_name(k))})
    manifest = {**{k: spec[k] for k in ("format_version", "target", "layers", "dtype",
                                        "inputs_sha256")},
                "hidden_size": hidden, "sequences": len(rows),
                "tokens": int(sum(s["tokens"] for s in shards)), "shards": shards,
                "bytes_per_token": per_token, "online": online}
    tmp = manifest_path.with_name(f"manifest.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, manifest_path)
    if world > 1:
        barrier()
    return manifest


def bytes_per_token(hidden_size: int, elem_bytes: int, layers: Sequence[int],
                    num_layers: int) -> int:
    """Cache bytes per token: the final hidden state, each extra layer other than the final one
    (``num_layers``, served by the final hidden state), an int32 id and a bool mask."""
    extra = sum(1 for i in set(layers) if i != num_layers)
    return hidden_size * elem_bytes * (1 + extra) + 4 + 1


ONLINE_ADVICE_BYTES = 100 * 10**9  # caches above this size get the advice to go online


def check_space(out: Path, total: int, remaining: int, tokens: int, per_token: int) -> None:
    """Log the cache's size before building it (tokens x bytes per token) and refuse to start
    when the disk holding ``out`` has less room than the part still to write."""
    free = shutil.disk_usage(out).free
    log.info("feature cache %s: %s tokens x %d bytes per token = %.2f GB (%.2f GB still to "
             "write; %.2f GB free there)", out, f"{tokens:,}", per_token, total / 1e9,
             remaining / 1e9, free / 1e9)
    if total > ONLINE_ADVICE_BYTES:
        log.warning("a feature cache of %.0f GB: if that is more than the disk should hold, "
                    "data.features=online computes the target's hidden states in each training "
                    "step instead (no cache on disk; slower, see README)", total / 1e9)
    if remaining > free:
        raise FeatureCacheError(
            f"the feature cache {out} needs {remaining / 1e9:.2f} GB more but its disk has "
            f"{free / 1e9:.2f} GB free: free some space, put data.cache.dir on a larger disk, or "
            "cache fewer tokens (data.num_conversations, data.max_length)")


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    """The manifest of a complete cache (FeatureCacheError when missing)."""
    path = Path(cache_dir) / "manifest.json"
    if not path.exists():
        raise FeatureCacheError(f"{cache_dir} is not a complete feature cache (no manifest.json); "
                                "build it with build_feature_cache")
    return json.loads(path.read_text())


def verify_cache(cache_dir: str | Path) -> None:
    """Check every shard's sha256 against the manifest (FeatureCacheError naming the file)."""
    m = read_manifest(cache_dir)
    for s in m["shards"]:
        p = Path(cache_dir) / s["file"]
        if not p.exists() or sha256_file(p) != s["sha256"]:
            raise FeatureCacheError(f"shard {p} is missing or does not match its sha256")


class FeatureDataset(torch.utils.data.Dataset):
    """Sequences of a feature cache, read lazily from the shards.

    Each item: ``input_ids (T,) long``, ``loss_mask (T,) bool``, ``hidden (T, H)`` fp16/bf16 and,
    when the cache has extra layers, ``layers (L, T, H)``.
    """

    def __init__(self, cache_dir: str | Path, target: TargetIdentity | None = None) -> None:
        self.dir = Path(cache_dir)
        self.manifest = read_manifest(self.dir)
        self.identity = TargetIdentity.from_dict(self.manifest["target"])
        if target is not None:
            self.identity.check_compatible(target, where=f"feature cache {self.dir}")
        self.layers: list[int] = self.manifest["layers"]
        counts = [s["sequences"] for s in self.manifest["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._offsets: dict[int, np.ndarray] = {}
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, k: int) -> Any:
        if k not in self._handles:  # opened lazily, so DataLoader workers open their own
            f = safe_open(str(self.dir / self.manifest["shards"][k]["file"]), framework="pt")
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
        item["hidden"] = f.get_slice("hidden")[a:b]
        if self.layers:
            final = self.identity.num_layers
            item["layers"] = torch.stack([item["hidden"] if i == final
                                          else f.get_slice(f"layer_{i}")[a:b]
                                          for i in self.layers])
        return item

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """``(vocab_size,)`` counts of the loss-masked tokens (what a draft learns to predict),
        read shard by shard without the hidden states."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for k in range(len(self.manifest["shards"])):
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
        self.tokens, self.model = tokens, model
        self.layers, self.manifest, self.dir = tokens.layers, tokens.manifest, tokens.dir
        self.dtype = DTYPES[tokens.manifest["dtype"]]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.tokens[idx]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        return self.tokens.token_counts(vocab_size)

    @torch.no_grad()
    def collate(self, batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run the target on the batch, then :func:`collate_features`."""
        final = self.model.config.num_hidden_layers
        pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        rows = [{"input_ids": x["input_ids"].tolist()} for x in batch]
        feats = _forward(self.model, rows, self.layers, self.dtype, pad_id)
        items = []
        for x, f in zip(batch, feats):
            item = {**x, "hidden": f["hidden"]}
            if self.layers:
                item["layers"] = torch.stack([f["hidden"] if i == final else f[f"layer_{i}"]
                                              for i in self.layers])
            items.append(item)
        return collate_features(items)


def open_features(cache_dir: str | Path, model: torch.nn.Module | None = None
                  ) -> FeatureDataset | OnlineFeatures:
    """The dataset of a cache: :class:`FeatureDataset`, or :class:`OnlineFeatures` over the
    target ``model`` for a tokens-only (online) cache."""
    ds = FeatureDataset(cache_dir)
    if not ds.manifest.get("online"):
        return ds
    if model is None:
        raise FeatureCacheError(f"{cache_dir} stores tokens only (data.features=online): its "
                                "hidden states need the target model")
    return OnlineFeatures(ds, model)


def collate_features(batch: Sequence[dict[str, torch.Tensor]], pad_id: int = 0
                     ) -> dict[str, torch.Tensor]:
    """Right-pad a list of `FeatureDataset` items to the longest sequence.

    Returns:
        ``input_ids (B, T)``, ``loss_mask (B, T)`` (False on padding), ``attention_mask (B, T)``,
        ``hidden (B, T, H)`` and, if present, ``layers (B, L, T, H)``.
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
    has_layers = "layers" in batch[0]
    if has_layers:
        L = batch[0]["layers"].shape[0]
        out["layers"] = torch.zeros(B, L, T, H, dtype=batch[0]["layers"].dtype)
    for b, (x, n) in enumerate(zip(batch, lens)):
        out["input_ids"][b, :n] = x["input_ids"]
        out["loss_mask"][b, :n] = x["loss_mask"]
        out["attention_mask"][b, :n] = 1
        out["hidden"][b, :n] = x["hidden"]
        if has_layers:
            out["layers"][b, :, :n] = x["layers"]
    return out


def teacher_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Teacher logits from cached hidden states: ``lm_head(hidden) / T`` in fp32.

    The one place the frozen LM head is applied to cached hidden states: the training recipe,
    losses and metrics (through ``train.losses.teacher_log_probs``) and the cache's own checks
    all call it. It lives in ``data/`` because the cache defines what its rows mean and ``data/``
    must not import ``train/``. The matmul runs in the LM head's dtype, as in the target's own
    forward (a bf16 target's teacher is its bf16 logits; the (V, H) weight is not copied to fp32
    per call).

    Args:
        hidden: ``(..., H)`` cached final hidden states (any float dtype).
        lm_head_weight: ``(V, H)`` the target's frozen LM-head weight.
        temperature: Softmax temperature (> 0).

    Returns:
        ``(..., V)`` fp32 logits; ``softmax`` of them is the teacher distribution of the next token.
    """
    logits = torch.nn.functional.linear(hidden.to(lm_head_weight.dtype), lm_head_weight)
    return scale_logits(logits, temperature)


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32 (no copy beyond the cast at temperature 1)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


__all__ = [
    "FeatureCacheError",
    "FeatureDataset",
    "TargetMismatchError",
    "build_feature_cache",
    "collate_features",
    "read_manifest",
    "scale_logits",
    "teacher_logits",
    "verify_cache",
]
