"""The Medusa family (:class:`MedusaFamily`): Medusa-1 heads on the target's final hidden state,
drafting static trees (``heads/medusa.py``)."""
from __future__ import annotations

import logging

from draftsmith.heads import medusa
from draftsmith.heads.family_base import DraftFamily, HeadShape, TreeKind, house_export

log = logging.getLogger(__name__)


class MedusaFamily(DraftFamily):
    """Medusa-1 heads on the target's final hidden state (``heads/medusa.py``)."""

    name = "medusa"
    config_class = medusa.MedusaConfig
    proposer = "draftsmith.eval.decoding.proposers_medusa.MedusaProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchMedusa"
    tree = TreeKind.STATIC
    tree_by_default = True
    exports = (house_export("medusa", "_write_medusa", method="medusa",
                            weights_file=medusa.MEDUSA_WEIGHTS),)
    distill_targets = staticmethod(medusa.distill_targets)

    def resolve_config(self, raw, target_config):
        """``lm_head: auto`` becomes ``own`` or ``shared`` by the size of the target's LM head
        (``heads.medusa.auto_lm_head``, which logs the choice)."""
        raw = dict(raw)
        if raw.get("lm_head") == "auto":
            from draftsmith.heads.draft_config import text_config

            if target_config is None:
                raise ValueError("draft.config.lm_head=auto is decided by the target's LM-head "
                                 "size: pass the target's config, or set lm_head=own or shared")
            tc = text_config(target_config)
            num_heads = int(raw.get("num_heads", medusa.MedusaConfig.num_heads))
            raw["lm_head"] = medusa.auto_lm_head(num_heads, int(tc.vocab_size),
                                                 int(tc.hidden_size))
        return raw

    def build(self, head_config, target_model, token_counts=None):
        return medusa.build_medusa(head_config, target_model)

    def num_positions(self, head_config, requested):
        return min(requested, head_config.num_heads)

    def default_position_weights(self, head_config, n):
        return head_config.loss_weights()

    def validate(self, draft_cfg):
        mode = (draft_cfg.get("config") or {}).get("lm_head", "own")
        if mode not in medusa.LM_HEAD_MODES:
            raise ValueError(f"draft.config.lm_head={mode!r} is invalid; allowed values: "
                             f"{', '.join(medusa.LM_HEAD_MODES)}")

    def frozen_prefixes(self, head_config):
        """A shared LM head (``lm_head.*``, the target's own weight); own LM heads
        (``heads.{i}.lm_head.*``) are stored."""
        return ("lm_head.",)

    def saved_state(self, module, head_config):
        built = getattr(module, "cfg", head_config).lm_head
        if head_config.lm_head != built:
            raise ValueError(f"head config says lm_head={head_config.lm_head!r} but the heads "
                             f"were built with lm_head={built!r}: save them with their resolved "
                             "config (heads.cfg)")
        return super().saved_state(module, head_config)

    def empty_head(self, head_config, identity, target_config, target_model):
        head = medusa.MedusaHeads(head_config, identity["hidden_size"], identity["vocab_size"])
        if target_model is not None:
            head.attach_target(target_model)
        elif head.shared:
            log.warning("Medusa package with a shared LM head loaded without its target: the LM "
                        "head is unset; call module.attach_target(target_model) before decoding")
        return head

    def memory_shape(self, head_config):
        return HeadShape(own_lm_heads=int(head_config.num_heads) if head_config.lm_head == "own"
                         else 0)

    def max_draft_length(self, head_config):
        return int(head_config.num_heads)

    def decode_options(self, cfg, measured_tree=None):
        """``medusa_branching`` (top-k per head): given, else measured, else the default."""
        given = cfg.get("medusa_branching")
        if given:
            return {"medusa_branching": tuple(int(b) for b in given)}, False
        measured = getattr(measured_tree, "branching", None)
        if measured is not None:
            return {"medusa_branching": tuple(measured)}, True
        return {"medusa_branching": medusa.DEFAULT_BRANCHING}, False

    def check_measure_options(self, cfg):
        bad = [list(b) for b in cfg["medusa_branchings"] if not b or any(int(x) < 1 for x in b)]
        if bad:
            raise ValueError(f"medusa_branchings takes non-empty lists of values >= 1, got {bad}; "
                             "pass medusa_branchings=[] to skip the Medusa tree-shape search")

    def tree_shapes(self, cfg, head_config):
        """Each static tree of ``medusa_branchings`` that the heads can serve."""
        longest = self.max_draft_length(head_config)
        return [{"depth": len(b), "total_tokens": medusa.static_tree_size(b), "branching": b,
                 "overrides": {"tree": "tree", "medusa_branching": b}}
                for b in ([int(x) for x in b] for b in cfg["medusa_branchings"])
                if len(b) <= longest]
