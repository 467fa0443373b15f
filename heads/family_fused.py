"""The families whose heads draft from the target's fused hidden states and are built on its
config: :class:`EagleFamily` (EAGLE-1/2/3, ``heads/eagle.py``) and :class:`DFlashFamily` (the
DFlash block drafter, ``heads/dflash.py``), and what the two share: the GGUF that llama.cpp's
converter writes, the untrained head on the target's config and the ``draft.config.fuse_layers``
checks."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from draftsmith.heads import dflash, dflash_train, eagle, eagle_config, eagle_ttt
from draftsmith.heads.family_base import DraftFamily, HeadShape, TreeKind, house_export

log = logging.getLogger(__name__)


# a GGUF that llama.cpp's own converter writes and its llama-server runs (scripts/engines.py)
CONVERTED_GGUF = house_export("gguf", "write_gguf_export", "llama_server",
                              weights_file="draft.gguf", module="export_gguf_convert")


def _head_on_target(head_class: type, label: str, head_config: Any, target_config: Any,
                    target_model: nn.Module | None) -> nn.Module:
    """An untrained head built on the target's config, with the target's frozen embedding and LM
    head attached when the target is given (else a warning: they are unset until
    ``attach_target``)."""
    if target_config is None:
        raise ValueError("this package stores no target_config: pass target=... to load it")
    head = head_class(head_config, target_config)
    if target_model is not None:
        head.attach_target(target_model)
    else:
        log.warning("%s package loaded without its target: embedding and target LM head are "
                    "unset; call module.attach_target(target_model) before decoding", label)
    return head


def _fuse_layer_ids_fit(cfg: Mapping[str, Any], num_layers: int) -> None:
    fuse = cfg.get("fuse_layers")
    bad = [] if fuse == "auto" else [i for i in (fuse or []) if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"draft.config.fuse_layers has ids {bad} outside the target's "
                         f"0..{num_layers}")


def _same_fuse_layers(package_config: Any, draft_cfg: Mapping[str, Any], where: str) -> None:
    want = list((draft_cfg.get("config") or {}).get("fuse_layers") or [])
    have = list(package_config.fuse_layers or [])
    if want != have:
        raise ValueError(f"draft.init_from={where} fuses target layers {have or 'none'} but "
                         f"draft.config.fuse_layers is {want or 'null'}: set "
                         f"draft.config.fuse_layers={have or 'null'} so the feature cache "
                         "holds the layers the head reads")


class EagleFamily(DraftFamily):
    """An EAGLE feature-level head, EAGLE-1/2 and EAGLE-3 (``heads/eagle.py``)."""

    name = "eagle"
    config_class = eagle_config.EagleConfig
    proposer = "draftsmith.eval.decoding.proposers_eagle.EagleProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchEagle"
    tree_by_default = True
    batched_tree = True
    draft_vocab = True
    exports = (house_export("eagle", "_write_eagle", method="eagle"),
               house_export("eagle3", "_write_eagle3", method="eagle3"),
               house_export("speculators", "_write_speculators"),  # served as the model itself
               CONVERTED_GGUF)
    gguf_layout = "eagle3"  # EAGLE-3 heads only (an EAGLE-1 head is refused with the reasons)
    distill_targets = staticmethod(eagle_ttt.distill_targets)

    def build(self, head_config, target_model, token_counts=None):
        if self.needs_token_counts(head_config) and token_counts is None:
            raise ValueError("a reduced draft vocabulary needs the training split to count tokens")
        return eagle.build_eagle(head_config, target_model, token_counts=token_counts)

    def needs_token_counts(self, head_config):
        return head_config.draft_vocab_size is not None

    def resolve_config(self, raw, target_config):
        """``fuse_layers: auto`` becomes EAGLE-3's low / middle / high layers of the target;
        ``draft_vocab_size: auto`` the target's vocabulary up to 32,768 ids, else 32,768 of its
        most frequent (``heads.eagle_config.auto_draft_vocab_size``)."""
        raw = eagle_config.resolve_fuse_layers(raw, target_config)
        if raw.get("draft_vocab_size") == "auto":
            from draftsmith.heads.draft_config import text_config

            vocab = int(text_config(target_config).vocab_size)
            raw["draft_vocab_size"] = eagle_config.auto_draft_vocab_size(vocab)
            log.info("draft.config.draft_vocab_size=auto -> %s (a vocabulary of %d ids)",
                     raw["draft_vocab_size"] or "null: the target's own", vocab)
        return raw

    def distill_extra(self, n, layer_ids):
        return {"num_steps": n, "layer_ids": layer_ids}

    def memory_shape(self, head_config):
        return HeadShape(fused_layers=len(head_config.fuse_layers or []),
                         reducible_vocab=head_config.draft_vocab_size is None)

    def draft_to_target(self, module, head_config):
        if head_config.draft_vocab_size is None:
            return None
        return module.d2t.detach().clone()

    def validate(self, draft_cfg):
        vocab = (draft_cfg.get("config") or {}).get("draft_vocab_size")
        if vocab not in (None, "auto") and (not isinstance(vocab, int) or vocab <= 0):
            raise ValueError(f"draft.config.draft_vocab_size={vocab!r} must be null, auto or a "
                             "positive integer")

    def validate_against_target(self, draft_cfg, vocab_size, hidden_size, num_layers):
        cfg = draft_cfg.get("config") or {}
        vocab = cfg.get("draft_vocab_size")
        if isinstance(vocab, int) and vocab > vocab_size:
            raise ValueError(f"draft.config.draft_vocab_size={vocab} exceeds the target's "
                             f"vocabulary ({vocab_size}); use a value <= {vocab_size} or null")
        _fuse_layer_ids_fit(cfg, num_layers)

    def check_init_from(self, package_config, draft_cfg, where):
        _same_fuse_layers(package_config, draft_cfg, where)

    def frozen_prefixes(self, head_config):
        """``embed_tokens.*`` always, ``lm_head.*`` when the head uses the target's LM head
        (``draft_vocab_size`` is None)."""
        return ("embed_tokens.",) + (("lm_head.",) if head_config.draft_vocab_size is None
                                     else ())

    def target_config_of(self, module):
        return module.config  # the target's config cut to the head's one decoder layer

    def empty_head(self, head_config, identity, target_config, target_model):
        return _head_on_target(eagle.EagleHead, "EAGLE", head_config, target_config,
                               target_model)


class DFlashFamily(DraftFamily):
    """A DFlash block drafter (``heads/dflash.py``): one forward drafts a chain of B-1 tokens."""

    name = "dflash"
    config_class = dflash.DFlashConfig
    proposer = "draftsmith.eval.decoding.proposers_dflash.DFlashProposer"
    tree = TreeKind.NONE
    exports = (house_export("dflash", "write_dflash", module="export_dflash"), CONVERTED_GGUF)
    gguf_layout = "zlab_dflash"
    distill_targets = staticmethod(dflash_train.distill_targets)

    def resolve_config(self, raw, target_config):
        """``fuse_layers: auto`` as EAGLE-3's; ``mask_token_id: auto`` (or null) becomes the
        target's pad id, else its EOS id (``heads.dflash.default_mask_token_id``)."""
        raw = eagle_config.resolve_fuse_layers({"fuse_layers": "auto", **raw}, target_config)
        if raw.get("mask_token_id", "auto") in (None, "auto"):
            raw["mask_token_id"] = dflash.default_mask_token_id(target_config)
            log.info("draft.config.mask_token_id=auto -> %d (the target's pad id, else EOS id)",
                     raw["mask_token_id"])
        return raw

    def build(self, head_config, target_model, token_counts=None):
        return dflash.build_dflash(head_config, target_model)

    def num_positions(self, head_config, requested):
        return min(requested, int(head_config.block_size) - 1)

    def default_position_weights(self, head_config, n):
        return head_config.position_weights(n)

    def distill_extra(self, n, layer_ids):
        return {"num_steps": n, "layer_ids": layer_ids}

    def memory_shape(self, head_config):
        return HeadShape(fused_layers=len(head_config.fuse_layers or []))

    def validate(self, draft_cfg):
        cfg = dflash.DFlashConfig.from_dict(dict(draft_cfg.get("config") or {}))
        n = draft_cfg.get("num_positions")
        if n is not None and n != cfg.block_size - 1:
            raise ValueError(f"draft.num_positions={n} must be draft.config.block_size - 1 = "
                             f"{cfg.block_size - 1}: every mask slot of a block is trained and "
                             f"validated; set draft.num_positions={cfg.block_size - 1}")

    def validate_against_target(self, draft_cfg, vocab_size, hidden_size, num_layers):
        cfg = draft_cfg.get("config") or {}
        _fuse_layer_ids_fit(cfg, num_layers)
        mask = cfg.get("mask_token_id")
        if isinstance(mask, int) and not 0 <= mask < vocab_size:
            raise ValueError(f"draft.config.mask_token_id={mask} is outside the target's "
                             f"vocabulary (0..{vocab_size - 1})")

    def check_init_from(self, package_config, draft_cfg, where):
        _same_fuse_layers(package_config, draft_cfg, where)
        n = draft_cfg.get("num_positions")
        if n is not None and n != package_config.block_size - 1:
            raise ValueError(f"draft.init_from={where} drafts blocks of {package_config.block_size}"
                             f" tokens: set draft.num_positions={package_config.block_size - 1}")

    def frozen_prefixes(self, head_config):
        return ("embed_tokens.", "lm_head.")

    def target_config_of(self, module):
        return module.config  # the derived layer config (the target's widths, heads, RoPE)

    def draft_config_of(self, module):
        return {**super().draft_config_of(module), "architectures": [type(module).__name__]}

    def empty_head(self, head_config, identity, target_config, target_model):
        return _head_on_target(dflash.DFlashDrafter, "DFlash", head_config, target_config,
                               target_model)

    def max_draft_length(self, head_config):
        return int(head_config.block_size) - 1

    def engine_draft_length(self, head_config):
        return int(head_config.block_size) - 1  # vLLM's block: the bonus token + K mask slots
