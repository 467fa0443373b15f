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
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.data.final_layer import final_from_layer, layer_types  # noqa: F401 (API)
from draftsmith.data.identity import TargetIdentity, TargetMismatchError, sha256_file

FORMAT_VERSION = 2  # 2: teacher_lse per token
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
def _forward(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
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


FP16_HEADROOM = 0.5  # auto takes float16 while the probe's largest magnitude is below this
                     # fraction of its range (65,504): other batches may reach further


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


def _settle_dtype(out: Path, dtype: str, probe: Callable[[], tuple[str, float]]) -> str:
    """The storage dtype of the cache in ``out``: ``dtype`` itself, or for ``auto`` the one the
    spec records (``dtype_chosen``: a resumed build continues in it), else ``probe()``'s, which
    is then recorded in the spec before any shard is written."""
    if dtype != "auto":
        return dtype
    spec_path = out / "spec.json"
    spec = json.loads(spec_path.read_text())
    if spec.get("dtype_chosen") in DTYPES:
        return spec["dtype_chosen"]
    chosen, peak = probe()
    log.info("feature cache dtype auto: %s (largest hidden-state magnitude %.4g in the first "
             "batch; float16 holds up to %.4g)", chosen, peak, torch.finfo(torch.float16).max)
    spec["dtype_chosen"] = chosen
    tmp = spec_path.with_name(f"spec.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(spec, indent=2))
    os.replace(tmp, spec_path)
    return chosen


@torch.no_grad()
def teacher_log_normalizer(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                           chunk: int = 256, softcap: float | None = None) -> torch.Tensor:
    """``(T,)`` float32 ``logsumexp`` of :func:`teacher_logits` (temperature 1) per row of
    ``hidden (T, H)``, in chunks of rows (never all (T, V) logits at once)."""
    w = lm_head_weight
    parts = [torch.logsumexp(teacher_logits(h.to(w.device), w, softcap=softcap), dim=-1).cpu()
             for h in hidden.split(chunk)]
    return torch.cat(parts) if parts else torch.zeros(0)


def _write_shard(model: torch.nn.Module, rows: Sequence[dict], layers: Sequence[int],
                 dtype: torch.dtype, batch_size: int, pad_id: int, path: Path,
                 on_batch: Callable[[int], Any] | None = None, online: bool = False,
                 store_final: bool = True) -> None:
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    feats: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for s in range(0, 0 if online else len(order), batch_size):
        idx = order[s: s + batch_size]
        for i, f in zip(idx, _forward(model, [rows[i] for i in idx], layers, dtype, pad_id,
                                      store_final)):
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
    if dtype not in DTYPES and dtype != "auto":
        raise ValueError(f"cache dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1 (got {batch_size}, {shard_size})")
    n_layers = target.identity.num_layers
    layers = sorted({int(i) for i in layers})
    bad = [i for i in layers if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{n_layers} for this target")
    if final_from is not None and (final_from not in layers or final_from >= n_layers):
        raise ValueError(f"final_from={final_from}: the final hidden state is recomputed from a "
                         f"stored layer below {n_layers}; the cache stores {layers}. Cache the "
                         "final hidden state (data.features=offline) when a draft fuses it")
    rows = [r for r in rows]
    if not rows:
        raise ValueError("no sequences to cache")
    out = Path(out_dir)
    spec = {"format_version": FORMAT_VERSION, "target": target.identity.to_dict(),
            "layers": layers, "dtype": dtype, "shard_size": shard_size,
            "inputs_sha256": inputs_fingerprint(rows), "sequences": len(rows)}
    if online:
        spec["online"] = True
    if final_from is not None:
        spec["final_from"] = final_from
    rank, world, barrier = ranks if ranks is not None else (0, 1, lambda: None)
    local = local and world > 1
    model = target.model.eval()
    pad_id = getattr(model.config, "pad_token_id", None) or 0

    def probe() -> tuple[str, float]:  # the first batch the first shard's writer runs
        first = rows[:shard_size]
        order = sorted(range(len(first)), key=lambda i: len(first[i]["input_ids"]))
        return probe_cache_dtype(model, [first[i] for i in order[:batch_size]], layers, pad_id)

    if local:  # every machine checks its own folder; all must find the cache complete to skip
        manifest = _check_or_write_spec(out, spec, target)
        if all(all_gather(manifest is not None, world)):
            return manifest
    else:
        if rank != 0:
            barrier()  # rank 0 checks or writes the spec (and settles an auto dtype) first
        manifest = _check_or_write_spec(out, spec, target) if rank == 0 else None
        if rank == 0 and manifest is None:
            _settle_dtype(out, dtype, probe)
        if rank == 0 and world > 1:
            barrier()
        if rank != 0:
            manifest = _check_or_write_spec(out, spec, target)
        if manifest is not None:
            return manifest
    dtype = _settle_dtype(out, dtype, probe)  # recorded by now, except in a machine's own folder

    n_shards = (len(rows) + shard_size - 1) // shard_size
    todo = [k for k in range(n_shards) if not (out / shard_name(k)).exists()]
    mine = [k for k in todo if k % world == rank]
    ntok = [len(r["input_ids"]) for r in rows]
    done = sum(sum(ntok[k * shard_size:(k + 1) * shard_size]) for k in range(n_shards)
               if k not in todo)
    hidden = target.identity.hidden_size
    elem = torch.finfo(DTYPES[dtype]).bits // 8
    per_token = 5 if online else bytes_per_token(hidden, elem, layers, n_layers,
                                                 final_from is None)
    if todo and (rank == 0 or local):
        check_space(out, sum(ntok) * per_token, (sum(ntok) - done) * per_token, sum(ntok),
                    per_token)
    bar = tqdm(total=sum(ntok), initial=done, desc=f"feature cache ({n_shards} shards)",
               unit="tok", unit_scale=True, disable=not progress)
    for k in mine:
        try:
            _write_shard(model, rows[k * shard_size:(k + 1) * shard_size], layers,
                         DTYPES[dtype], batch_size, pad_id, out / shard_name(k),
                         on_batch=bar.update, online=online, store_final=final_from is None)
        except FeatureCacheError as e:
            if spec["dtype"] != "auto":
                raise
            raise FeatureCacheError(
                f"{e}. Cache dtype auto chose {dtype} from the first batch, but shard {k} "
                f"overflows it: set data.cache.dtype=bfloat16 (a new cache; {out} can go)") from e
        if on_shard is not None:
            on_shard(k)
    bar.close()
    if world > 1:
        log.info("rank %d of %d wrote shards %s of %s", rank, world, mine, out)
        barrier()  # every rank's shards are written
        if rank != 0 and not local:
            barrier()  # rank 0 writes the manifest
            return json.loads((out / "manifest.json").read_text())

    def record(k: int) -> dict[str, Any]:
        chunk = rows[k * shard_size:(k + 1) * shard_size]
        return {"file": shard_name(k), "sequences": len(chunk),
                "tokens": int(sum(len(r["input_ids"]) for r in chunk)),
                "sha256": sha256_file(out / shard_name(k))}

    if local:  # each rank hashes the shards on its own disk; all ranks learn every record
        owned = [k for k in range(n_shards) if k % world == rank]
        shards = [r for k, r in sorted(kv for part in all_gather(
            [(k, record(k)) for k in owned], world) for kv in part)]
    else:
        shards = [record(k) for k in range(n_shards)]
    manifest = {**{k: spec[k] for k in ("format_version", "target", "layers", "inputs_sha256")},
                "dtype": dtype, **({"dtype_requested": "auto"} if spec["dtype"] == "auto" else {}),
                "hidden_size": hidden, "sequences": len(rows),
                "tokens": int(sum(s["tokens"] for s in shards)), "shards": shards,
                "bytes_per_token": per_token, "online": online,
                "shard_owner": "shard k of rank k % world" if local else None,
                **({"final_from": final_from} if final_from is not None else {}),
                "world": world if local else None}
    _write_token_counts(rows, target.identity.vocab_size, out)
    manifest["token_counts_sha256"] = sha256_file(out / TOKEN_COUNTS)
    tmp = out / f"manifest.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / "manifest.json")
    if world > 1 and not local:
        barrier()
    return manifest


TOKEN_COUNTS = "token_counts.safetensors"


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


def _check_or_write_spec(out: Path, spec: dict, target: Any) -> dict | None:
    """Check the folder's spec against ``spec`` (refusing another target or other inputs) and
    return its manifest when the cache is complete; write the spec into a new folder."""
    spec_path, manifest_path = out / "spec.json", out / "manifest.json"
    if spec_path.exists():
        old = json.loads(spec_path.read_text())
        TargetIdentity.from_dict(old["target"]).check_compatible(
            target.identity, where=f"feature cache {out}")
        diff = sorted(k for k in spec if k != "target" and old.get(k) != spec[k])
        if diff:
            raise FeatureCacheError(
                f"{out} holds a feature cache built with different {diff}; "
                "delete it or choose another directory")
        return json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    out.mkdir(parents=True, exist_ok=True)
    tmp = spec_path.with_name(f"spec.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(spec, indent=2))
    os.replace(tmp, spec_path)
    return None


def all_gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (a torch.distributed collective; one rank: [obj])."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    got: list[Any] = [None] * world
    dist.all_gather_object(got, obj)
    return got


def bytes_per_token(hidden_size: int, elem_bytes: int, layers: Sequence[int],
                    num_layers: int, final: bool = True) -> int:
    """Cache bytes per token: the final hidden state (unless recomputed: ``final`` False), each
    extra layer other than the final one (``num_layers``, served by the final hidden state), the
    float32 teacher log-normaliser, an int32 id and a bool mask."""
    extra = sum(1 for i in set(layers) if i != num_layers)
    return hidden_size * elem_bytes * (int(final) + extra) + 4 + 4 + 1


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


def teacher_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                   temperature: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Teacher logits from cached hidden states: ``lm_head(hidden) / T`` in fp32, soft-capped
    first (``cap * tanh(logits / cap)``) for a target whose forward caps them (Gemma 2's
    ``final_logit_softcapping``; :func:`logit_softcap` reads it from the config).

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
        softcap: the target's final logit soft-cap, or None (most targets).

    Returns:
        ``(..., V)`` fp32 logits; ``softmax`` of them is the teacher distribution of the next token.
    """
    logits = torch.nn.functional.linear(hidden.to(lm_head_weight.dtype), lm_head_weight)
    if softcap:
        logits = torch.tanh(logits.float() / softcap) * softcap
    return scale_logits(logits, temperature)


def logit_softcap(config) -> float | None:
    """A config's final logit soft-cap (``final_logit_softcapping``, Gemma 2), or None."""
    config = getattr(config, "text_config", None) or config
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32 (no copy beyond the cast at temperature 1)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


__all__ = [
    "FeatureCacheError",
    "TargetMismatchError",
    "build_feature_cache",
    "logit_softcap",
    "scale_logits",
    "teacher_logits",
]
