"""A rerun into the same out_dir: the same config resumes, another config is refused naming each
difference, ``train.resume=false`` starts over with the earlier run moved aside (nothing mixed,
nothing lost). Tiny recipes from test_distill.py."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from test_distill import TINY, _run_inprocess

from draftsmith.heads.package import load_package
from draftsmith.train.checkpoint import (
    RESUME_FREE_KEYS,
    config_differences,
    latest_checkpoint,
    load_trainer_state,
)
from draftsmith.train.config import ConfigError

COMMON = TINY + ["draft=medusa", "train.save_every=3", "train.eval_every=3", "seed=3"]


def _steps(out_dir: Path) -> list[int]:
    rows = [json.loads(x) for x in (out_dir / "train_log.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "hydra" not in p.relative_to(root).parts}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A finished 3-step run (a checkpoint at step 3 and a package); tests copy it."""
    out = tmp_path_factory.mktemp("first") / "run"
    _run_inprocess(COMMON + ["train.max_steps=3", f"out_dir={out}"])
    return out


def _copy(first_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    return out


def test_a_changed_config_is_refused_naming_each_key_and_nothing_is_lost(first_run, tmp_path,
                                                                         monkeypatch):
    import draftsmith.data.target

    out = _copy(first_run, tmp_path)
    before = _files(out)

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the checkpoint's config was checked")

    monkeypatch.setattr(draftsmith.data.target, "load_target", refuse)
    with pytest.raises(ConfigError) as err:
        _run_inprocess(COMMON + ["train.max_steps=3", "optim.lr=0.5", "loss.temperature=2.0",
                                 f"out_dir={out}"])
    msg = str(err.value)
    assert f"out_dir={out} holds a checkpoint (step-000003) trained with another config" in msg
    assert "  - optim.lr: checkpoint 0.0003, this run 0.5" in msg
    assert "  - loss.temperature: checkpoint 1.0, this run 2.0" in msg
    assert "train.resume=false to start over in the same out_dir" in msg
    assert "or a new out_dir=" in msg
    assert _files(out) == before  # the checkpoints, the log and the package untouched
    load_package(out / "draft")


def test_a_shorter_run_is_a_difference_too(first_run, tmp_path):
    out = _copy(first_run, tmp_path)
    with pytest.raises(ConfigError, match=r"train\.max_steps: checkpoint 3, this run 2"):
        _run_inprocess(COMMON + ["train.max_steps=2", f"out_dir={out}"])


def test_the_same_config_resumes_and_counts_on(first_run, tmp_path, caplog):
    out = _copy(first_run, tmp_path)
    assert _steps(out) == [1, 2, 3]
    # a longer run and other logging / validation cadence: still the same run
    with caplog.at_level(logging.INFO, logger="draftsmith.distill"):
        summary = _run_inprocess(COMMON + ["train.max_steps=5", "train.eval_every=5",
                                           "train.log_every=2", f"out_dir={out}"])
    assert f"resumed from {out / 'checkpoints' / 'step-000003'} (step 3," in caplog.text
    assert summary["steps"] == 5 and _steps(out) == [1, 2, 3, 4, 5]
    assert load_trainer_state(latest_checkpoint(out))["step"] == 5
    # the trained-token count carries on from the checkpoint (tokens: this launch's own)
    train = [r for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())
             if "tokens_total" in r]
    before, last = [r for r in train if r["step"] == 3][-1], train[-1]
    assert load_trainer_state(out / "checkpoints" / "step-000003")["tokens_trained"] == \
        before["tokens_total"] > 0
    assert last["step"] == 5 and last["tokens_total"] == before["tokens_total"] + last["tokens"]
    assert not list(out.glob("previous-*"))
    assert load_package(out / "draft").family.name == "medusa"


def test_resume_false_starts_over_and_moves_the_earlier_run_aside(first_run, tmp_path, caplog):
    out = _copy(first_run, tmp_path)
    old = _files(out)
    with caplog.at_level(logging.WARNING):
        summary = _run_inprocess(COMMON + ["train.max_steps=3", "optim.lr=1e-3",
                                           "train.resume=false", f"out_dir={out}"])
    assert "resumed from" not in caplog.text
    (aside,) = out.glob("previous-*")
    assert "moved checkpoints, train_log.jsonl" in caplog.text and str(aside) in caplog.text
    # the earlier run is whole beside the new one; the new one trained from step 1
    assert {k.removeprefix(f"{aside.name}/"): v for k, v in _files(aside.parent).items()
            if k.startswith(aside.name)} == old
    load_package(aside / "draft")
    assert summary["steps"] == 3 and _steps(out) == [1, 2, 3]
    assert load_trainer_state(latest_checkpoint(out))["config"]["optim"]["lr"] == 1e-3
    record = json.loads((out / "draft" / "manifest.json").read_text())["training_config"]
    assert record["optim"]["lr"] == 1e-3


def test_the_ignore_list_only_skips_keys_that_cannot_change_the_weights():
    saved = {"optim": {"lr": 3e-4}, "train": {"max_steps": 3, "eval_every": 3, "resume": True},
             "logging": {"log_with": "none"}, "out_dir": "a", "target": {"dtype": "float32"}}
    same = {"optim": {"lr": 3e-4}, "train": {"max_steps": 9, "eval_every": 1, "resume": True},
            "logging": {"log_with": "wandb"}, "out_dir": "b", "target": {"dtype": "bfloat16"}}
    assert config_differences(saved, same, auto=("target.dtype",)) == []
    assert config_differences(saved, same) == [
        "target.dtype: checkpoint 'float32', this run 'bfloat16'"]
    assert config_differences(saved, {**same, "seed": 1}, auto=("target.dtype",)) == [
        "seed: checkpoint '<absent>', this run 1"]
    assert "optim" not in " ".join(RESUME_FREE_KEYS) and "seed" not in RESUME_FREE_KEYS


def test_a_checkpoint_from_before_the_draftsmith_namespace_resumes():
    """Its ``_target_`` strings lack the ``draftsmith.`` prefix; another class still differs."""
    old = {"loss": {"_target_": "train.losses.DistillLoss", "temperature": 1.0}}
    new = {"loss": {"_target_": "draftsmith.train.losses.DistillLoss", "temperature": 1.0}}
    assert config_differences(old, new) == []
    other = {"loss": {"_target_": "draftsmith.train.losses.OtherLoss", "temperature": 1.0}}
    (diff,) = config_differences(old, other)
    assert diff.startswith("loss._target_: checkpoint 'train.losses.DistillLoss', this run")


def test_a_checkpoint_from_before_regeneration_reuse_resumes_with_it():
    """The released Qwen runs' configs have no data.regenerate.reuse; a run that takes their
    committed replies resumes them. Another regeneration setting still differs."""
    old = {"data": {"regenerate": {"enabled": True, "max_new_tokens": 256}}}
    new = {"data": {"regenerate": {"enabled": True, "max_new_tokens": 256,
                                   "reuse": ["bench/qwen/regen_3k"]}}}
    assert config_differences(old, new) == []
    new["data"]["regenerate"]["max_new_tokens"] = 128
    assert config_differences(old, new) == [
        "data.regenerate.max_new_tokens: checkpoint 256, this run 128"]
