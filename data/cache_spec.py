"""What a feature cache is made of and the checks around building one: its format (dtypes, file
names, the inputs' fingerprint), its spec (written first, refusing another target or other
inputs), the storage dtype an ``auto`` build settles on, and its size against the disk.

:mod:`data.features` builds a cache with these; :mod:`data.feature_data` reads one back.
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

from draftsmith.data.identity import TargetIdentity

FORMAT_VERSION = 2  # 2: teacher_lse per token
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOKEN_COUNTS = "token_counts.safetensors"
ONLINE_ADVICE_BYTES = 100 * 10**9  # caches above this size get the advice to go online

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


def check_build_settings(num_layers: int, layers: Sequence[int], dtype: str, batch_size: int,
                         shard_size: int, final_from: int | None) -> list[int]:
    """Refuse settings no cache can be built with; returns the layer ids, sorted and distinct.

    Raises:
        ValueError: naming the setting and what it allows.
    """
    if dtype not in DTYPES and dtype != "auto":
        raise ValueError(f"cache dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1 (got {batch_size}, {shard_size})")
    layers = sorted({int(i) for i in layers})
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{num_layers} for this target")
    if final_from is not None and (final_from not in layers or final_from >= num_layers):
        raise ValueError(f"final_from={final_from}: the final hidden state is recomputed from a "
                         f"stored layer below {num_layers}; the cache stores {layers}. Cache the "
                         "final hidden state (data.features=offline) when a draft fuses it")
    return layers


def write_json_replacing(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temporary file beside ``path`` (readers never see half)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def check_or_write_spec(out: Path, spec: dict, target: Any) -> dict | None:
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
    write_json_replacing(spec_path, spec)
    return None


def settle_dtype(out: Path, dtype: str, probe: Callable[[], tuple[str, float]]) -> str:
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
    write_json_replacing(spec_path, spec)
    return chosen


def bytes_per_token(hidden_size: int, elem_bytes: int, layers: Sequence[int],
                    num_layers: int, final: bool = True) -> int:
    """Cache bytes per token: the final hidden state (unless recomputed: ``final`` False), each
    extra layer other than the final one (``num_layers``, served by the final hidden state), the
    float32 teacher log-normaliser, an int32 id and a bool mask."""
    extra = sum(1 for i in set(layers) if i != num_layers)
    return hidden_size * elem_bytes * (int(final) + extra) + 4 + 4 + 1


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
