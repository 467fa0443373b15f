"""One call from a data config to train/val feature caches: read -> split -> [regenerate] ->
tokenize -> cache, reusing a cache built earlier from the same target, data and settings."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.data.cache_spec import FORMAT_VERSION, FeatureCacheError, write_json_replacing
from draftsmith.data.chat import split_conversations, tokenize_conversations
from draftsmith.data.features import all_gather, build_feature_cache
from draftsmith.data.regen_reuse import load_reused, provenance, write_provenance
from draftsmith.data.regenerate import regenerate_splits
from draftsmith.data.sharegpt import read_sharegpt, select_conversations

DEFAULTS: dict[str, Any] = {
    "path": None, "skip_conversations": 0, "num_conversations": None, "max_length": 1024,
    "split": {"val": 0.02, "test": 0.02},
    "regenerate": {"enabled": False, "temperature": 0.0, "max_new_tokens": 256,
                   "batch_size": 8, "max_prompt_tokens": 1024, "max_replies": None,
                   "reuse": []},
    "cache": {"dir": None, "dtype": "auto", "layers": [], "batch_size": 8, "shard_size": 256,
              "local": False},
    "features": "offline",
    "select": {"include": None, "exclude": None},
}


def _as_dict(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    return dict(cfg)


def resolve_data_config(cfg_data: Any) -> dict[str, Any]:
    """Data config merged over `DEFAULTS`; unknown keys are an error naming the allowed ones."""
    user = _as_dict(cfg_data)
    out: dict[str, Any] = {}
    for key, default in DEFAULTS.items():
        val = user.get(key, default)
        if isinstance(default, dict):
            val = {**default, **(val or {})}
            extra = set(val) - set(default)
            if extra:
                raise ValueError(f"unknown keys data.{key}.{sorted(extra)}; allowed: "
                                 f"{sorted(default)}")
        out[key] = val
    extra = set(user) - set(DEFAULTS) - {"name"}
    if extra:
        raise ValueError(f"unknown data config keys {sorted(extra)}; allowed: "
                         f"{sorted(DEFAULTS) + ['name']}")
    out["name"] = user.get("name", "sharegpt")
    return out


def _key(key_src: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]


def default_feature_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftsmith" / "features"


def prepare_data(cfg_data: Any, target: Any, out_dir: str | Path | None = None,
                 layers: list[int] | None = None, is_main: bool = True,
                 ranks: tuple[int, int, Callable[[], None]] | None = None
                 ) -> tuple[Path, Path, dict[str, Any]]:
    """Build (or reuse) the train and val feature caches for a data config.

    Args:
        cfg_data: The ``data`` config group (DictConfig or dict; see conf/data/sharegpt.yaml).
        target: `LoadedTarget` (model, tokenizer with chat template, identity).
        out_dir: Root for caches; default ``data.cache.dir`` or
            ``$XDG_CACHE_HOME/draftsmith/features``.
            Caches go to ``<root>/<key>/{train,val}`` where key hashes target, data and settings.
        layers: Extra hidden-state layer ids the draft needs (merged with ``cache.layers``).
        is_main: Only the main process builds; others expect a finished cache.
        ranks: ``(rank, world, barrier)`` to build the cache data-parallel: every rank calls this
            at once and writes every ``world``-th shard (regeneration stays on rank 0, the others
            read its replies after ``barrier``); ``is_main`` is then ignored.

    Returns:
        ``(train_cache_dir, val_cache_dir, report)``.
    """
    c = resolve_data_config(cfg_data)
    all_layers = sorted({int(i) for i in list(c["cache"]["layers"]) + list(layers or [])})
    key_src, final_from = _cache_key(c, target, all_layers)
    base = Path(out_dir or c["cache"]["dir"] or default_feature_root())
    root = base / _key(key_src)
    rank, world, barrier = ranks if ranks is not None else (0 if is_main else 1, 1, lambda: None)
    # data.cache.local: the folder is on each machine's own disk, so every rank decides and
    # writes for itself what one main process does for a shared folder
    local = bool(c["cache"]["local"]) and world > 1

    def complete(folder: Path) -> bool:
        done = (folder / "report.json").exists() and all(
            (folder / d / "manifest.json").exists() for d in ("train", "val"))
        return all(all_gather(done, world)) if local else done

    if c["cache"]["dtype"] == "auto":  # a finished float16 cache of the same data is what auto
        fp16 = base / _key({**key_src, "cache": {**key_src["cache"], "dtype": "float16"}})
        if complete(fp16):  # would build (nothing overflowed): reused
            root = fp16
    train_dir, val_dir, report_path = root / "train", root / "val", root / "report.json"
    if complete(root):
        return train_dir, val_dir, json.loads(report_path.read_text())
    if rank != 0 and ranks is None:
        raise FeatureCacheError(f"feature cache {root} is not complete; the main process builds it")
    if target.tokenizer is None:
        raise ValueError("preparing data needs the target's tokenizer (chat template)")

    parts, report = _read_splits(c)
    report = {"key": root.name, "config": key_src, **report}
    out: dict[str, Path] = {"train": train_dir, "val": val_dir}
    if c["regenerate"]["enabled"]:  # every split in one run: they share batches
        _regenerate(parts, c["regenerate"], target, root, (rank, world, barrier), local)
    for split, cache_dir in out.items():
        ds, tok_rep = tokenize_conversations(parts[split], target.tokenizer, c["max_length"])
        if len(ds) == 0:
            raise ValueError(f"no {split} conversation has assistant tokens after tokenization")
        rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in ds]
        man = build_feature_cache(target, rows, cache_dir, layers=all_layers,
                                  dtype=c["cache"]["dtype"], batch_size=c["cache"]["batch_size"],
                                  shard_size=c["cache"]["shard_size"], progress=rank == 0,
                                  ranks=(rank, world, barrier) if world > 1 else None,
                                  online=c["features"] == "online", local=local,
                                  final_from=final_from)
        report[split] = {"tokenize": tok_rep.to_dict(), "sequences": man["sequences"],
                         "tokens": man["tokens"], "bytes_per_token": man["bytes_per_token"],
                         "layers": man["layers"]}
    if rank == 0 or local:
        write_json_replacing(report_path, report)
    if world > 1:
        barrier()
    return train_dir, val_dir, report


def _regenerate(parts: dict[str, list], regen: dict[str, Any], target: Any, root: Path,
                ranks: tuple[int, int, Callable[[], None]], local: bool) -> None:
    """Replace the train and val conversations of ``parts`` by the target's own replies
    (:func:`regenerate_splits`, files under ``root``): rank 0 generates, the other ranks then
    read its finished files, or with machine-local folders receive its conversations."""
    rank, world, barrier = ranks
    splits = ("train", "val")

    def regenerated(reuse: dict | None = None) -> dict[str, list]:
        return regenerate_splits(
            {split: (parts[split], root / f"regenerated-{split}.jsonl") for split in splits},
            target, temperature=regen["temperature"], max_new_tokens=regen["max_new_tokens"],
            batch_size=regen["batch_size"], max_prompt_tokens=regen["max_prompt_tokens"],
            max_replies=regen["max_replies"], progress=rank == 0, reuse=reuse)

    if rank == 0:  # rank 0 generates; the others then read its finished files
        prov = provenance(target, regen)
        reuse = load_reused(regen["reuse"], prov)  # checked before any work
        write_provenance(root, prov)  # the folder is reusable by later runs as it stands
        parts.update(regenerated(reuse))
    if world > 1:
        barrier()
    if local:  # ... which are on rank 0's disk only: rank 0 sends the conversations
        parts.update(all_gather({s: parts[s] for s in splits} if rank == 0 else None, world)[0])
    elif rank != 0:
        parts.update(regenerated())


def _cache_key(c: dict[str, Any], target: Any, layers: list[int]
               ) -> tuple[dict[str, Any], int | None]:
    """What names the caches of this data config (checked first: a bad setting is refused
    before any work), and the layer the final hidden state is recomputed from (or None)."""
    key_src = {k: c[k] for k in ("path", "num_conversations", "max_length", "split", "regenerate")}
    if c["regenerate"]["reuse"] and not c["regenerate"]["enabled"]:
        raise ValueError("data.regenerate.reuse takes earlier regenerated replies, but "
                         "data.regenerate.enabled is false (the original replies are used): set "
                         "data.regenerate.enabled=true, or leave data.regenerate.reuse empty")
    # earlier replies taken instead of generated are the same replies: not part of the key
    key_src["regenerate"] = {k: v for k, v in c["regenerate"].items() if k != "reuse"}
    skip = c["skip_conversations"]
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"data.skip_conversations={skip!r}: give a whole number >= 0 (how many "
                         "valid conversations to pass over before reading data.num_conversations)")
    if skip:  # caches made before the option keep their keys
        key_src["skip_conversations"] = skip
    if c["select"] != DEFAULTS["select"]:  # (likewise)
        key_src["select"] = c["select"]
        select_conversations([], **c["select"])  # a bad pattern is refused before any work
    final_from = _final_from(c["features"], target.identity.num_layers, layers)
    if c["features"] != "offline":  # offline caches keep their keys
        key_src["features"] = c["features"]
    if key_src["regenerate"].get("max_replies") is None:  # caches made before the option keep
        key_src["regenerate"] = {k: v for k, v in key_src["regenerate"].items()  # their keys
                                 if k != "max_replies"}
    # the target's parameter dtype is part of the key: a bf16 target's hidden states (and greedy
    # regenerated replies) are not the fp32 target's, although its identity is the same
    target_dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    key_src.update(cache={k: c["cache"][k] for k in ("dtype", "shard_size")}, layers=layers,
                   target_dtype=target_dtype, format_version=FORMAT_VERSION,
                   target=target.identity.to_dict())
    if getattr(target, "chat_format", "tokenizer") != "tokenizer":
        # a chat format other than the tokenizer's own (target.chat_template) makes other token
        # ids from the same conversations; the identity hashes the tokenizer's own template only
        key_src["chat_template"] = hashlib.sha256(
            target.tokenizer.chat_template.encode()).hexdigest()
    return key_src, final_from


def _final_from(features: str, n_layers: int, layers: list[int]) -> int | None:
    """The cached layer ``data.features=recompute_final`` recomputes the final hidden state
    from (the highest below ``n_layers``); None for the other settings."""
    if features not in ("offline", "online", "recompute_final"):
        raise ValueError(f"data.features={features!r}: choose offline (hidden states cached "
                         "on disk once), recompute_final (the final one recomputed per batch from "
                         "the last cached layer) or online (computed by the target in every step)")
    if features != "recompute_final":
        return None
    below = [i for i in layers if i < n_layers]
    if n_layers in layers or not below:
        raise ValueError(f"data.features=recompute_final recomputes the final hidden state "
                         f"from a cached layer below {n_layers}, but the layers are "
                         f"{layers}: use it with a draft fusing layers below the last "
                         "(EAGLE-3's engine layout), else data.features=offline")
    return max(below)


def _read_splits(c: dict[str, Any]) -> tuple[dict[str, list], dict[str, Any]]:
    """The conversations of each split (read, selected, skipped, limited, split by id) and
    what the report says of them."""
    n, skip, select = c["num_conversations"], c["skip_conversations"], c["select"]
    selecting = select != DEFAULTS["select"]  # a selection reads the whole file, then counts
    convs, read_rep = read_sharegpt(c["path"], limit=None if n is None or selecting else skip + n)
    report: dict[str, Any] = {"read": read_rep.to_dict()}
    if selecting:
        convs = select_conversations(convs, **select)
        report["selected"] = len(convs)
    convs = convs[skip:] if n is None else convs[skip:skip + n]
    parts = split_conversations(convs, c["split"]["val"], c["split"]["test"])
    report["split"] = {k: len(v) for k, v in parts.items()}
    for split in ("train", "val"):
        if not parts[split]:
            raise ValueError(f"the {split} split is empty; use more data (data.num_conversations) "
                             f"or a larger data.split.{split}")
    return parts, report
