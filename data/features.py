"""The target-feature cache: the target's final hidden states per token, stored once.

The LM head is linear and frozen, so the teacher distribution ``softmax(lm_head(h_t) / T)`` is
recomputed exactly from the cached final-norm hidden state ``h_t``; 576 fp16 numbers per token
replace 49,152 logits.

Layout of a cache directory:
    ``shard-00000.safetensors``: ``input_ids (N,) int32``, ``loss_mask (N,) bool``,
    ``offsets (n_seq+1,) int64``, ``hidden (N, H)`` fp16/bf16, ``teacher_lse (N,) float32`` and
    ``layer_{i} (N, H)`` for chosen layer ids (``hidden_states[i]``; 0 = embeddings).
    ``teacher_lse`` is the log-normaliser ``logsumexp(lm_head(hidden))`` of the teacher at
    temperature 1, computed from the stored (rounded) hidden state exactly as training computes the
    teacher's logits: a draft over a reduced vocabulary then needs only its own rows of the LM head
    (``log p = lm_head[d2t](h) - teacher_lse``), not a vocabulary-wide softmax per token and epoch.
    The last layer id (``num_layers``) is the final hidden state itself (transformers returns the
    final-norm output there), so it is not stored twice: ``hidden`` serves it (an EAGLE-3 head
    fusing low, mid and final layers caches three H-wide rows per token, 3,465 bytes for
    SmolLM2-135M).
    With ``final_from = L`` (``data.features=recompute_final``) ``hidden`` is not stored: the
    final hidden state is recomputed per batch from the cached ``layer_L`` by the target's last
    layers and final norm (:func:`final_from_layer`; an EAGLE-3 head fusing layers 2 / 15 / 27
    caches 3,465 instead of 4,617 bytes per token), ``teacher_lse`` still from the true one.
    ``spec.json``: target identity and a fingerprint of the inputs (written first).
    ``manifest.json``: identity, layer ids, dtype, per-shard counts and sha256, bytes_per_token
    (written last: its presence means the cache is complete).

Building is resumable (shards are written atomically; a restarted run skips shards on disk),
idempotent (a complete cache with the same spec is returned as is) and refuses to mix targets.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.data.cache_spec import (
    DTYPES,
    FORMAT_VERSION,
    TOKEN_COUNTS,
    FeatureCacheError,
    bytes_per_token,
    check_build_settings,
    check_or_write_spec,
    check_space,
    inputs_fingerprint,
    settle_dtype,
    shard_name,
    write_json_replacing,
)
from draftsmith.data.identity import sha256_file
from draftsmith.data.malloc import trim_freed_memory
from draftsmith.data.teacher import logit_softcap, teacher_log_normalizer

# auto takes float16 while the probe's largest magnitude is below this fraction of its range
# (65,504): other batches may reach further
FP16_HEADROOM = 0.5

log = logging.getLogger(__name__)


def _padded_forward(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
                    pad_id: int) -> tuple[list[int], Any, list[int]]:
    """The target's body on right-padded rows: ``(lengths, outputs, layers)`` where ``layers``
    are the requested ids below ``num_layers`` (the last one is the final hidden state)."""
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
    return lens, out, layers


@torch.no_grad()
def target_features(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
                    dtype: torch.dtype, pad_id: int,
                    store_final: bool = True) -> list[dict[str, torch.Tensor]]:
    """Run the target on right-padded rows; returns per-row ``hidden (T,H)`` (left out when not
    ``store_final``), ``teacher_lse (T,)`` (from the hidden state as stored) and layers."""
    lens, out, layers = _padded_forward(model, rows, layers, pad_id)
    lm_head = model.get_output_embeddings().weight
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
                    f"'{k}' overflows {dtype}; use cache dtype 'bfloat16' instead "
                    "(data.cache.dtype=bfloat16, or auto to choose from a probe)")
            item[k] = cast.cpu()
        item["teacher_lse"] = teacher_log_normalizer(item["hidden"], lm_head,
                                                     softcap=logit_softcap(model.config)).cpu()
        if not store_final:
            del item["hidden"]
    return res


@torch.no_grad()
def probe_cache_dtype(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
                      pad_id: int = 0) -> tuple[str, float]:
    """The storage dtype that cache dtype ``auto`` picks from one forward over ``rows``.

    Every hidden state the cache would hold is checked (the final one, even when it is
    recomputed, and each of ``layers``): ``"float16"`` when the largest magnitude stays below
    ``FP16_HEADROOM`` of float16's range, else ``"bfloat16"`` (float32's range, fewer digits).

    Returns:
        ``(dtype name, largest magnitude seen)``.
    """
    lens, out, layers = _padded_forward(model, rows, layers, pad_id)
    peak = 0.0
    for t in [out.last_hidden_state] + [out.hidden_states[i] for i in layers]:
        for b, n in enumerate(lens):
            v = t[b, :n].float()
            if not torch.isfinite(v).all():
                return "bfloat16", float("inf")
            peak = max(peak, float(v.abs().max()))
    limit = FP16_HEADROOM * torch.finfo(torch.float16).max
    return ("float16" if peak < limit else "bfloat16"), peak


def _write_shard(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
                 dtype: torch.dtype, batch_size: int, pad_id: int, path: Path,
                 on_batch: Callable[[int], Any] | None = None, online: bool = False,
                 store_final: bool = True) -> None:
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    feats: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for s in range(0, 0 if online else len(order), batch_size):
        idx = order[s: s + batch_size]
        batch = target_features(model, [rows[i] for i in idx], layers, dtype, pad_id,
                                store_final)
        for i, f in zip(idx, batch):
            feats[i] = f
        trim_freed_memory()  # (n, V) log-normaliser temporaries grow with the sorted lengths
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
                        layers: Sequence[int] = (), dtype: str = "auto", batch_size: int = 8,
                        shard_size: int = 256, progress: bool = True,
                        on_shard: Callable[[int], None] | None = None,
                        ranks: tuple[int, int, Callable[[], None]] | None = None,
                        online: bool = False, local: bool = False,
                        final_from: int | None = None) -> dict[str, Any]:
    """Run the target once over tokenized rows and store its hidden states as shards.

    Args:
        target: `LoadedTarget` (``model``, ``identity``; ``tokenizer`` may be None).
        rows: Sequence of ``{"input_ids": list[int] (T,), "loss_mask": list[bool] (T,)}``.
        out_dir: Cache directory (created).
        layers: Extra hidden-state ids to store (0..num_layers; 0 = embeddings).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"auto"``: float16 unless the target's hidden
            states in the first batch come near its range (:func:`probe_cache_dtype`), then
            bfloat16; the choice is recorded in ``spec.json`` (``dtype_chosen``) and is the
            manifest's ``dtype``.
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
        local: with ``ranks``, ``out_dir`` is a folder on each machine's own disk: every rank
            keeps its spec, its own shards and the whole manifest (the ranks' shard records
            gathered over ``torch.distributed``) there, and nothing else; ranks then read only
            their own shards (``FeatureDataset(..., rank=, world=)``).
        final_from: leave the final hidden state out; training recomputes it from this stored
            layer (:func:`final_from_layer`; one of ``layers``, below ``num_layers``).

    Returns:
        The manifest dict (also written to ``manifest.json``). ``token_counts.safetensors``
        beside it holds the counts of the loss-masked token ids of all rows.

    Raises:
        TargetMismatchError: the directory holds a cache of another target or tokenizer.
        FeatureCacheError: the directory holds a cache of other inputs/settings.
    """
    layers = check_build_settings(target.identity.num_layers, layers, dtype, batch_size,
                                  shard_size, final_from)
    rows = list(rows)
    if not rows:
        raise ValueError("no sequences to cache")
    rank, world, barrier = ranks if ranks is not None else (0, 1, lambda: None)
    build = _Build(target, rows, Path(out_dir), layers, batch_size, shard_size, online,
                   final_from, rank, world, barrier, local and world > 1)
    spec = build.spec(dtype)
    manifest = build.existing(spec)
    if manifest is not None:
        return manifest
    # an auto dtype is recorded in the spec by now, except in a machine's own folder
    dtype = settle_dtype(build.out, dtype, build.probe)
    per_token = build.write_shards(dtype, spec["dtype"] == "auto", progress, on_shard)
    if world > 1:
        barrier()  # every rank's shards are written
        if rank != 0 and not build.local:
            barrier()  # rank 0 writes the manifest
            return json.loads((build.out / "manifest.json").read_text())
    manifest = build.write_manifest(spec, dtype, per_token)
    if world > 1 and not build.local:
        barrier()
    return manifest


@dataclass
class _Build:
    """One build of a cache by one rank: the settings each of its steps reads."""

    target: Any
    rows: list[dict]
    out: Path
    layers: list[int]
    batch_size: int
    shard_size: int
    online: bool
    final_from: int | None
    rank: int
    world: int
    barrier: Callable[[], None]
    local: bool  # every rank builds in a folder on its own machine's disk

    def __post_init__(self) -> None:
        self.model = self.target.model.eval()
        self.pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        self.n_shards = (len(self.rows) + self.shard_size - 1) // self.shard_size

    def shard_rows(self, k: int) -> list[dict]:
        return self.rows[k * self.shard_size:(k + 1) * self.shard_size]

    def spec(self, dtype: str) -> dict[str, Any]:
        """What ``spec.json`` records: a cache with another spec in the folder is refused."""
        spec = {"format_version": FORMAT_VERSION, "target": self.target.identity.to_dict(),
                "layers": self.layers, "dtype": dtype, "shard_size": self.shard_size,
                "inputs_sha256": inputs_fingerprint(self.rows), "sequences": len(self.rows)}
        if self.online:
            spec["online"] = True
        if self.final_from is not None:
            spec["final_from"] = self.final_from
        return spec

    def probe(self) -> tuple[str, float]:
        """:func:`probe_cache_dtype` on the first batch the first shard's writer runs."""
        first = self.shard_rows(0)
        order = sorted(range(len(first)), key=lambda i: len(first[i]["input_ids"]))
        return probe_cache_dtype(self.model, [first[i] for i in order[:self.batch_size]],
                                 self.layers, self.pad_id)

    def existing(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """The manifest of a complete cache of this spec already in the folder, on every rank
        (None: build it). A new folder gets the spec, and an ``auto`` dtype is settled, by rank
        0 before the other ranks look; with machine-local folders every rank checks its own,
        and all must find the cache complete to skip."""
        out, target, rank, world = self.out, self.target, self.rank, self.world
        if self.local:
            manifest = check_or_write_spec(out, spec, target)
            return manifest if all(all_gather(manifest is not None, world)) else None
        if rank != 0:
            self.barrier()  # rank 0 checks or writes the spec (and settles an auto dtype) first
            return check_or_write_spec(out, spec, target)
        manifest = check_or_write_spec(out, spec, target)
        if manifest is None:
            settle_dtype(out, spec["dtype"], self.probe)
        if world > 1:
            self.barrier()
        return manifest

    def write_shards(self, dtype: str, auto: bool, progress: bool,
                     on_shard: Callable[[int], None] | None) -> int:
        """Write this rank's missing shards (after checking the disk has room for them);
        returns the cache's bytes per token."""
        out, rank, world = self.out, self.rank, self.world
        todo = [k for k in range(self.n_shards) if not (out / shard_name(k)).exists()]
        mine = [k for k in todo if k % world == rank]
        ntok = [len(r["input_ids"]) for r in self.rows]
        done = sum(sum(len(r["input_ids"]) for r in self.shard_rows(k))
                   for k in range(self.n_shards) if k not in todo)
        n_layers = self.target.identity.num_layers
        elem = torch.finfo(DTYPES[dtype]).bits // 8
        per_token = 5 if self.online else bytes_per_token(
            self.target.identity.hidden_size, elem, self.layers, n_layers,
            self.final_from is None)
        if todo and (rank == 0 or self.local):
            check_space(out, sum(ntok) * per_token, (sum(ntok) - done) * per_token, sum(ntok),
                        per_token)
        bar = tqdm(total=sum(ntok), initial=done, desc=f"feature cache ({self.n_shards} shards)",
                   unit="tok", unit_scale=True, disable=not progress)
        for k in mine:
            try:
                _write_shard(self.model, self.shard_rows(k), self.layers, DTYPES[dtype],
                             self.batch_size, self.pad_id, out / shard_name(k),
                             on_batch=bar.update, online=self.online,
                             store_final=self.final_from is None)
            except FeatureCacheError as e:
                if not auto:
                    raise
                raise FeatureCacheError(
                    f"{e}. Cache dtype auto chose {dtype} from the first batch, but shard {k} "
                    f"overflows it: set data.cache.dtype=bfloat16 (a new cache; {out} can go)"
                ) from e
            if on_shard is not None:
                on_shard(k)
        bar.close()
        if world > 1:
            log.info("rank %d of %d wrote shards %s of %s", rank, world, mine, out)
        return per_token

    def record(self, k: int) -> dict[str, Any]:
        """Shard ``k``'s entry in the manifest."""
        chunk = self.shard_rows(k)
        return {"file": shard_name(k), "sequences": len(chunk),
                "tokens": int(sum(len(r["input_ids"]) for r in chunk)),
                "sha256": sha256_file(self.out / shard_name(k))}

    def write_manifest(self, spec: dict[str, Any], dtype: str, per_token: int) -> dict[str, Any]:
        """The token counts and then the manifest (last: its presence means complete)."""
        out, local, world = self.out, self.local, self.world
        if local:  # each rank hashes the shards on its own disk; all ranks learn every record
            owned = [k for k in range(self.n_shards) if k % world == self.rank]
            shards = [r for k, r in sorted(kv for part in all_gather(
                [(k, self.record(k)) for k in owned], world) for kv in part)]
        else:
            shards = [self.record(k) for k in range(self.n_shards)]
        final_from = self.final_from
        manifest = {**{k: spec[k] for k in ("format_version", "target", "layers",
                                            "inputs_sha256")},
                    "dtype": dtype,
                    **({"dtype_requested": "auto"} if spec["dtype"] == "auto" else {}),
                    "hidden_size": self.target.identity.hidden_size,
                    "sequences": len(self.rows),
                    "tokens": int(sum(s["tokens"] for s in shards)), "shards": shards,
                    "bytes_per_token": per_token, "online": self.online,
                    "shard_owner": "shard k of rank k % world" if local else None,
                    **({"final_from": final_from} if final_from is not None else {}),
                    "world": world if local else None}
        _write_token_counts(self.rows, self.target.identity.vocab_size, out)
        manifest["token_counts_sha256"] = sha256_file(out / TOKEN_COUNTS)
        write_json_replacing(out / "manifest.json", manifest)
        return manifest


def _write_token_counts(rows: Sequence[dict], vocab_size: int, out: Path) -> None:
    """``token_counts.safetensors``: ``counts (V,) int64`` of the loss-masked token ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        ids = torch.as_tensor(r["input_ids"], dtype=torch.long)
        ids = ids[torch.as_tensor(r["loss_mask"], dtype=torch.bool)]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise FeatureCacheError(f"token ids outside 0..{vocab_size - 1}: the rows were made "
                                    "with another tokenizer than the target's")
        counts += torch.bincount(ids, minlength=vocab_size)
    tmp = out / f"{TOKEN_COUNTS}.tmp-{os.getpid()}"
    save_file({"counts": counts}, str(tmp))
    os.replace(tmp, out / TOKEN_COUNTS)


def all_gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (a torch.distributed collective; one rank: [obj])."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    got: list[Any] = [None] * world
    dist.all_gather_object(got, obj)
    return got
