"""Atomic training checkpoints on top of ``accelerator.save_state``.

A checkpoint folder ``<out_dir>/checkpoints/step-000100`` holds what ``accelerate`` saves for every
launcher (model, optimizer, per-process RNG states; DeepSpeed and FSDP shards included), plus
``trainer_state.json`` (step, data position, scheduler state, resolved config). It is written to
``step-000100.tmp`` first and renamed only when complete, so a run killed mid-write leaves the
previous checkpoint untouched and the half-written folder is recognised and removed on resume.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "trainer_state.json"


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written ``*.tmp`` folders are ignored)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1] if ckpts else None


def remove_partial(out_dir: str | Path) -> list[Path]:
    """Delete folders left by a run killed while writing a checkpoint; returns what was removed."""
    root = checkpoint_root(out_dir)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.endswith(".tmp") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def save_checkpoint(accelerator, out_dir: str | Path, step: int, trainer_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write a complete checkpoint atomically and prune old ones.

    Args:
        accelerator: the run's ``Accelerator`` (every process must call this).
        out_dir: the run's output folder.
        step: optimizer steps done.
        trainer_state: JSON-serialisable state (data position, scheduler, config).
        keep: how many complete checkpoints to keep (newest).
    """
    root = checkpoint_root(out_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state_path = tmp / STATE_FILE
        with open(state_path, "w") as f:
            json.dump({"step": step, **trainer_state}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    with open(ckpt / STATE_FILE) as f:
        return json.load(f)


def branch_from(src: str | Path, out_dir: str | Path) -> Path:
    """Start the run in ``out_dir`` from another run's checkpoint ``src`` (``train.resume_from``):
    the checkpoint is linked into ``out_dir/checkpoints/`` (hard links; a copy across file
    systems) with the source run's ``validation_init.json`` and its ``train_log.jsonl`` rows up
    to the checkpoint's step, so the run resumes from it as from its own and its log and curves
    begin with the source's. The source run is only read. Returns the linked checkpoint."""
    src, out_dir = Path(src), Path(out_dir)
    step, source_run = load_trainer_state(src)["step"], src.parent.parent
    dst = checkpoint_root(out_dir) / src.name
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, tmp, copy_function=os.link)
    except OSError:  # another file system
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
    if (init := source_run / "validation_init.json").is_file():
        shutil.copy2(init, out_dir / init.name)
    if (rows := source_run / "train_log.jsonl").is_file():
        kept = [r for r in rows.read_text().splitlines()
                if r.strip() and json.loads(r).get("step", 0) <= step]
        (out_dir / rows.name).write_text("".join(r + "\n" for r in kept))
    os.replace(tmp, dst)  # last: a branch killed before this starts again from the source
    log.info("branched from %s: linked as %s, with the source's log up to step %d", src, dst, step)
    return dst


# ----------------------------------------------------------------------------- provenance
# Resolved-config keys (and key prefixes) a resumed run may change: none of them changes the
# weights a checkpoint holds or how training goes on from it. Where the run writes and what it
# is called; logging and trackers; how often it logs, validates and saves and how many
# checkpoints it keeps (eval_batches only sizes validation); whether it resumes; FLOP counting;
# CPU threads; how the teacher is computed (teacher_logits_budget chunks the same math,
# teacher_per_token computes each distinct row once, equal to the per-position path); where the
# feature cache lives (its key is the data settings, which are compared) and which earlier
# regenerations it takes replies from (the same replies, checked); the target's label
# (not part of its identity). Everything else, e.g. optim.lr, seed, draft.*, loss.*, data.*
# and the launcher, must be equal.
RESUME_FREE_KEYS = ("name", "out_dir", "train.memory_check", "logging", "train.log_every",
                    "train.eval_every",
                    "train.eval_batches", "train.save_every", "train.keep_checkpoints",
                    "train.resume", "train.resume_from", "train.count_flops", "train.cpu_threads",
                    "train.dist_timeout_s", "train.cache_wait_s",
                    "train.teacher_logits_budget", "train.teacher_per_token", "train.teacher_lse",
                    "data.cache.dir", "data.regenerate.reuse",
                    "target.name")
# May grow (a longer run continues the same one); a smaller value is a difference.
GROWING_KEYS = ("train.max_steps",)
# ``auto`` in this run matches whatever the checkpoint's run measured (and recorded) for it.
AUTO_KEYS = ("target.dtype", "train.mixed_precision", "draft.config.fuse_layers",
             "draft.config.lm_head", "draft.config.draft_vocab_size", "draft.config.mask_token_id",
             "data.cache.dtype")
# What a run writes into out_dir besides Hydra's own folder: moved aside when a run starts over.
RUN_FILES = ("checkpoints", "train_log.jsonl", "validation_init.json", "validation.json",
             "summary.json", "draft")
_ABSENT = "<absent>"


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else
                   {f"{prefix}{k}": v})
    return out


def _free(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_FREE_KEYS)


def _renamed(key: str, a: Any, b: Any) -> bool:
    """A ``_target_`` recorded before the ``draftsmith.`` namespace (``train.losses.X``) names
    the same object as ``draftsmith.train.losses.X``."""
    return key.endswith("_target_") and isinstance(a, str) and b == f"draftsmith.{a}"


def config_differences(saved: dict, current: dict, auto: tuple[str, ...] = ()) -> list[str]:
    """``key: checkpoint A, this run B`` for every resolved-config key that differs and would
    change the weights (``RESUME_FREE_KEYS`` are skipped, ``GROWING_KEYS`` may grow, the
    ``auto`` keys match any recorded value); empty = the checkpoint may be resumed."""
    old, new = _flat(saved), _flat(current)
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a == b or _free(key) or key in auto or _renamed(key, a, b):
            continue
        if (key in GROWING_KEYS and isinstance(a, (int, float))
                and isinstance(b, (int, float)) and b >= a):
            continue
        diffs.append(f"{key}: checkpoint {a!r}, this run {b!r}")
    return diffs


def check_resumable(ckpt: Path, current: dict, auto: tuple[str, ...] = ()) -> dict[str, Any]:
    """The trainer state of ``ckpt`` if this run's resolved config ``current`` may resume it.

    Raises:
        ConfigError: the checkpoint's recorded config differs (each key with both values) or
            none is recorded, with the fixes.
    """
    from draftsmith.train.config import ConfigError

    state = load_trainer_state(ckpt)
    saved = state.get("config")
    out_dir = ckpt.parent.parent
    fix = ("Fix: pass train.resume=false to start over in the same out_dir (the earlier run's "
           "files are moved aside, not deleted), or a new out_dir=..., or rerun with the "
           "checkpoint's values to continue it")
    if not isinstance(saved, dict):
        raise ConfigError(f"{ckpt} records no training config, so resuming it could mix weights "
                          f"trained with other settings into this run's package. {fix}")
    diffs = config_differences(saved, current, auto)
    if diffs:
        raise ConfigError(f"out_dir={out_dir} holds a checkpoint ({ckpt.name}) trained with "
                          "another config; resuming it would write a package whose config "
                          "does not describe its weights:\n  - " + "\n  - ".join(diffs)
                          + f"\n{fix}")
    return state


def move_previous_run(out_dir: str | Path) -> Path | None:
    """Move the files of an earlier run in ``out_dir`` (``RUN_FILES``) into
    ``<out_dir>/previous-<time>/`` so that a run starting over mixes nothing into them and
    loses nothing; returns that folder (None: nothing to move)."""
    out_dir = Path(out_dir)
    found = [out_dir / n for n in RUN_FILES if (out_dir / n).exists()]
    if not found:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
    aside = out_dir / f"previous-{stamp}"
    while aside.exists():
        n += 1
        aside = out_dir / f"previous-{stamp}-{n}"
    aside.mkdir()
    for p in found:
        os.replace(p, aside / p.name)
    log.warning("out_dir %s held an earlier run and this one starts over: moved %s into %s",
                out_dir, ", ".join(p.name for p in found), aside)
    return aside
