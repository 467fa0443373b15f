"""The three draft families seen through one training interface.

``build_family(cfg, target)`` returns a ``Family``: the trainable module wrapped so that its
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

import hydra
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from heads.blocks import DistillTarget


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
        kwargs = {"packed": True, **self._extra}
        if layers is not None:
            kwargs["layers"] = layers
        return self._targets_fn(self.draft, input_ids, hidden, loss_mask,
                                attention_mask=attention_mask, **kwargs)


@dataclass
class Family:
    """A draft family ready to train. ``module`` is the (possibly accelerate-wrapped) DistillModule."""

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
        from heads.package import save_package

        draft = unwrapped.draft if isinstance(unwrapped, DistillModule) else unwrapped
        extra = dict(extra_json)
        if train_log is not None and Path(train_log).is_file():
            records = [json.loads(line) for line in Path(train_log).read_text().splitlines() if line]
            extra["train_log.json"] = {"records": records}
        return save_package(out_dir, self.kind, draft, self.head_config, self.identity,
                            tokenizer=self.tokenizer, extra_json=extra, train_config=train_config,
                            target_config=self.target_config)


def _head_config(cfg: DictConfig, target_config):
    """Instantiate ``draft.config``; a draft LM without explicit widths takes the target's."""
    if cfg.draft.kind == "lm":
        from heads.draft_lm import DraftLMConfig

        raw = OmegaConf.to_container(cfg.draft.config, resolve=True)
        raw.pop("_target_", None)
        widths = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads")
        if not any(raw.get(w) is not None for w in widths):
            for w in widths:
                raw.pop(w, None)
            return DraftLMConfig.matching(target_config, **raw)
        return DraftLMConfig(**raw)
    return hydra.utils.instantiate(cfg.draft.config)


def _position_weights(cfg: DictConfig, default: list[float]) -> list[float]:
    weights = OmegaConf.select(cfg, "draft.position_weights")
    chosen = list(weights) if weights is not None else default
    return [float(w) for w in chosen[: cfg.draft.num_positions]]


def build_family(cfg: DictConfig, target, train_set=None) -> Family:
    """Build the draft named by ``cfg.draft.kind`` for ``target`` (a ``LoadedTarget``).

    ``train_set`` (a ``FeatureDataset``) supplies token frequencies for a reduced draft vocabulary.
    """
    kind = cfg.draft.kind
    model = target.model
    head_cfg = _head_config(cfg, model.config)
    n = int(cfg.draft.num_positions)
    common = {"identity": target.identity, "target_config": model.config, "head_config": head_cfg}
    pkg = _init_package(cfg, target)
    if pkg is not None:
        head_cfg = common["head_config"] = pkg.head_config
    if kind == "lm":
        from heads import draft_lm

        if pkg is not None:
            draft = pkg.module
        else:
            draft = draft_lm.build_draft_lm(head_cfg, model)
        lora = OmegaConf.select(cfg, "draft.lora")
        if lora:
            draft = draft_lm.apply_lora(draft, **OmegaConf.to_container(lora, resolve=True))
        draft.train()
        return Family(kind, DistillModule(draft, draft_lm.distill_targets), num_positions=1,
                      position_weights=_position_weights(cfg, [1.0]), tokenizer=target.tokenizer,
                      **common)
    if kind == "medusa":
        from heads import medusa

        heads = pkg.module if pkg is not None else medusa.build_medusa(head_cfg, model)
        heads.train()
        n = min(n, head_cfg.num_heads)
        return Family(kind, DistillModule(heads, medusa.distill_targets), num_positions=n,
                      position_weights=_position_weights(cfg, head_cfg.loss_weights()), **common)
    if kind == "eagle":
        from heads import eagle

        if pkg is not None:
            head = pkg.module
        else:
            counts = None
            if head_cfg.draft_vocab_size is not None:
                if train_set is None:
                    raise ValueError("a reduced draft vocabulary needs the training split to "
                                     "count tokens")
                counts = train_set.token_counts(model.config.vocab_size)
            head = eagle.build_eagle(head_cfg, model, token_counts=counts)
        head.train()
        d2t = getattr(head, "d2t", None) if head_cfg.draft_vocab_size is not None else None
        layer_ids = list(getattr(train_set, "layers", None) or []) or None
        extra = {"num_steps": n, "layer_ids": layer_ids}
        return Family(kind, DistillModule(head, eagle.distill_targets, extra),
                      num_positions=n, position_weights=_position_weights(cfg, [0.8 ** i for i in range(n)]),
                      draft_to_target=None if d2t is None else d2t.detach().clone(), **common)
    raise ValueError(f"draft.kind={kind!r} is unknown; allowed: lm, medusa, eagle")


def _init_package(cfg: DictConfig, target):
    """The draft package named by ``draft.init_from`` (training continues from it), or None.

    The package's head config replaces ``draft.config``; it must be of ``draft.kind``, trained for
    this target, and (EAGLE) fuse the layers the feature cache was built with.
    """
    init_from = OmegaConf.select(cfg, "draft.init_from")
    if not init_from:
        return None
    from heads.package import load_package

    pkg = load_package(init_from, target=target)
    kind = cfg.draft.kind
    if pkg.kind != kind:
        raise ValueError(f"draft.init_from={init_from} holds a '{pkg.kind}' draft, but draft.kind is "
                         f"'{kind}': pick the matching draft group (draft={pkg.kind})")
    if kind == "eagle":
        want = list(OmegaConf.select(cfg, "draft.config.fuse_layers") or [])
        have = list(getattr(pkg.head_config, "fuse_layers", None) or [])
        if want != have:
            raise ValueError(f"draft.init_from={init_from} fuses target layers {have or 'none'} but "
                             f"draft.config.fuse_layers is {want or 'null'}: set "
                             f"draft.config.fuse_layers={have or 'null'} so the feature cache holds "
                             "the layers the head reads")
    return pkg
