"""Validation of a composed distillation config, before any work is done.

Every error names the offending key, the value found and what is allowed, so a typo on the command
line fails in a second instead of after the feature cache has been built.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.heads.family import FAMILIES, get_family
from draftsmith.train.losses import LOSS_TERMS  # the terms DistillLoss computes, listed once

MIXED_PRECISION = ("no", "bf16", "fp16", "auto")
TARGET_DTYPES = ("float32", "bfloat16", "float16", "auto")
LOG_WITH = ("tensorboard", "wandb", "none")
log = logging.getLogger("draftsmith.distill")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the allowed values."""


def _get(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, throw_on_missing=False)
    if value is None and OmegaConf.select(cfg, key, default="__absent__") == "__absent__":
        raise ConfigError(f"config key '{key}' is missing; add it to your config or pass "
                          f"{key}=VALUE")
    return value


def _positive(cfg: DictConfig, key: str, kind: type = int, allow_zero: bool = False) -> None:
    value = _get(cfg, key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{key}={value!r} is invalid: it must be {need} "
                          f"{'integer' if kind is int else 'number'}")


def _one_of(cfg: DictConfig, key: str, allowed: tuple[str, ...]) -> None:
    value = _get(cfg, key)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is invalid; allowed values: {', '.join(allowed)}")


def validate_config(cfg: DictConfig) -> None:
    """Check the values that do not need the target loaded. Raises ConfigError."""
    _one_of(cfg, "draft.kind", tuple(FAMILIES))
    _positive(cfg, "draft.num_positions")
    weights = _get(cfg, "draft.position_weights")
    if weights is not None and (len(weights) < cfg.draft.num_positions
                                or any(w < 0 for w in weights)):
        raise ConfigError(
            f"draft.position_weights={list(weights)} must hold {cfg.draft.num_positions} "
            "non-negative weights (one per draft position), or be null")
    _positive(cfg, "draft.feature_weight", float, allow_zero=True)
    for key in ("train.max_steps", "train.micro_batch_size", "train.grad_accum",
                "train.eval_every", "train.save_every", "train.log_every"):
        _positive(cfg, key)
    _positive(cfg, "train.keep_checkpoints")
    _positive(cfg, "train.bucket_batches", allow_zero=True)
    _positive(cfg, "train.max_grad_norm", float, allow_zero=True)
    for key in ("train.dist_timeout_s", "train.cache_wait_s"):
        if OmegaConf.select(cfg, key) is not None:
            _positive(cfg, key, float)
    _one_of(cfg, "train.mixed_precision", MIXED_PRECISION)
    _one_of(cfg, "target.dtype", TARGET_DTYPES)
    if OmegaConf.select(cfg, "train.cpu_threads") is not None:
        _positive(cfg, "train.cpu_threads")
    _positive(cfg, "optim.lr", float)
    _positive(cfg, "optim.warmup_steps", allow_zero=True)
    _one_of(cfg, "logging.log_with", LOG_WITH)
    loss_weights = _get(cfg, "loss.weights") or {}
    unknown = sorted(set(loss_weights) - set(LOSS_TERMS))
    if unknown:
        raise ConfigError(f"loss.weights has unknown terms {unknown}; "
                          f"allowed: {', '.join(LOSS_TERMS)}")
    if any(w < 0 for w in loss_weights.values()) or sum(loss_weights.values()) <= 0:
        raise ConfigError(f"loss.weights={dict(loss_weights)} must be non-negative with a "
                          "positive sum")
    _positive(cfg, "loss.temperature", float)
    try:
        get_family(cfg.draft.kind).validate(OmegaConf.to_container(cfg.draft, resolve=True))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def resolve_target_defaults(cfg: DictConfig, target_config: Any) -> None:
    """Replace ``auto`` values of ``draft.config`` that depend on the target (e.g. EAGLE's
    ``fuse_layers``) in place by the values derived from it, so the feature cache, the head and
    the package's recorded config all see the same; the family logs each choice."""
    family = get_family(cfg.draft.kind)
    raw = OmegaConf.to_container(cfg.draft.config, resolve=True)
    resolved = family.resolve_config(raw, target_config)
    for key, value in resolved.items():
        if raw.get(key) != value:
            OmegaConf.update(cfg, f"draft.config.{key}", value, merge=False)


def validate_against_target(cfg: DictConfig, vocab_size: int, hidden_size: int,
                            num_layers: int) -> None:
    """Check the values that depend on the loaded target. Raises ConfigError."""
    try:
        get_family(cfg.draft.kind).validate_against_target(
            OmegaConf.to_container(cfg.draft, resolve=True), vocab_size, hidden_size, num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def resolve_auto_dtypes(cfg: DictConfig) -> None:
    """Replace ``target.dtype=auto`` and ``train.mixed_precision=auto`` in place by the dtype
    measured fastest here (``data.dtype.fastest_dtype``), so the package's config records what
    ran. On CUDA, auto means bf16."""
    from draftsmith.data.dtype import fastest_dtype

    wants = cfg.target.dtype == "auto" or cfg.train.mixed_precision == "auto"
    if not wants:
        return
    fast = "bfloat16" if torch.cuda.is_available() else fastest_dtype("cpu")
    if cfg.target.dtype == "auto":
        cfg.target.dtype = fast
    if cfg.train.mixed_precision == "auto":
        cfg.train.mixed_precision = "bf16" if fast == "bfloat16" else "no"
    log.info("dtype=auto: measured %s fastest here -> target.dtype=%s train.mixed_precision=%s",
             fast, cfg.target.dtype, cfg.train.mixed_precision)
