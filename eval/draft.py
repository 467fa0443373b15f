"""A draft for decoding: load it with every check, settle how it drafts, build its proposer.

Every evaluation tool gets its draft here. :func:`load_draft` reads a draft package or an
export (manifest and target identity verified either way). :func:`settle` turns the decode
options (``k``, ``tree``, ``tree_size``, ``draft_vocab``, and the family's own, e.g. Medusa's
``medusa_branching``: ``DraftFamily.decode_options``; null = measured)
and the package's ``speculation.json`` into one typed :class:`DraftSettings`: the record measured
in the same dtype on the same device type (:meth:`Measured.of`), else the nearest one (another
dtype on that device type, :func:`nearest_measured`), taken from the record measured at the
nearest temperature (a package may hold one per temperature: :func:`merge_record`).
:func:`build_proposer` makes the family's proposer from them.

``tree=auto`` means the same for every family: where the dynamic tree and the chain were both
measured (or only the tree), the faster one; otherwise the family's default
(``DraftFamily.tree_by_default``) when something was measured, and a chain when nothing was (a
large tree that was never timed here can decode slower than plain decoding: the release's 60-node
default ran at 0.61x in fp32). A static tree (Medusa) has no chain to compare with on the
measured grid, so ``auto`` drafts its tree; a family without trees (DFlash) drafts its chain, and
``tree=tree`` is refused for it.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from draftsmith.eval.decoding.kernels import int8_or_dense, pack_draft
from draftsmith.eval.decoding.tree import check_tree_draw
from draftsmith.heads.family import FAMILIES
from draftsmith.heads.family_base import TreeKind, load_object
from draftsmith.heads.quantize import FP32_ONLY
from draftsmith.heads.vocab import FULL, TOKEN_FREQUENCY, frequent_ids, package_token_counts

DEFAULT_K = 4  # draft length when neither k= nor a measured K* is given
DEFAULT_TREE_SIZE = 16  # dynamic-tree nodes when neither tree_size= nor a measured shape is given


class TreeMode(enum.Enum):
    """``tree=``: ``auto`` (the measured faster one, else the family's default), or forced."""

    AUTO = "auto"
    CHAIN = "chain"
    TREE = "tree"

    @classmethod
    def parse(cls, value: Any) -> TreeMode:
        try:
            return cls(str(value))
        except ValueError:
            raise ValueError(f"tree={value!r}: allowed {', '.join(m.value for m in cls)}") from None


def parse_draft_vocab(value: Any, vocab_size: int | None = None) -> int | None:
    """``draft_vocab`` as a size (None = the whole vocabulary; ``full`` and ``0`` say so)."""
    if value is None or (isinstance(value, str) and value.lower() == FULL) or value == 0:
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size < 1 or isinstance(value, bool) or (vocab_size is not None and size > vocab_size):
        top = vocab_size if vocab_size is not None else "the vocabulary size"
        raise ValueError(f"draft_vocab={value!r}: allowed null (measured), full, or a number of "
                         f"most frequent ids in 1..{top}")
    return None if vocab_size is not None and size == vocab_size else size


# ----------------------------------------------------------------------------- measured record
BY_TEMPERATURE = "by_temperature"  # speculation.json: records measured at other temperatures
_SHARED = ("batch",)  # speculation.json keys that belong to no one temperature's record


def record_temperature(record: Mapping) -> float:
    """The sampling temperature ``eval/measure.py`` measured ``record`` at (0: greedy)."""
    return float((record.get("measured") or {}).get("temperature") or 0.0)


def records_of(speculation: Mapping | None) -> list[dict]:
    """Every measured record of ``speculation.json``, lowest temperature first: the top-level
    one (the lowest temperature measured) and those under ``by_temperature``."""
    spec = dict(speculation or {})
    nested = spec.pop(BY_TEMPERATURE, None) or {}
    for key in _SHARED:
        spec.pop(key, None)
    records = ([spec] if "k_star" in spec else []) + [dict(r) for r in nested.values()]
    return sorted(records, key=record_temperature)


def record_at(speculation: Mapping | None, temperature: float | None) -> tuple[dict, float]:
    """The record measured at the temperature nearest ``temperature`` (the lower one on a tie;
    None: the top-level record) and the temperature it was measured at. Acceptance, and with it
    K* and the best tree, changes with the temperature: a record measured greedily drafts too
    deep for sampling."""
    records = records_of(speculation)
    if not records:
        return {}, 0.0
    if temperature is None:
        best = records[0]
    else:
        best = min(records, key=lambda r: abs(record_temperature(r) - float(temperature)))
    return best, record_temperature(best)


def merge_record(speculation: Mapping | None, record: Mapping) -> dict:
    """``speculation.json`` with ``record`` stored for its temperature: it replaces a record of
    the same temperature, the lowest temperature's record is the top level (what older readers
    take) and the others go under ``by_temperature`` keyed by temperature; the shared keys
    (``batch``) are kept."""
    spec = dict(speculation or {})
    t = record_temperature(record)
    kept = [r for r in records_of(spec) if record_temperature(r) != t] + [dict(record)]
    kept.sort(key=record_temperature)
    merged = {**kept[0], **{key: spec[key] for key in _SHARED if key in spec}}
    if len(kept) > 1:
        merged[BY_TEMPERATURE] = {f"{record_temperature(r):g}": r for r in kept[1:]}
    return merged


@dataclass(frozen=True)
class MeasuredTree:
    """The best tree shape ``eval/measure.py`` found (``speculation.json["tree"]``)."""

    depth: int
    total_tokens: int
    branching: tuple[int, ...] | None  # a static tree's branching (top-k per position)
    speedup: float | None


@dataclass(frozen=True)
class Measured:
    """What ``speculation.json`` measured, for the dtype and device type it was measured on."""

    k_star: int
    chain_speedup: float | None  # decoding at K* against plain decoding
    tree: MeasuredTree | None
    draft_vocab: int | None  # the fastest draft vocabulary size (None: the whole vocabulary)

    @classmethod
    def of(cls, speculation: Mapping | None, dtype: str | None = None,
           device: str | None = None, temperature: float | None = None
           ) -> tuple[Measured | None, str]:
        """The record for ``temperature`` (:func:`record_at`), or None and why (``default
        ...``) when it says nothing about this run: costs measured in another dtype or on
        another device say nothing about the best K here.
        """
        spec, measured_at = record_at(speculation, temperature)
        k_star = spec.get("k_star")
        if not (isinstance(k_star, int) and not isinstance(k_star, bool) and k_star >= 0):
            return None, "default"
        spec_dtype = spec.get("dtype")
        spec_device = str((spec.get("hardware") or {}).get("device", "cpu"))
        if dtype is not None and spec_dtype is not None and spec_dtype != dtype:
            return None, f"default (K* in speculation.json is for {spec_dtype})"
        if device is not None and torch.device(spec_device).type != torch.device(device).type:
            return None, f"default (K* in speculation.json is for {spec_device})"
        tree = spec.get("tree")
        shape = None
        if tree:
            branching = tree.get("branching")
            shape = MeasuredTree(int(tree["depth"]), int(tree["total_tokens"]),
                                 tuple(int(b) for b in branching) if branching else None,
                                 tree.get("speedup"))
        size = (spec.get("draft_vocab") or {}).get("size")
        source = "speculation.json"
        if temperature is not None and (speculation or {}).get(BY_TEMPERATURE):
            source += f" (T = {measured_at:g})"
        return cls(k_star, (spec.get("measured_speedup") or {}).get("speedup"), shape,
                   int(size) if size else None), source

    def tree_won(self) -> bool | None:
        """Whether the measured tree decoded faster than the chain at K*; None: not compared
        (no tree measured, or neither speedup recorded)."""
        if self.tree is None or (self.tree.speedup is None and self.chain_speedup is None):
            return None
        return self.tree.speedup is not None and (self.chain_speedup is None
                                                  or self.tree.speedup > self.chain_speedup)


def _batch_record(speculation: Mapping | None, dtype: str | None,
                  device: str | None) -> Mapping:
    """``speculation.json["batch"]`` (``scripts/bench_batch.py``) when it was measured for this
    dtype and device type, else ``{}``."""
    rec = (speculation or {}).get("batch") or {}
    if dtype is not None and rec.get("dtype") not in (None, dtype):
        return {}
    if device is not None and torch.device(str(rec.get("device", "cpu"))).type != torch.device(
            device).type:
        return {}
    return rec


def _nearest_size(per_size: Mapping, batch_size: int) -> int | None:
    """The largest measured batch size up to ``batch_size`` (None: none measured)."""
    sizes = [int(b) for b in per_size or {} if int(b) <= batch_size]
    return max(sizes) if sizes else None


def batch_k(speculation: Mapping | None, batch_size: int, dtype: str | None = None,
            device: str | None = None) -> tuple[int, str] | None:
    """K for decoding ``batch_size`` rows from ``speculation.json["batch"]``: K* of the largest
    measured batch size up to ``batch_size``, and the source; None when nothing was measured
    for this dtype and device type."""
    k_star = _batch_record(speculation, dtype, device).get("k_star") or {}
    b = _nearest_size(k_star, batch_size)
    return None if b is None else (int(k_star[str(b)]), f"speculation.json (batch {b})")


class BatchTree(NamedTuple):
    """The best EAGLE-2 tree measured at one batch size (``speculation.json["batch"]["tree"]``)
    and whether it beat that size's best chain and plain decoding."""

    depth: int
    nodes: int
    wins: bool
    source: str


def batch_tree(speculation: Mapping | None, batch_size: int, dtype: str | None = None,
               device: str | None = None) -> BatchTree | None:
    """The batched tree of the largest measured batch size up to ``batch_size``; None when no
    tree was measured for this dtype and device type."""
    trees = _batch_record(speculation, dtype, device).get("tree") or {}
    b = _nearest_size(trees, batch_size)
    if b is None:
        return None
    t = trees[str(b)]
    return BatchTree(int(t["depth"]), int(t["nodes"]), bool(t["wins"]),
                     f"speculation.json (batch {b}, tree)")


def resolve_k(k: Any, speculation: Mapping | None, dtype: str | None = None,
              device: str | None = None, temperature: float | None = None) -> tuple[int, str]:
    """The chain's draft length and where it came from: ``k`` (``config``), else the measured K*
    for this dtype, device type and (nearest) temperature (``speculation.json``), else
    :data:`DEFAULT_K` and why."""
    if k is not None:
        return int(k), "config"
    measured, source = Measured.of(speculation, dtype, device, temperature)
    return (DEFAULT_K, source) if measured is None else (measured.k_star, source)


def nearest_measured(speculation: Mapping | None, dtype: str | None, device: str | None,
                     temperature: float | None) -> tuple[Measured | None, str]:
    """The record measured for this dtype and device type (:meth:`Measured.of`), else the
    nearest one: the same device type in another dtype (its K and tree shape, tagged so), else
    None and why. A record of another device type is not near: costs there differ too much."""
    m, source = Measured.of(speculation, dtype, device, temperature)
    if m is not None or dtype is None:
        return m, source
    other, _ = Measured.of(speculation, None, device, temperature)
    if other is None:
        return None, source
    rec, _ = record_at(speculation, temperature)
    return other, f"speculation.json ({rec.get('dtype')}'s record: nearest measured)"


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class DraftSettings:
    """How a draft drafts in one run. ``k_source`` says where ``k`` came from (reports only)."""

    k: int
    k_source: str
    tree: bool
    tree_size: int
    tree_topk: int
    draft_vocab: int | None  # drafted over the most frequent ids (None: the whole vocabulary)
    tree_draw: str = "sample"  # sampled decodes: dynamic-tree children drawn, or the top-k
    options: Mapping[str, Any] = field(default_factory=dict)  # the family's own decode options


def _tagged(source: str, tag: str) -> str:
    """``speculation.json (T = 1)`` + ``tree`` -> ``speculation.json (T = 1, tree)``."""
    return f"{source[:-1]}, {tag})" if source.endswith(")") else f"{source} ({tag})"


def _draft_vocab(cfg: Mapping[str, Any], pkg: Any, m: Any) -> int | None:
    """The draft vocabulary to draft over: ``cfg.draft_vocab``, else the measured one (where the
    token counts travelled with the folder), else None (the draft's whole vocabulary)."""
    family = pkg.family
    size = cfg.get("draft_vocab")
    if family.draft_vocab and size is None:
        size = m.draft_vocab if m is not None else None
        if size is not None and not (Path(pkg.path) / TOKEN_FREQUENCY).is_file():
            size = None  # measured, but the counts did not travel with this folder
    size = parse_draft_vocab(size)
    if size is not None and not family.draft_vocab:
        able = tuple(f.name for f in FAMILIES.values() if f.draft_vocab)
        raise ValueError(f"draft_vocab={cfg.get('draft_vocab')} applies to {able} drafts, not "
                         f"{family.name}; use draft_vocab=full")
    return size


def settle(cfg: Mapping[str, Any], pkg: Any, measured: bool = True) -> DraftSettings:
    """The settings for ``pkg`` from the decode options ``cfg`` (null = measured, else default).

    ``measured=False`` ignores ``speculation.json`` (tools that set every option themselves).
    With K* = 0 and the best measured tree a loss too, the start is plain decoding (k = 0).
    """
    family = pkg.family
    dtype, device = cfg.get("dtype"), cfg.get("device")
    spec = pkg.speculation if measured else None
    temperature = float(cfg.get("temperature") or 0.0)
    m, m_source = nearest_measured(spec, dtype, device, temperature)
    k, k_source = resolve_k(cfg.get("k"), spec, dtype, device, temperature)
    if m is not None and cfg.get("k") is None:
        k, k_source = m.k_star, m_source
    mode = TreeMode.parse(cfg.get("tree", "auto"))
    if family.tree is TreeKind.NONE and mode is TreeMode.TREE:
        raise ValueError(f"tree=tree: a {family.name} draft drafts one chain per forward (no "
                         "tree); use tree=chain or tree=auto")
    # nothing measured: a short chain (adaptive K), never a large untested tree
    use_tree = mode is TreeMode.TREE or (mode is TreeMode.AUTO and family.tree_by_default
                                         and (m is not None or family.tree is TreeKind.STATIC))
    won = m.tree_won() if m is not None else None
    if mode is TreeMode.AUTO and family.tree is TreeKind.DYNAMIC and won is not None:
        use_tree = won
    batch_size = int(cfg.get("batch_size") or 1)
    b_tree = batch_tree(spec, batch_size, dtype, device) if batch_size > 1 else None
    if batch_size > 1 and mode is TreeMode.AUTO:  # batches draft chains unless a tree won there
        use_tree = (b_tree is not None and b_tree.wins
                    and cfg.get("batch_layout", "padded") != "packed")  # trees: padded only
    use_tree = use_tree and family.tree is not TreeKind.NONE  # whatever was measured
    tree_size = cfg.get("tree_size")
    from_tree = use_tree and m is not None and m.tree is not None
    options, measured_options = family.decode_options(cfg, m.tree if from_tree else None)
    if from_tree and family.tree is TreeKind.DYNAMIC:
        tree_size = m.tree.total_tokens if tree_size is None else tree_size
    if from_tree and family.tree is TreeKind.STATIC:  # a given shape is kept
        from_tree = measured_options
    if from_tree and cfg.get("k") is None:  # the measured tree's depth
        k, k_source = m.tree.depth, _tagged(m_source, "tree")
        if m.k_star == 0 and (m.tree.speedup or 0.0) < 1.0:
            k, k_source = 0, _tagged(m_source, f"K* = 0, best tree {m.tree.speedup or 0.0:.2f}x")
    measured_k = batch_k(spec, batch_size, dtype, device) if batch_size > 1 else None
    if use_tree and b_tree is not None:  # the best tree measured at this batch size
        if cfg.get("k") is None:
            k, k_source = b_tree.depth, b_tree.source
        if cfg.get("tree_size") is None:
            tree_size = b_tree.nodes
    elif measured_k is not None and cfg.get("k") is None and not use_tree:
        k, k_source = measured_k
    elif batch_size > 1 and cfg.get("k") is None:  # said, since K* falls as batches grow
        k_source += " (batch one's; no batch record: scripts/bench_batch.py write=true)"
    size = _draft_vocab(cfg, pkg, m)
    return DraftSettings(k=k, k_source=k_source, tree=use_tree,
                         tree_size=int(tree_size if tree_size is not None else DEFAULT_TREE_SIZE),
                         tree_topk=int(cfg.get("tree_topk", 8)), draft_vocab=size,
                         tree_draw=check_tree_draw(cfg.get("tree_draw", "sample")),
                         options=options)


# ----------------------------------------------------------------------------- load and build
def load_draft(draft: str | Path, loaded_target: Any = None) -> Any:
    """A draft package, or an export made by ``scripts/export.py``, as a ``DraftPackage``.

    Args:
        draft: a package folder (``draftsmith.json``), an export folder (``manifest.json``
            with ``export_format``: hf / eagle / speculators / medusa), an EAGLE-3 checkpoint
            of another trainer (speculators, ModelOpt: :mod:`draftsmith.heads.peer_import`,
            an unsigned import with a warning), or a causal LM sharing the target's
            vocabulary, used off the shelf as a draft LM (``pkg:<key>`` or a model folder:
            :mod:`draftsmith.heads.foreign`).
        loaded_target: the ``LoadedTarget`` the draft must have been trained for.

    Raises:
        ValueError: the folder is neither a package nor an export.
    """
    from draftsmith.heads.exports import import_export
    from draftsmith.heads.foreign import is_model_source, model_as_draft
    from draftsmith.heads.package import PACKAGE_JSON, load_package
    from draftsmith.heads.peer_format import peer_format
    from draftsmith.heads.peer_import import peer_as_draft

    if peer_format(draft) is not None:  # another trainer's checkpoint, with a warning
        if loaded_target is None:
            raise ValueError(f"draft={draft} is another trainer's checkpoint: it is read against "
                             "a loaded target (its shapes and embedding are checked)")
        return peer_as_draft(draft, loaded_target)
    if loaded_target is not None and is_model_source(draft):  # off the shelf, with a warning
        return model_as_draft(draft, loaded_target)
    root = Path(str(draft)).expanduser()
    if (root / PACKAGE_JSON).is_file():
        return load_package(root, target=loaded_target)
    manifest = root / "manifest.json"
    if manifest.is_file() and "export_format" in json.loads(manifest.read_text()):
        return import_export(root, target=loaded_target)
    raise ValueError(f"draft={draft}: not a draft package (no {PACKAGE_JSON}) nor an export (no "
                     "manifest.json with export_format); pass a folder written by training or by "
                     "scripts/export.py, or draft=none / draft=lookup")


def draft_vocab_ids(size: int | None, pkg: Any, loaded_target: Any,
                    vocab_size: int) -> torch.Tensor | None:
    """The target ids a draft drafts over (None = all): the ``size`` most frequent ids of the
    package's ``token_frequency.json`` plus the target's EOS ids."""
    size = parse_draft_vocab(size, vocab_size)
    if size is None:
        return None
    eos = getattr(getattr(loaded_target.model, "generation_config", None), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return frequent_ids(package_token_counts(pkg.path, vocab_size), size, eos)


def proposer_class(family: Any) -> type:
    """The family's proposer class (``DraftFamily.proposer``, a dotted path)."""
    return load_object(family.proposer)


def build_proposer(pkg: Any, settings: DraftSettings, loaded_target: Any, vocab_size: int,
                   device: str = "cpu", dtype: str = "float32",
                   draft_kernels: str = "auto") -> Any:
    """The family's proposer for ``pkg`` drafting as ``settings`` say (module moved to
    ``device`` and ``dtype``). ``draft_kernels``: ``auto`` packs the draft's own linears for
    oneDNN where the target's are packed (and measured faster for the draft's largest one),
    ``default`` leaves them as they are."""
    scheme = ((getattr(pkg, "info", None) or {}).get("quantization") or {}).get("scheme")
    if scheme and torch.device(device).type != "cpu":
        raise ValueError(f"{pkg.path} is an {scheme} draft (scripts/quantize.py), measured on the "
                         f"CPU only, not on {device}: decode its source package there")
    kernels = getattr(loaded_target, "kernels", "default")
    if scheme in FP32_ONLY:  # dynamic int8 matmuls take float32 inputs
        module = pkg.module.eval()
    else:
        module = pkg.module.to(device=device, dtype=getattr(torch, dtype)).eval()
        if scheme == "int8" and torch.device(device).type == "cpu":
            used, why = int8_or_dense(module, kernels)
            if used == "dense":
                print(f"draft weights: int8 dequantized ({why})")
        pack_draft(module, loaded_target.model, draft_kernels,
                   shares_target=not pkg.family.hf_model)
    ids = draft_vocab_ids(settings.draft_vocab, pkg, loaded_target, vocab_size)
    return proposer_class(pkg.family).for_draft(module, pkg.head_config, vocab_size, settings, ids)
