"""A draft of any family, ready to train through one interface.

``build_trainable(cfg, target)`` asks the family (``heads.family``) for the module and returns a
``TrainableDraft``: the trainable module wrapped so that its
``forward`` produces the per-draft-position training pairs (``heads.blocks.DistillTarget``), the
position weights, the reduced-vocabulary map if any, and how to write the draft package. The
recipe then computes every loss and every alpha-hat the same way for all families.

The wrapper exists because distributed engines (DDP, DeepSpeed) must see the whole training
computation as one ``forward`` call of the module they wrap.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from draftsmith.heads.blocks import DistillTarget
from draftsmith.heads.family import get_family
from draftsmith.heads.family_base import DraftFamily


class DistillModule(nn.Module):
    """Wraps a draft so that one ``forward`` call returns its training pairs (packed rows).

    Args:
        draft: the draft module (draft LM, Medusa heads or EAGLE head).
        targets_fn: the family's ``distill_targets`` function.
        extra: keyword arguments passed to ``targets_fn`` on every call.
    """

    def __init__(self, draft: nn.Module, targets_fn: Callable, extra: dict | None = None):
        super().__init__()
        self.draft = draft
        self._targets_fn = targets_fn
        self._extra = extra or {}

    def forward(self, input_ids: Tensor, hidden: Tensor, loss_mask: Tensor,
                attention_mask: Tensor | None = None,
                layers: Tensor | None = None) -> list[DistillTarget]:
        kwargs = dict(self._extra)
        if layers is not None:
            kwargs["layers"] = layers
        return self._targets_fn(self.draft, input_ids, hidden, loss_mask,
                                attention_mask=attention_mask, **kwargs)


@dataclass
class TrainableDraft:
    """A draft ready to train. ``module`` is the (possibly accelerate-wrapped) DistillModule."""

    kind: str
    module: nn.Module
    head_config: Any
    num_positions: int
    position_weights: list[float]
    identity: Any
    tokenizer: Any = None
    target_config: Any = None
    draft_to_target: Tensor | None = None  # (V_draft,) target id of each draft id, reduced vocab

    def forward(self, batch: dict) -> list[DistillTarget]:
        hidden = batch["hidden"].float()
        layers = batch.get("layers")
        out = self.module(batch["input_ids"], hidden, batch["loss_mask"].bool(),
                          attention_mask=batch.get("attention_mask"),
                          layers=None if layers is None else layers.float())
        return list(out)[: self.num_positions]

    def save_package(self, out_dir: Path, unwrapped: nn.Module, extra_json: dict,
                     train_config: dict, train_log: Path | None = None) -> Path:
        from draftsmith.heads.package import save_package

        draft = unwrapped.draft if isinstance(unwrapped, DistillModule) else unwrapped
        extra = dict(extra_json)
        if train_log is not None and Path(train_log).is_file():
            records = [json.loads(line) for line in Path(train_log).read_text().splitlines()
                       if line]
            extra["train_log.json"] = {"records": records}
        return save_package(out_dir, self.kind, draft, self.head_config, self.identity,
                            tokenizer=self.tokenizer, extra_json=extra, train_config=train_config,
                            target_config=self.target_config)


def _position_weights(cfg: DictConfig, default: list[float]) -> list[float]:
    weights = OmegaConf.select(cfg, "draft.position_weights")
    chosen = list(weights) if weights is not None else default
    return [float(w) for w in chosen[: cfg.draft.num_positions]]


def build_trainable(cfg: DictConfig, target, train_set=None) -> TrainableDraft:
    """Build the draft named by ``cfg.draft.kind`` for ``target`` (a ``LoadedTarget``).

    ``train_set`` (a ``FeatureDataset``) supplies token frequencies for a reduced draft
    vocabulary and the target layers its cache holds.
    """
    family = get_family(cfg.draft.kind)
    model = target.model
    draft_cfg = OmegaConf.to_container(cfg.draft, resolve=True)
    head_cfg = family.head_config(draft_cfg["config"], model.config)
    pkg = _init_package(cfg, target, family, draft_cfg)
    if pkg is not None:
        head_cfg, draft = pkg.head_config, pkg.module
    else:
        counts = None
        if family.needs_token_counts(head_cfg):
            if train_set is None:
                raise ValueError("a reduced draft vocabulary needs the training split to count "
                                 "tokens")
            counts = train_set.token_counts(model.config.vocab_size)
        draft = family.build(head_cfg, model, token_counts=counts)
    draft = family.for_training(draft, draft_cfg)
    draft.train()
    n = family.num_positions(head_cfg, int(cfg.draft.num_positions))
    layer_ids = list(getattr(train_set, "layers", None) or []) or None
    module = DistillModule(draft, family.distill_targets, family.distill_extra(n, layer_ids))
    return TrainableDraft(family.name, module, head_cfg, num_positions=n,
                  position_weights=_position_weights(
                      cfg, family.default_position_weights(head_cfg, n)),
                  identity=target.identity, target_config=model.config,
                  tokenizer=target.tokenizer if family.hf_model else None,
                  draft_to_target=family.draft_to_target(draft, head_cfg))


def _init_package(cfg: DictConfig, target, family: DraftFamily, draft_cfg: dict):
    """The draft package named by ``draft.init_from`` (training continues from it), or None.

    The package's head config replaces ``draft.config``; it must be of ``draft.kind``, trained for
    this target, and fit this run's data (``DraftFamily.check_init_from``). A draft LM may also
    start from a model sharing the target's vocabulary (``pkg:<key>`` or a model folder, e.g.
    the target's smaller sibling: :mod:`draftsmith.heads.foreign`).
    """
    init_from = draft_cfg.get("init_from")
    if not init_from:
        return None
    from draftsmith.heads.foreign import is_model_source, model_as_draft
    from draftsmith.heads.package import load_package

    if family.hf_model and is_model_source(init_from):
        return model_as_draft(init_from, target)
    pkg = load_package(init_from, target=target)
    held = pkg.family.name
    if held != family.name:
        raise ValueError(f"draft.init_from={init_from} holds a '{held}' draft, but draft.kind "
                         f"is '{family.name}': pick the matching draft group (draft={held})")
    family.check_init_from(pkg.head_config, draft_cfg, init_from)
    return pkg
