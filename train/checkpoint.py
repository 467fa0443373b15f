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
