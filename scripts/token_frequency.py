"""Add ``token_frequency.json`` to a draft package trained before training wrote it.

    python scripts/token_frequency.py draft=outputs/lm_quick/draft [train_cache=DIR]

Rebuilds the package's training split from its ``training_config.yaml`` (the feature cache is
reused when it is still there, else rebuilt, which runs the target over the data again; or
``train_cache=`` names the ``train`` folder of the feature cache the package was trained on), counts
the target ids at loss-masked positions, as training does, and writes the record with its
manifest entry. ``eval/decode.py draft_vocab=N`` and ``eval/measure.py`` read it
(:mod:`heads.vocab`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.eval import CONF_DIR
from draftsmith.heads.package import (
    TRAINING_CONFIG,
    check_target,
    load_package,
    update_package_json,
)
from draftsmith.heads.vocab import TOKEN_FREQUENCY, frequency_record

log = logging.getLogger("draftsmith.token_frequency")


def add_token_frequency(pkg_dir: str | Path, train_cache: str | Path | None = None) -> Path:
    """Count the package's training split and write ``token_frequency.json`` into it.

    Args:
        pkg_dir: the draft package.
        train_cache: the ``train`` folder of a feature cache to count (its target must be the
            package's); None rebuilds or reuses the split named by ``training_config.yaml``.
    """
    from draftsmith.data.feature_data import FeatureDataset
    from draftsmith.data.prepare import prepare_data
    from draftsmith.data.target import load_target
    from draftsmith.data.tiny import target_path_from_config
    from draftsmith.train.distill import TRAIN_SPLIT_SOURCE

    root = Path(pkg_dir)
    pkg = load_package(root)  # verifies the manifest first
    if train_cache is None:
        cfg_path = root / TRAINING_CONFIG
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{root} has no {TRAINING_CONFIG}, so its training data is "
                                    "unknown; retrain it (training writes token_frequency.json "
                                    "itself)")
        cfg = OmegaConf.load(cfg_path)
        target = load_target(target_path_from_config(cfg.target),
                             dtype=getattr(torch, cfg.target.dtype),
                             chat_template=cfg.target.get("chat_template"))
        check_target(pkg.info["target"], target.identity)
        layers = list(OmegaConf.select(cfg, "draft.config.fuse_layers") or [])
        log.info("rebuilding (or reusing) the training split's feature cache")
        train_cache, _, _ = prepare_data(cfg.data, target, layers=layers)
    data = FeatureDataset(train_cache)
    check_target(pkg.info["target"], data.identity, where=f"{root}")
    counts = data.token_counts(int(pkg.info["target"]["vocab_size"]))
    return update_package_json(root, TOKEN_FREQUENCY, frequency_record(counts, TRAIN_SPLIT_SOURCE))


def run(cfg: DictConfig) -> Path:
    """Add the record to ``cfg.draft`` (options: ``conf/eval/token_frequency.yaml``)."""
    cache = cfg.train_cache
    path = add_token_frequency(str(cfg.draft), None if cache is None else str(cache))
    print(f"wrote {path}")
    return path


@hydra.main(config_path=str(CONF_DIR), config_name="token_frequency", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: Hydra overrides of ``conf/eval/token_frequency.yaml``."""
    run(cfg)


if __name__ == "__main__":
    main()
