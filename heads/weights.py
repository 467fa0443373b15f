"""A package's stored tensors: one ``model.safetensors``, or shards of a bounded size with the
Hugging Face index (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``,
``weight_map`` from tensor name to file), the layout transformers and the engines read.

Shards keep every file of a release under a size that plain hosting and git take (a release's
weights are committed once); the manifest lists and signs each shard like any other file.

An int8 package (``scripts/quantize.py``: weight-only int8, symmetric per output channel) may
store its quantized Linears as what a decode uses: ``<module>.weight_int8`` (int8) and
``<module>.weight_scale`` (per output channel) instead of ``<module>.weight`` (:func:`int8_state`),
half the bytes of bf16. :func:`load_weights` gives ``weight = weight_int8 * weight_scale`` back
(what the head's float shapes are checked with), and :func:`stored_int8` the int8 values and
scales the package's int8 Linears then use as they are, so a stored int8 package drafts exactly
as its float source's int8 copy did.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

WEIGHTS = "model.safetensors"  # a head's stored tensors inside a package (one file)
WEIGHTS_INDEX = "model.safetensors.index.json"  # ... or the index of its shards
INT8, SCALE = ".weight_int8", ".weight_scale"  # a Linear stored as int8 (see the docstring)


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


def int8_state(state: Mapping[str, Tensor], modules: list[str]) -> dict[str, Tensor]:
    """``state`` with each Linear of ``modules`` stored as its weight-only int8 values and float32
    per-channel scales (``heads.quantize.int8_weights``, computed from the weights as given: pass
    the trained float32 ones); other tensors unchanged."""
    from draftsmith.heads.quantize import int8_weights

    out = dict(state)
    for name in modules:
        q, scale = int8_weights(out.pop(f"{name}.weight"))
        out[f"{name}{INT8}"], out[f"{name}{SCALE}"] = q.contiguous(), scale.contiguous()
    return out


def _split_int8(state: dict[str, Tensor]) -> tuple[dict[str, Tensor],
                                                  dict[str, tuple[Tensor, Tensor]]]:
    """The float state (stored int8 Linears dequantized: ``weight = int8 x scale``) and the
    stored int8 values and scales by module."""
    stored = {}
    for key in [k for k in state if k.endswith(INT8)]:
        name = key[: -len(INT8)]
        q, scale = state.pop(key), state.pop(f"{name}{SCALE}")
        stored[name] = (q, scale)
        state[f"{name}.weight"] = q.float() * scale.float()[:, None]
    return state, stored


def weight_files(folder: Path) -> list[str]:
    """The files holding a package's tensors (the index and its shards, or the one file)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [*shards, WEIGHTS_INDEX]
    return [WEIGHTS]


def load_weights(folder: Path) -> dict[str, Tensor]:
    """Every stored tensor of a package (its shards through the index, or the one file), int8
    Linears as their dequantized float weights."""
    return _split_int8(_load_all(folder))[0]


def stored_int8(folder: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """The int8 values and scales a package stores, by module (empty: none stored as int8)."""
    return _split_int8(_load_all(folder))[1]


def _load_all(folder: Path) -> dict[str, Tensor]:
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
