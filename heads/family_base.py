"""The base of every draft family: :class:`DraftFamily` (what a family owns and the hooks it may
override), how it drafts trees (:class:`TreeKind`), the error a misfitting stored state raises
and the export formats it writes (:class:`ExportFormat`; :func:`house_export` for draftsmith's own
writers and readers). The families of the house: ``heads/family_lm.py``, ``family_medusa.py``,
``family_fused.py`` (EAGLE, DFlash); ``FAMILIES``, the one list: ``heads/family.py``.
"""
from __future__ import annotations

import abc
import enum
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from draftsmith.heads.weights import WEIGHTS, load_weights, save_weights


class TreeKind(enum.Enum):
    """How a family drafts a tree: a dynamic top-k tree from the draft's own scores (draft LM,
    EAGLE-2), a static branching of per-position candidates (Medusa), or none: it drafts chains
    only (DFlash: one forward drafts one block, a single chain)."""

    DYNAMIC = "dynamic"
    STATIC = "static"
    NONE = "none"


class HeadStateError(ValueError):
    """Stored tensors do not fit the head that the package's config describes."""


@dataclass(frozen=True)
class ExportFormat:
    """One layout a family's drafts are exported in (``scripts/export.py format=<name>``).

    Attributes:
        name: the format's name (``format=``, the export's ``manifest.json`` ``export_format``).
        writer: dotted path of its writer, ``(pkg, folder, WriteOptions) -> None`` (``scripts/``).
        reader: dotted path of its reader back into a head, ``(weights path, family, head config,
            info, target) -> module`` (``heads/exports.py`` reads every export).
        weights_file: the file the weights are written to.
        engine: the engine that runs it (``scripts/engines.py``: ``vllm``, ``llama_cpp``).
        method: vLLM's speculative method (None: the engine reads the format itself).
    """

    name: str
    writer: str
    reader: str
    weights_file: str
    engine: str
    method: str | None = None


def house_export(name: str, writer: str, engine: str = "vllm", method: str | None = None,
                 weights_file: str = WEIGHTS, module: str = "export_formats") -> ExportFormat:
    """An export format of draftsmith's own: written by ``scripts/<module>.py:<writer>``, read by
    ``heads.exports._read_<name>``."""
    return ExportFormat(name, f"draftsmith.scripts.{module}.{writer}",
                        f"draftsmith.heads.exports._read_{name}", weights_file, engine, method)


@dataclass(frozen=True)
class HeadShape:
    """What sizes a head's training memory beyond its parameters (``train/memory.py``).

    Attributes:
        fused_layers: target layers fused into its input besides the final hidden state.
        own_lm_heads: LM heads of its own that ``draft.config.lm_head=shared`` would remove.
        reducible_vocab: it predicts the full vocabulary and ``draft.config.draft_vocab_size``
            could reduce it.
    """

    fused_layers: int = 0
    own_lm_heads: int = 0
    reducible_vocab: bool = False


def load_object(path: str) -> Any:
    """The object a dotted path names (``package.module.Name``), imported on first use."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def max_tree_nodes(depth: int, topk: int) -> int:
    """Most nodes a dynamic tree of ``depth`` can draft: ``topk`` at depth 1, ``topk**2`` below."""
    return topk + (depth - 1) * topk * topk


class DraftFamily(abc.ABC):
    """One draft family. Subclasses set the class attributes and override the hooks they need.

    Attributes:
        name: the family's name in configs and packages (``draft.kind``, ``draft_kind``).
        config_class: its head config dataclass (``from_dict`` / ``to_dict``).
        proposer: dotted path of its ``eval`` proposer class (``Proposer.for_draft`` builds it).
        batch_drafter: dotted path of its batched drafter (``eval/decoding/batch_drafters.py``,
            built from the proposer), None: it decodes one prompt at a time.
        tree: how it drafts trees (``TreeKind.NONE``: chains only, ``tree=tree`` is refused).
        tree_by_default: what ``tree=auto`` drafts when nothing was measured.
        batched_tree: it drafts trees in batches too (``eval/decode.py batch_size=B tree=tree``).
        draft_vocab: it can draft over the most frequent target ids at decode time.
        hf_model: the module is a whole transformers causal LM (``save_pretrained``; it can be
            transformers' ``assistant_model``).
        exports: the ``scripts/export.py`` formats it can be written in, each with its writer,
            reader and engine (:class:`ExportFormat`; ``export_formats`` their names).
        gguf_layout: how its ``gguf`` export is made: None = written directly (a llama-class
            draft LM); else the layout llama.cpp's converter reads it from
            (``scripts/export_gguf_convert.py``: ``eagle3``, ``zlab_dflash``).
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    proposer: ClassVar[str]
    batch_drafter: ClassVar[str | None] = None
    tree: ClassVar[TreeKind] = TreeKind.DYNAMIC
    tree_by_default: ClassVar[bool] = False
    batched_tree: ClassVar[bool] = False
    draft_vocab: ClassVar[bool] = False
    hf_model: ClassVar[bool] = False
    exports: ClassVar[tuple[ExportFormat, ...]] = ()
    gguf_layout: ClassVar[str | None] = None

    distill_targets: ClassVar[Callable[..., list]]

    @property
    def export_formats(self) -> tuple[str, ...]:
        """The names of :attr:`exports`."""
        return tuple(e.name for e in self.exports)

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

    def memory_shape(self, head_config: Any) -> HeadShape:
        """The head's sizes that ``train/memory.py`` estimates and can shrink."""
        return HeadShape()

    def validate(self, draft_cfg: Mapping[str, Any]) -> None:
        """Check ``draft.config`` values before anything loads; raise ValueError naming the fix."""

    def validate_against_target(self, draft_cfg: Mapping[str, Any], vocab_size: int,
                                hidden_size: int, num_layers: int) -> None:
        """Check ``draft.config`` values that depend on the target; raise ValueError."""

    def check_init_from(self, package_config: Any, draft_cfg: Mapping[str, Any],
                        where: str) -> None:
        """Refuse continuing from a package whose head cannot use this run's data."""

    # ------------------------------------------------------------------ packages
    def frozen_prefixes(self, head_config: Any) -> tuple[str, ...]:
        """State-dict prefixes of the target's own weights that the head reads (its embedding,
        its LM head): left out of packages and attached from the target on load."""
        return ()

    def saved_state(self, module: nn.Module, head_config: Any) -> dict[str, Tensor]:
        """The tensors a package stores (frozen parts copied from the target left out)."""
        drop = self.frozen_prefixes(head_config)
        state = {k: v for k, v in module.state_dict().items() if not k.startswith(drop)}
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
        save_weights(self.saved_state(module, head_config), folder,
                     {"format": "pt", "draft_kind": self.name})

    def load(self, folder, head_config: Any, identity: Mapping[str, Any], target_config: Any,
             target_model: nn.Module | None) -> nn.Module:
        """The module stored in ``folder`` (fp32; its one weights file or its shards). Raises
        HeadStateError on a misfit."""
        head = self.empty_head(head_config, identity, target_config, target_model)
        self.load_state(head, head_config, load_weights(folder))
        return head

    def load_state(self, module: nn.Module, head_config: Any, state: dict[str, Tensor]) -> None:
        """Load stored tensors into a head; the only keys allowed to be absent are frozen parts."""
        own, frozen = module.state_dict(), self.frozen_prefixes(head_config)
        expected = {k for k in own if not k.startswith(frozen)}
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise HeadStateError(f"weights do not fit a {self.name} head with config "
                                 f"{head_config.to_dict()}: missing {missing[:8]}, unexpected "
                                 f"{unexpected[:8]}")
        bad = [f"{k}: stored {tuple(v.shape)}, head expects {tuple(own[k].shape)}"
               for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
        if bad:
            raise HeadStateError(f"tensor shapes do not fit the head: {bad[:8]}")
        module.load_state_dict(state, strict=False)

    # ------------------------------------------------------------------ decoding
    def max_draft_length(self, head_config: Any) -> int | None:
        """The longest chain the head can draft (None: unbounded)."""
        return None

    def engine_draft_length(self, head_config: Any) -> int | None:
        """The draft length an export must advertise when the head fixes it (None: any K up to
        :meth:`max_draft_length`, K* when measured). A block drafter's engines size the block
        from it, so another value would change what the head computes."""
        return None

    def default_draft_length(self, head_config: Any) -> int:
        """The draft length an export advertises when none was measured."""
        return self.max_draft_length(head_config) or 3

    def decode_options(self, cfg: Mapping[str, Any],
                       measured_tree: Any = None) -> tuple[dict[str, Any], bool]:
        """The family's own decode options (``DraftSettings.options``) from the decode config
        ``cfg``, else from ``measured_tree`` (``eval.draft.MeasuredTree``, given when a measured
        tree is drafted), else defaults; and whether they came from the measured tree."""
        return {}, False

    def check_measure_options(self, cfg: Mapping[str, Any]) -> None:
        """Check the family's keys of ``conf/eval/measure.yaml``; a ValueError names the fix."""

    def tree_shapes(self, cfg: Mapping[str, Any], head_config: Any) -> list[dict[str, Any]]:
        """The tree shapes ``eval/measure.py`` decodes with, as ``{"depth", "total_tokens",
        "overrides"}`` (the decode options drafting it): for a dynamic tree each (depth, size) of
        ``tree_depths`` x ``tree_sizes`` (a size larger than a depth can hold, ``topk`` nodes per
        expanded node and ``topk`` expanded per depth, is the full tree of that depth and is tried
        once); none for a family that drafts chains only."""
        if self.tree is not TreeKind.DYNAMIC:
            return []
        shapes: list[dict[str, Any]] = []
        topk = int(cfg["tree_topk"])
        for depth in sorted({int(d) for d in cfg["tree_depths"]}):
            cap = max_tree_nodes(depth, topk)
            sizes = sorted({int(n) for n in cfg["tree_sizes"]})
            over = [n for n in sizes if n > cap][:1]  # any of them is the full tree
            sizes = [n for n in sizes if n <= cap] + ([] if cap in sizes else over)
            shapes += [{"depth": depth, "total_tokens": n,
                        "overrides": {"tree": "tree", "tree_size": n}} for n in sizes]
        return shapes
