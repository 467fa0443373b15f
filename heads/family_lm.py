"""The draft LM family (:class:`DraftLMFamily`): a small causal LM over the target's vocabulary,
trained, stored and loaded as a transformers model (``heads/draft_lm.py``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from draftsmith.heads import draft_lm
from draftsmith.heads.family_base import DraftFamily, house_export


class DraftLMFamily(DraftFamily):
    """A small causal LM over the target's vocabulary (``heads/draft_lm.py``)."""

    name = "lm"
    config_class = draft_lm.DraftLMConfig
    proposer = "draftsmith.eval.decoding.proposers.DraftLMProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchDraftLM"
    draft_vocab = True
    hf_model = True
    exports = (house_export("hf", "_write_hf", method="draft_model"),
               house_export("gguf", "_write_gguf", "llama_cpp", weights_file="draft.gguf"))
    distill_targets = staticmethod(draft_lm.distill_targets)

    _WIDTHS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")

    def head_config(self, raw: Mapping[str, Any], target_config: Any) -> Any:
        """Without explicit widths the draft takes the target's (so ``init=target`` works)."""
        raw = self.resolve_config(raw, target_config)
        if not any(raw.get(w) is not None for w in self._WIDTHS):
            for w in self._WIDTHS:
                raw.pop(w, None)
            return draft_lm.DraftLMConfig.matching(target_config, **raw)
        return draft_lm.DraftLMConfig(**raw)

    def build(self, head_config, target_model, token_counts=None):
        return draft_lm.build_draft_lm(head_config, target_model)

    def empty_head(self, head_config, identity, target_config, target_model):
        from transformers import AutoModelForCausalLM

        if target_config is None:
            raise ValueError("a draft LM's shapes come from the target's config: pass target=")
        return AutoModelForCausalLM.from_config(draft_lm.draft_lm_config(head_config,
                                                                         target_config))

    def for_training(self, module, draft_cfg):
        lora = draft_cfg.get("lora")
        return draft_lm.apply_lora(module, **dict(lora)) if lora else module

    def num_positions(self, head_config, requested):
        return 1

    def default_position_weights(self, head_config, n):
        return [1.0]

    def validate_against_target(self, draft_cfg, vocab_size, hidden_size, num_layers):
        if draft_cfg.get("init_from"):  # the sizes are the starting package's or model's
            return
        cfg = draft_cfg.get("config") or {}
        hidden, init, n = cfg.get("hidden_size"), cfg.get("init"), cfg.get("num_layers")
        if init == "target" and hidden is not None and hidden != hidden_size:
            raise ValueError(
                f"draft.config.hidden_size={hidden} does not fit the target (hidden {hidden_size})"
                " with draft.config.init=target; use hidden_size=null (the target's) or "
                "init=random")
        if init == "target" and n is not None and n > num_layers:
            raise ValueError(f"draft.config.num_layers={n} exceeds the target's {num_layers} "
                             "layers")

    def save(self, module, head_config, folder, tokenizer=None):
        if hasattr(module, "merge_and_unload"):  # a LoRA-wrapped draft: store merged weights
            import copy

            module = copy.deepcopy(module).merge_and_unload()
        module.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    def load(self, folder, head_config, identity, target_config, target_model):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
