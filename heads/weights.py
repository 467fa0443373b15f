"""A package's stored tensors: one ``model.safetensors``, or shards of a bounded size with the
Hugging Face index (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``,
``weight_map`` from tensor name to file), the layout transformers and the engines read.

Shards keep every file of a release under a size that plain hosting and git take (a release's
weights are committed once); the manifest lists and signs each shard like any other file.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

WEIGHTS = "model.safetensors"  # a head's stored tensors inside a package (one file)
WEIGHTS_INDEX = "model.safetensors.index.json"  # ... or the index of its shards


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def save_weights(state: Mapping[str, Tensor], folder: Path, metadata: dict[str, str],
                 max_shard_bytes: int | None = None) -> list[str]:
    """Write ``state`` into ``folder``: one ``model.safetensors``, or, when it is larger than
    ``max_shard_bytes``, shards of at most that size (tensors in name order, never split; a
    tensor larger than the bound is refused) and their index. Returns the files written."""
    from safetensors.torch import save_file

    names = sorted(state)
    total = sum(_nbytes(state[k]) for k in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(dict(state), str(folder / WEIGHTS), metadata=metadata)
        return [WEIGHTS]
    too_big = [k for k in names if _nbytes(state[k]) > max_shard_bytes]
    if too_big:
        raise ValueError(f"tensors {too_big} are larger than the shard size {max_shard_bytes} "
                         "bytes: raise the shard size or store them in fewer bytes")
    groups: list[list[str]] = [[]]
    size = 0
    for k in names:
        if groups[-1] and size + _nbytes(state[k]) > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += _nbytes(state[k])
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k] for k in group}, str(folder / name), metadata=metadata)
        files.append(name)
        weight_map.update({k: name for k in group})
    index = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return [*files, WEIGHTS_INDEX]


def weight_files(folder: Path) -> list[str]:
    """The files holding a package's tensors (the index and its shards, or the one file)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [*shards, WEIGHTS_INDEX]
    return [WEIGHTS]


def load_weights(folder: Path) -> dict[str, Tensor]:
    """Every stored tensor of a package (its shards through the index, or the one file)."""
    from safetensors.torch import load_file

    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return load_file(str(folder / WEIGHTS))
    weight_map = json.loads(index.read_text())["weight_map"]
    state: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise ValueError(f"{index}: shard {shard!r} is not a file beside the index")
        part = load_file(str(folder / shard))
        state.update(part)
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index} lists tensors its shards do not hold: {missing[:8]}")
    return state
