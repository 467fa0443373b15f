"""The draft families, each one object: everything draftsmith knows about a kind of draft.

A :class:`DraftFamily` owns its head config class, how to build the trainable module, which
tensors a package stores and how they load back, how training turns the module into per-position
pairs (``distill_targets``), its default position weights, its config checks, what it can do at
decode time (tree kind, a frequent-token draft vocabulary, assisting transformers ``generate``),
the proposer that drafts with it and the export formats it supports. Training, packages,
decoding, measuring, benchmarks and export ask the family; none of them branches on its name.

``FAMILIES`` is the one list. Adding a family: a head module in ``heads/``, a ``DraftFamily``
subclass here registered in ``FAMILIES``, its proposer in ``eval/`` and ``conf/draft/<name>.yaml``.

The proposer is named by its dotted path (resolved in ``eval/draft.py``) rather than imported:
proposers live on the evaluation floor above ``heads/``, as serving engines keep their model
registries as lazily resolved names.
"""
from __future__ import annotations

import abc
import enum
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from heads import draft_lm, eagle, medusa

log = logging.getLogger(__name__)
WEIGHTS = "model.safetensors"  # a head's stored tensors inside a package


class TreeKind(enum.Enum):
    """How a family drafts a tree: a dynamic top-k tree from the draft's own scores (draft LM,
    EAGLE-2) or a static branching of per-position candidates (Medusa)."""

    DYNAMIC = "dynamic"
    STATIC = "static"


class HeadStateError(ValueError):
    """Stored tensors do not fit the head that the package's config describes."""


class DraftFamily(abc.ABC):
    """One draft family. Subclasses set the class attributes and override the hooks they need.

    Attributes:
        name: the family's name in configs and packages (``draft.kind``, ``draft_kind``).
        config_class: its head config dataclass (``from_dict`` / ``to_dict``).
        proposer: dotted path of its ``eval`` proposer class (``for_draft`` builds it).
        tree: how it drafts trees.
        tree_by_default: what ``tree=auto`` drafts when nothing was measured.
        batched_tree: it drafts trees in batches too (``eval/decode.py batch_size=B tree=tree``).
        draft_vocab: it can draft over the most frequent target ids at decode time.
        hf_model: the module is a whole transformers causal LM (``save_pretrained``; it can be
            transformers' ``assistant_model``).
        export_formats: the ``scripts/export.py`` formats it can be written in.
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    proposer: ClassVar[str]
    tree: ClassVar[TreeKind] = TreeKind.DYNAMIC
    tree_by_default: ClassVar[bool] = False
    batched_tree: ClassVar[bool] = False
    draft_vocab: ClassVar[bool] = False
    hf_model: ClassVar[bool] = False
    export_formats: ClassVar[tuple[str, ...]] = ()

    distill_targets: ClassVar[Callable[..., list]]

    # ------------------------------------------------------------------ training
    def resolve_config(self, raw: Mapping[str, Any], target_config: Any) -> dict[str, Any]:
        """``draft.config`` with the values derived from the target filled in (``auto``)."""
        return dict(raw)

    def head_config(self, raw: Mapping[str, Any], target_config: Any) -> Any:
        """The head config from ``draft.config`` values (``_target_`` already removed)."""
        return self.config_class(**self.resolve_config(raw, target_config))

    @abc.abstractmethod
    def build(self, head_config: Any, target_model: nn.Module,
              token_counts: Tensor | None = None) -> nn.Module:
        """A fresh trainable module for ``target_model`` (frozen parts taken from it)."""

    def needs_token_counts(self, head_config: Any) -> bool:
        """Whether :meth:`build` needs the training split's token counts."""
        return False

    def for_training(self, module: nn.Module, draft_cfg: Mapping[str, Any]) -> nn.Module:
        """The module as it trains (e.g. wrapped with LoRA adapters); default unchanged."""
        return module

    def num_positions(self, head_config: Any, requested: int) -> int:
        """Draft positions trained per token (``draft.num_positions``, capped by the head)."""
        return requested

    def default_position_weights(self, head_config: Any, n: int) -> list[float]:
        return [0.8 ** i for i in range(n)]

    def distill_extra(self, n: int, layer_ids: list[int] | None) -> dict[str, Any]:
        """Extra keyword arguments of ``distill_targets`` during training."""
        return {}

    def draft_to_target(self, module: nn.Module, head_config: Any) -> Tensor | None:
        """(V_draft,) target id of each draft id for a reduced-vocabulary head, else None."""
        return None

    def validate(self, draft_cfg: Mapping[str, Any]) -> None:
        """Check ``draft.config`` values before anything loads; raise ValueError naming the fix."""

    def validate_against_target(self, draft_cfg: Mapping[str, Any], vocab_size: int,
                                hidden_size: int, num_layers: int) -> None:
        """Check ``draft.config`` values that depend on the target; raise ValueError."""

    def check_init_from(self, package_config: Any, draft_cfg: Mapping[str, Any],
                        where: str) -> None:
        """Refuse continuing from a package whose head cannot use this run's data."""

    # ------------------------------------------------------------------ packages
    def saved_state(self, module: nn.Module, head_config: Any) -> dict[str, Tensor]:
        """The tensors a package stores (frozen parts copied from the target left out)."""
        state = module.state_dict()
        # safetensors refuses shared or non-contiguous storage: store independent copies
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}

    def target_config_of(self, module: nn.Module) -> Any:
        """The target's model config as far as the module holds it (None: it holds none)."""
        return None

    def draft_config_of(self, module: nn.Module) -> dict[str, Any] | None:
        """The draft's own model config, derived from the target's and recorded explicitly in
        the package (``draft_config``): widths, heads, head dim, RoPE, norm eps, activation,
        vocabulary, and the class (``architectures``). None: the family has none."""
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            return None
        d = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
        if not d.get("architectures") and type(module).__name__.endswith("ForCausalLM"):
            d["architectures"] = [type(module).__name__]
        return d

    @abc.abstractmethod
    def empty_head(self, head_config: Any, identity: Mapping[str, Any], target_config: Any,
                   target_model: nn.Module | None) -> nn.Module:
        """An untrained head of the stored shapes, frozen parts attached from ``target_model``."""

    def save(self, module: nn.Module, head_config: Any, folder, tokenizer: Any = None) -> None:
        """Write the module's weights into ``folder``."""
        from safetensors.torch import save_file

        save_file(self.saved_state(module, head_config), str(folder / WEIGHTS),
                  metadata={"format": "pt", "draft_kind": self.name})

    def load(self, folder, head_config: Any, identity: Mapping[str, Any], target_config: Any,
             target_model: nn.Module | None) -> nn.Module:
        """The module stored in ``folder`` (fp32). Raises HeadStateError on a misfit."""
        from safetensors.torch import load_file

        head = self.empty_head(head_config, identity, target_config, target_model)
        self.load_state(head, head_config, load_file(str(folder / WEIGHTS)))
        return head

    def load_state(self, module: nn.Module, head_config: Any, state: dict[str, Tensor]) -> None:
        """Load stored tensors into a head; the only keys allowed to be absent are frozen parts."""
        expected = set(self.saved_state(module, head_config))
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - set(module.state_dict()))
        if missing or unexpected:
            raise HeadStateError(f"weights do not fit a {self.name} head with config "
                                 f"{head_config.to_dict()}: missing {missing[:8]}, unexpected "
                                 f"{unexpected[:8]}")
        own = module.state_dict()
        bad = [f"{k}: stored {tuple(v.shape)}, head expects {tuple(own[k].shape)}"
               for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
        if bad:
            raise HeadStateError(f"tensor shapes do not fit the head: {bad[:8]}")
        module.load_state_dict(state, strict=False)

    # ------------------------------------------------------------------ decoding
    def max_draft_length(self, head_config: Any) -> int | None:
        """The longest chain the head can draft (None: unbounded)."""
        return None

    def default_draft_length(self, head_config: Any) -> int:
        """The draft length an export advertises when none was measured."""
        return self.max_draft_length(head_config) or 3


# ----------------------------------------------------------------------------- the families
class DraftLMFamily(DraftFamily):
    """A small causal LM over the target's vocabulary (``heads/draft_lm.py``)."""

    name = "lm"
    config_class = draft_lm.DraftLMConfig
    proposer = "eval.proposers.DraftLMProposer"
    draft_vocab = True
    hf_model = True
    export_formats = ("hf", "gguf")
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
    proposer = "eval.proposers_medusa.MedusaProposer"
    tree = TreeKind.STATIC
    tree_by_default = True
    export_formats = ("medusa",)
    distill_targets = staticmethod(medusa.distill_targets)

    def resolve_config(self, raw, target_config):
        """``lm_head: auto`` becomes ``own`` or ``shared`` by the size of the target's LM head
        (``heads.medusa.auto_lm_head``, which logs the choice)."""
        raw = dict(raw)
        if raw.get("lm_head") == "auto":
            from heads.draft_config import text_config

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

    def saved_state(self, module, head_config):
        """Leaves out a shared LM head (``lm_head.*``, the target's own weight): it is attached
        from the target on load. Own LM heads (``heads.{i}.lm_head.*``) are stored."""
        built = getattr(module, "cfg", head_config).lm_head
        if head_config.lm_head != built:
            raise ValueError(f"head config says lm_head={head_config.lm_head!r} but the heads "
                             f"were built with lm_head={built!r}: save them with their resolved "
                             "config (heads.cfg)")
        state = {k: v for k, v in module.state_dict().items() if not k.startswith("lm_head.")}
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}

    def empty_head(self, head_config, identity, target_config, target_model):
        head = medusa.MedusaHeads(head_config, identity["hidden_size"], identity["vocab_size"])
        if target_model is not None:
            head.attach_target(target_model)
        elif head.shared:
            log.warning("Medusa package with a shared LM head loaded without its target: the LM "
                        "head is unset; call module.attach_target(target_model) before decoding")
        return head

    def max_draft_length(self, head_config):
        return int(head_config.num_heads)


class EagleFamily(DraftFamily):
    """An EAGLE feature-level head, EAGLE-1/2 and EAGLE-3 (``heads/eagle.py``)."""

    name = "eagle"
    config_class = eagle.EagleConfig
    proposer = "eval.proposers_eagle.EagleProposer"
    tree_by_default = True
    batched_tree = True
    draft_vocab = True
    export_formats = ("eagle", "eagle3", "speculators")
    distill_targets = staticmethod(eagle.distill_targets)

    def build(self, head_config, target_model, token_counts=None):
        if self.needs_token_counts(head_config) and token_counts is None:
            raise ValueError("a reduced draft vocabulary needs the training split to count tokens")
        return eagle.build_eagle(head_config, target_model, token_counts=token_counts)

    def needs_token_counts(self, head_config):
        return head_config.draft_vocab_size is not None

    def resolve_config(self, raw, target_config):
        """``fuse_layers: auto`` becomes EAGLE-3's low / middle / high layers of the target."""
        raw = dict(raw)
        if raw.get("fuse_layers") == "auto":
            from heads.draft_config import text_config

            n = int(text_config(target_config).num_hidden_layers)
            raw["fuse_layers"] = eagle.auto_fuse_layers(n)
            log.info("draft.config.fuse_layers=auto -> %s (low / middle / high of %d layers)",
                     raw["fuse_layers"], n)
        return raw

    def distill_extra(self, n, layer_ids):
        return {"num_steps": n, "layer_ids": layer_ids}

    def draft_to_target(self, module, head_config):
        if head_config.draft_vocab_size is None:
            return None
        return module.d2t.detach().clone()

    def validate(self, draft_cfg):
        vocab = (draft_cfg.get("config") or {}).get("draft_vocab_size")
        if vocab is not None and (not isinstance(vocab, int) or vocab <= 0):
            raise ValueError(f"draft.config.draft_vocab_size={vocab!r} must be null or a positive "
                             "integer")

    def validate_against_target(self, draft_cfg, vocab_size, hidden_size, num_layers):
        cfg = draft_cfg.get("config") or {}
        vocab = cfg.get("draft_vocab_size")
        if vocab is not None and vocab > vocab_size:
            raise ValueError(f"draft.config.draft_vocab_size={vocab} exceeds the target's "
                             f"vocabulary ({vocab_size}); use a value <= {vocab_size} or null")
        fuse = cfg.get("fuse_layers")
        bad = [] if fuse == "auto" else [i for i in (fuse or []) if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"draft.config.fuse_layers has ids {bad} outside the target's "
                             f"0..{num_layers}")

    def check_init_from(self, package_config, draft_cfg, where):
        want = list((draft_cfg.get("config") or {}).get("fuse_layers") or [])
        have = list(package_config.fuse_layers or [])
        if want != have:
            raise ValueError(f"draft.init_from={where} fuses target layers {have or 'none'} but "
                             f"draft.config.fuse_layers is {want or 'null'}: set "
                             f"draft.config.fuse_layers={have or 'null'} so the feature cache "
                             "holds the layers the head reads")

    def saved_state(self, module, head_config):
        """Leaves out ``embed_tokens.*`` always and ``lm_head.*`` when the head uses the target's
        LM head (``draft_vocab_size`` is None); they are re-attached from the target on load."""
        drop = ("embed_tokens.",) + (("lm_head.",) if head_config.draft_vocab_size is None
                                     else ())
        return {k: v for k, v in super().saved_state(module, head_config).items()
                if not k.startswith(drop)}

    def target_config_of(self, module):
        return module.config  # the target's config cut to the head's one decoder layer

    def empty_head(self, head_config, identity, target_config, target_model):
        if target_config is None:
            raise ValueError("this package stores no target_config: pass target=... to load it")
        head = eagle.EagleHead(head_config, target_config)
        if target_model is not None:
            head.attach_target(target_model)
        else:
            log.warning(
                "EAGLE package loaded without its target: embedding and target LM head are unset;"
                " call module.attach_target(target_model) before decoding")
        return head


FAMILIES: dict[str, DraftFamily] = {f.name: f for f in (DraftLMFamily(), MedusaFamily(),
                                                         EagleFamily())}


def get_family(name: str) -> DraftFamily:
    """The family called ``name``; a ValueError lists the known ones."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown draft family {name!r}; known: {', '.join(FAMILIES)}") from None
