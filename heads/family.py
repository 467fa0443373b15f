"""The draft families, each one object: everything draftsmith knows about a kind of draft.

A :class:`DraftFamily` owns its head config class, how to build the trainable module, which
tensors a package stores and how they load back, how training turns the module into per-position
pairs (``distill_targets``), its default position weights, its config checks, what it can do at
decode time (tree kind, a frequent-token draft vocabulary, assisting transformers ``generate``),
the proposer that drafts with it and the export formats it supports. Training, packages,
decoding, measuring, benchmarks and export ask the family; none of them branches on its name.

``FAMILIES`` is the one list; :func:`register` adds a family defined anywhere (a plugin, a
test), :func:`unregister` takes it out (ARCHITECTURE.md: "Adding a family").

The proposer, the batched drafter and the export writers are named by dotted paths (resolved
with ``family_base.load_object``) rather than imported: they live on the floors above
``heads/``, as serving engines keep their model registries as lazily resolved names.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from draftsmith.heads import dflash, dflash_train, draft_lm, eagle, eagle_config, eagle_ttt, medusa
from draftsmith.heads.family_base import DraftFamily, ExportFormat, HeadShape, TreeKind
from draftsmith.heads.weights import WEIGHTS

__all__ = ["FAMILIES", "DFlashFamily", "DraftLMFamily", "EagleFamily", "MedusaFamily",
           "get_family", "register", "unregister"]

log = logging.getLogger(__name__)


def _export(name: str, writer: str, engine: str = "vllm", method: str | None = None,
            weights_file: str = WEIGHTS, module: str = "export_formats") -> ExportFormat:
    """Written by ``scripts/<module>.py:<writer>``, read by ``heads.exports._read_<name>``."""
    return ExportFormat(name, f"draftsmith.scripts.{module}.{writer}",
                        f"draftsmith.heads.exports._read_{name}", weights_file, engine, method)


# a GGUF that llama.cpp's own converter writes and its llama-server runs (scripts/engines.py)
CONVERTED_GGUF = _export("gguf", "write_gguf_export", "llama_server", weights_file="draft.gguf",
                         module="export_gguf_convert")


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


# ----------------------------------------------------------------------------- the families
class DraftLMFamily(DraftFamily):
    """A small causal LM over the target's vocabulary (``heads/draft_lm.py``)."""

    name = "lm"
    config_class = draft_lm.DraftLMConfig
    proposer = "draftsmith.eval.decoding.proposers.DraftLMProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchDraftLM"
    draft_vocab = True
    hf_model = True
    exports = (_export("hf", "_write_hf", method="draft_model"),
               _export("gguf", "_write_gguf", "llama_cpp", weights_file="draft.gguf"))
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


class MedusaFamily(DraftFamily):
    """Medusa-1 heads on the target's final hidden state (``heads/medusa.py``)."""

    name = "medusa"
    config_class = medusa.MedusaConfig
    proposer = "draftsmith.eval.decoding.proposers_medusa.MedusaProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchMedusa"
    tree = TreeKind.STATIC
    tree_by_default = True
    exports = (_export("medusa", "_write_medusa", method="medusa",
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


class EagleFamily(DraftFamily):
    """An EAGLE feature-level head, EAGLE-1/2 and EAGLE-3 (``heads/eagle.py``)."""

    name = "eagle"
    config_class = eagle_config.EagleConfig
    proposer = "draftsmith.eval.decoding.proposers_eagle.EagleProposer"
    batch_drafter = "draftsmith.eval.decoding.batch_drafters.BatchEagle"
    tree_by_default = True
    batched_tree = True
    draft_vocab = True
    exports = (_export("eagle", "_write_eagle", method="eagle"),
               _export("eagle3", "_write_eagle3", method="eagle3"),
               _export("speculators", "_write_speculators"),  # served as the model itself
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
    exports = (_export("dflash", "write_dflash", module="export_dflash"), CONVERTED_GGUF)
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


FAMILIES: dict[str, DraftFamily] = {f.name: f for f in (DraftLMFamily(), MedusaFamily(),
                                                         EagleFamily(), DFlashFamily())}


def register(family: DraftFamily) -> DraftFamily:
    """Add ``family`` to ``FAMILIES`` (``draft.kind=<its name>`` then trains, loads, decodes and
    exports it); a ValueError when the name or one of its export formats is taken."""
    if family.name in FAMILIES:
        raise ValueError(f"a draft family named {family.name!r} is registered already")
    taken = {fmt for f in FAMILIES.values() for fmt in f.export_formats}
    clash = sorted(taken & set(family.export_formats))
    if clash:
        raise ValueError(f"export formats {clash} of {family.name!r} belong to another family")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> DraftFamily:
    """Take the family called ``name`` out of ``FAMILIES`` (a KeyError when it is not there)."""
    return FAMILIES.pop(name)


def get_family(name: str) -> DraftFamily:
    """The family called ``name``; a ValueError lists the known ones."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown draft family {name!r}; known: {', '.join(FAMILIES)}") from None
