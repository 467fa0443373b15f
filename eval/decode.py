"""Decode a prompt set with a draft package through the speculative decoder.

    python eval/decode.py draft=DIR prompts=humaneval limit=8 max_new_tokens=128 temperature=0 \
        out=run.json

``draft=`` takes a draft package or a folder written by ``scripts/export.py`` (hf / eagle /
speculators / medusa layouts); ``draft=none`` decodes plainly, ``draft=lookup`` uses prompt
lookup. ``k=null`` starts from the K* that ``eval/measure.py`` wrote into the package's
``speculation.json`` (else 4); the summary's ``k_source`` says which. Plain decoding of the same
prompts runs in the same process (``baseline=true``) and gives the ``speedup``. The JSON has a
``summary`` (the :class:`~eval.stats.DecodeStats` fields plus ``speedup``, ``k``, ``k_source``,
``draft_kind``, ``lossless``, ``device``, ``dtype``) and ``samples`` (one per prompt: ``id``,
``category``, ``prompt_ids``, ``output_ids``, ``output_text``, ``tau``, ...).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.dtype import resolve_dtype
from eval.decoder import SpeculativeDecoder
from eval.proposers import (
    DraftLMProposer,
    MedusaProposer,
    PlainProposer,
    PromptLookupProposer,
    Proposer,
    medusa_choices,
)
from eval.proposers_eagle import EagleProposer
from eval.stats import DecodeStats
from eval.target_model import Target
from heads.vocab import FULL, TOKEN_FREQUENCY, frequent_ids, package_token_counts

CONF_FILE = Path(__file__).resolve().parents[1] / "conf" / "decode.yaml"
NO_DRAFT = ("none", "null", "")
TREE_MODES = ("auto", "chain", "tree")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_K = 4  # draft length when neither k= nor a measured K* is given
DEFAULT_TREE_SIZE = 60  # dynamic-tree nodes when neither tree_size= nor a measured shape is given
DEFAULT_MEDUSA_BRANCHING = (4, 2, 2, 1)  # Medusa tree when neither medusa_branching= nor a measured one
VOCAB_FAMILIES = ("lm", "eagle")  # families that can draft over a frequent-token vocabulary


# ----------------------------------------------------------------------------- prompts
def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """One user turn through the chat template, with the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target's tokenizer has no chat template: prompts are chat turns "
                         "and need one (save the tokenizer with its chat_template)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prompt_records(prompts: str, tokenizer: Any, limit: int | None = None) -> list[dict]:
    """Prompts as ``{"id", "category", "prompt_ids"}`` dicts (also used by the sweep's peers).

    Args:
        prompts: ``humaneval`` | ``sharegpt`` | a FastChat ``question.jsonl`` path
            (see :func:`data.prompts.load_prompts`).
        tokenizer: the target's tokenizer (chat template included).
        limit: keep the first ``limit`` prompts.
    """
    from data.prompts import load_prompts

    if tokenizer is None:
        raise ValueError("the target has no tokenizer: prompts cannot be encoded")
    items = load_prompts(str(prompts), limit=None if limit is None else int(limit))
    return [{"id": p.id, "category": p.category, "prompt_ids": encode_prompt(tokenizer, p.turns[0])}
            for p in items]


# ----------------------------------------------------------------------------- drafts
def load_draft(draft: str | Path, loaded_target: Any = None) -> Any:
    """A draft package, or an export made by ``scripts/export.py``, as a ``DraftPackage``.

    Args:
        draft: a package folder (``draftsmith.json``) or an export folder (``manifest.json``
            with ``export_format``: hf / eagle / speculators / medusa).
        loaded_target: the ``LoadedTarget`` the draft must have been trained for.

    Raises:
        ValueError: the folder is neither a package nor an export.
    """
    from heads.package import PACKAGE_JSON, load_package

    root = Path(str(draft)).expanduser()
    if (root / PACKAGE_JSON).is_file():
        return load_package(root, target=loaded_target)
    manifest = root / "manifest.json"
    if manifest.is_file() and "export_format" in json.loads(manifest.read_text()):
        from scripts.export import import_export

        return import_export(root, target=loaded_target)
    raise ValueError(f"draft={draft}: not a draft package (no {PACKAGE_JSON}) nor an export (no "
                     "manifest.json with export_format); pass a folder written by training or by "
                     "scripts/export.py, or draft=none / draft=lookup")


def build_proposer(cfg: DictConfig, loaded_target: Any, vocab_size: int,
                   pkg: Any = None) -> tuple[Proposer, str]:
    """The proposer named by ``cfg.draft`` and its kind (``plain``, ``lookup``, ``lm``, ...).

    Args:
        cfg: the decode config (``draft``, ``tree``, ``medusa_branching``, ...).
        loaded_target: the ``LoadedTarget`` (identity checked against the draft).
        vocab_size: the target's vocabulary size.
        pkg: an already loaded ``DraftPackage`` (else loaded from ``cfg.draft``).
    """
    draft = str(cfg.draft) if cfg.draft is not None else "none"
    if draft.lower() in NO_DRAFT:
        return PlainProposer(), "plain"
    if draft == "lookup":
        return PromptLookupProposer(), "lookup"
    pkg = pkg if pkg is not None else load_draft(draft, loaded_target)
    module = pkg.module.to(device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval()
    tree = cfg.tree
    vocab_ids = draft_vocab_ids(cfg.get("draft_vocab"), pkg, loaded_target, vocab_size)
    if pkg.kind == "lm":  # auto = chain here; run() turns auto into tree when that measured faster
        size = cfg.tree_size if cfg.tree_size is not None else DEFAULT_TREE_SIZE
        prop = DraftLMProposer(module, vocab_size, tree=tree == "tree", topk=int(cfg.tree_topk),
                               total_tokens=int(size), vocab_ids=vocab_ids)
        return prop, prop.kind
    if pkg.kind == "medusa":
        if tree == "chain":  # one candidate per head: a chain through the tree verifier
            choices = medusa_choices([1] * int(pkg.head_config.num_heads))
        else:
            choices = medusa_choices(list(cfg.medusa_branching or DEFAULT_MEDUSA_BRANCHING))
        return MedusaProposer(module, vocab_size, choices), "medusa"
    if pkg.kind == "eagle":
        use_tree = tree in ("auto", "tree")
        size = cfg.tree_size if cfg.tree_size is not None else DEFAULT_TREE_SIZE
        prop = EagleProposer(module, vocab_size, tree=use_tree, topk=int(cfg.tree_topk),
                             total_tokens=int(size), vocab_ids=vocab_ids)
        return prop, prop.kind
    raise ValueError(f"unknown draft kind {pkg.kind!r} in {draft}")


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


def draft_vocab_ids(value: Any, pkg: Any, loaded_target: Any, vocab_size: int
                    ) -> torch.Tensor | None:
    """The target ids a draft drafts over for ``draft_vocab`` (None = all): the most frequent ids
    of the package's ``token_frequency.json`` plus the target's EOS ids."""
    size = parse_draft_vocab(value, vocab_size)
    if size is None:
        return None
    if pkg.kind not in VOCAB_FAMILIES:
        raise ValueError(f"draft_vocab={value} applies to {VOCAB_FAMILIES} drafts, not "
                         f"{pkg.kind}; use draft_vocab=full")
    eos = getattr(getattr(loaded_target.model, "generation_config", None), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return frequent_ids(package_token_counts(pkg.path, vocab_size), size, eos)


def resolve_k(k: Any, speculation: Mapping | None, dtype: str | None = None,
              device: str | None = None) -> tuple[int, str]:
    """The draft length to start from and where it came from.

    ``k`` given -> ``(k, "config")``; ``k`` null -> K* of ``speculation.json`` when it has one
    and was measured for this ``dtype`` and device type (``"speculation.json"``), else
    ``(DEFAULT_K, "default ...")`` with the reason: costs measured in another dtype or on another
    device say nothing about the best K here.
    """
    if k is not None:
        return int(k), "config"
    spec = speculation or {}
    k_star = spec.get("k_star")
    if not (isinstance(k_star, int) and not isinstance(k_star, bool) and k_star >= 0):
        return DEFAULT_K, "default"
    spec_dtype = spec.get("dtype")
    spec_device = str((spec.get("hardware") or {}).get("device", "cpu"))
    if dtype is not None and spec_dtype is not None and spec_dtype != dtype:
        return DEFAULT_K, f"default (K* in speculation.json is for {spec_dtype})"
    if device is not None and torch.device(spec_device).type != torch.device(device).type:
        return DEFAULT_K, f"default (K* in speculation.json is for {spec_device})"
    return k_star, "speculation.json"


def lm_tree_pays(speculation: Mapping | None, dtype: str | None = None,
                 device: str | None = None) -> bool:
    """Whether a draft LM's ``speculation.json`` (for this dtype and device type) has a measured
    dynamic-tree shape that decoded faster than the chain at K* (``tree=auto`` then drafts trees)."""
    spec = speculation or {}
    depth, _, _ = resolve_tree(None, None, spec, dtype, device)
    if depth is None:
        return False
    chain = (spec.get("measured_speedup") or {}).get("speedup")
    tree = spec["tree"].get("speedup")
    return tree is not None and (chain is None or tree > chain)


def chain_beat_tree(speculation: Mapping | None, dtype: str | None = None,
                    device: str | None = None) -> bool:
    """Whether ``speculation.json`` (for this dtype and device type) measured both the chain at
    K* and a dynamic tree, and the chain decoded faster (an EAGLE head's ``tree=auto`` then
    drafts chains)."""
    spec = speculation or {}
    depth, _, _ = resolve_tree(None, None, spec, dtype, device)
    chain = (spec.get("measured_speedup") or {}).get("speedup")
    return depth is not None and chain is not None and not lm_tree_pays(spec, dtype, device)


def resolve_tree(k: Any, tree_size: Any, speculation: Mapping | None, dtype: str | None = None,
                 device: str | None = None) -> tuple[int | None, int | None, str]:
    """Dynamic-tree depth and size: the measured best shape of ``speculation.json``.

    ``k`` / ``tree_size`` given are kept; a null one takes the measured shape when the record
    has one for this dtype and device type. Returns ``(depth or None, size or None, source)``;
    None leaves the chain rule (:func:`resolve_k`) and ``DEFAULT_TREE_SIZE`` in charge.
    """
    tree = (speculation or {}).get("tree")
    _, source = resolve_k(None, speculation, dtype, device)
    if not tree or source != "speculation.json":
        return (None if k is None else int(k)), (None if tree_size is None else int(tree_size)), "config"
    depth = int(tree["depth"]) if k is None else int(k)
    size = int(tree["total_tokens"]) if tree_size is None else int(tree_size)
    return depth, size, "speculation.json (tree)"


def resolve_medusa_branching(branching: Any, speculation: Mapping | None, dtype: str | None = None,
                             device: str | None = None) -> tuple[list[int], str]:
    """Medusa tree: ``branching`` when given, else the measured best of ``speculation.json``
    (for this dtype and device type), else :data:`DEFAULT_MEDUSA_BRANCHING`."""
    if branching is not None:
        return [int(b) for b in branching], "config"
    depth, _, _ = resolve_tree(None, None, speculation, dtype, device)
    measured = ((speculation or {}).get("tree") or {}).get("branching")
    if depth is not None and measured:
        return [int(b) for b in measured], "speculation.json (tree)"
    return list(DEFAULT_MEDUSA_BRANCHING), "default"


def resolve_draft_vocab(speculation: Mapping | None, dtype: str | None = None,
                        device: str | None = None) -> int | str:
    """The draft vocabulary measured fastest in ``speculation.json`` (for this dtype and device
    type): its size, or ``full`` when the whole vocabulary won or nothing was measured."""
    _, source = resolve_k(None, speculation, dtype, device)
    size = ((speculation or {}).get("draft_vocab") or {}).get("size")
    return int(size) if source == "speculation.json" and size else FULL


def resolve_defaults(cfg: DictConfig, pkg: Any) -> tuple[DictConfig, int, str]:
    """The draft length / tree depth to start from, its source, and ``cfg`` with the null tree
    settings filled from the package's ``speculation.json`` (for this dtype and device type).

    Chains start at K* (:func:`resolve_k`). Trees take the measured shape: the EAGLE and
    draft-LM dynamic tree (:func:`resolve_tree`; a draft LM's ``tree=auto`` becomes ``tree``
    where :func:`lm_tree_pays`, an EAGLE head's becomes ``chain`` where :func:`chain_beat_tree`),
    the Medusa branching (:func:`resolve_medusa_branching`). With
    K* = 0 and the best measured tree a loss too, the start is plain decoding (K = 0). A null
    ``draft_vocab`` takes the measured one (:func:`resolve_draft_vocab`).
    """
    spec = pkg.speculation if pkg is not None else None
    k, k_source = resolve_k(cfg.k, spec, cfg.dtype, cfg.device)
    if pkg is None:
        return cfg, k, k_source
    if pkg.kind == "lm" and cfg.tree == "auto" and lm_tree_pays(spec, cfg.dtype, cfg.device):
        cfg = OmegaConf.merge(cfg, {"tree": "tree"})
    if pkg.kind == "eagle" and cfg.tree == "auto" and chain_beat_tree(spec, cfg.dtype, cfg.device):
        cfg = OmegaConf.merge(cfg, {"tree": "chain"})
    if pkg.kind == "medusa" and cfg.tree in ("auto", "tree"):
        branching, source = resolve_medusa_branching(cfg.medusa_branching, spec, cfg.dtype,
                                                     cfg.device)
        cfg = OmegaConf.merge(cfg, {"medusa_branching": branching})
        if source != "default" and cfg.k is None:  # the measured tree's depth
            k, k_source = len(branching), source
    if (pkg.kind, cfg.tree) in (("eagle", "auto"), ("eagle", "tree"), ("lm", "tree")):
        depth, size, source = resolve_tree(cfg.k, cfg.tree_size, spec, cfg.dtype, cfg.device)
        cfg = OmegaConf.merge(cfg, {"tree_size": size})
        if depth is not None and cfg.k is None:  # the measured tree shape
            k, k_source = depth, source
    if pkg.kind in VOCAB_FAMILIES and cfg.get("draft_vocab") is None:
        size = resolve_draft_vocab(spec, cfg.dtype, cfg.device)
        if size != FULL and not (Path(pkg.path) / TOKEN_FREQUENCY).is_file():
            size = FULL  # measured, but the counts did not travel with this folder
        cfg = OmegaConf.merge(cfg, {"draft_vocab": size})
    tree_speedup = ((spec or {}).get("tree") or {}).get("speedup") or 0.0
    if k_source == "speculation.json (tree)" and spec.get("k_star") == 0 and tree_speedup < 1.0:
        k, k_source = 0, f"speculation.json (K* = 0, best tree {tree_speedup:.2f}x)"
    return cfg, k, k_source


def _validate(cfg: DictConfig) -> None:
    if cfg.tree not in TREE_MODES:
        raise ValueError(f"tree={cfg.tree!r}: allowed {TREE_MODES}")
    if cfg.dtype not in (*DTYPES, "auto"):
        raise ValueError(f"dtype={cfg.dtype!r}: allowed {(*DTYPES, 'auto')}")
    if int(cfg.max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.limit is not None and int(cfg.limit) < 1:
        raise ValueError(f"limit must be >= 1 or null, got {cfg.limit}")
    parse_draft_vocab(cfg.get("draft_vocab"))
    if cfg.k is not None and int(cfg.k) < 0:
        raise ValueError(f"k must be >= 0 or null (K* from speculation.json), got {cfg.k}")


def decode_set(dec: SpeculativeDecoder, records: Sequence[dict], cfg: DictConfig,
               eos: Any) -> tuple[list[dict], DecodeStats]:
    """Decode every record (seed ``cfg.seed + index``); per-sample dicts and merged stats."""
    samples, parts = [], []
    for i, rec in enumerate(records):
        res = dec.generate(rec["prompt_ids"], int(cfg.max_new_tokens), float(cfg.temperature),
                           int(cfg.top_k), float(cfg.top_p), eos_token_id=eos,
                           time_budget_s=cfg.time_budget_s, seed=int(cfg.seed) + i)
        parts.append(res.stats)
        samples.append({**rec, "output_ids": res.output_ids, "tau": res.stats.tau,
                        "target_forwards": res.stats.target_forwards,
                        "wall_time_s": res.stats.wall_time_s})
    return samples, DecodeStats.merge(parts)


def run(cfg: DictConfig, loaded: Any = None) -> dict:
    """Decode the prompt set; returns the JSON dict (also written to ``cfg.out``).

    Args:
        cfg: the decode config (``conf/decode.yaml`` keys).
        loaded: an already loaded ``LoadedTarget`` (else loaded from ``cfg.target_path``).
    """
    from data.target import load_target

    _validate(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    cfg.dtype = resolve_dtype(cfg.dtype, str(cfg.device))  # auto: the faster one measured here
    dtype = getattr(torch, cfg.dtype)
    if loaded is None:
        loaded = load_target(cfg.target_path or cfg.target or None, dtype=dtype)
    model = loaded.model.to(cfg.device).eval()
    tok = loaded.tokenizer
    records = prompt_records(cfg.prompts, tok, cfg.limit)
    if not records:
        raise ValueError(f"no prompts loaded from prompts={cfg.prompts!r} (limit={cfg.limit})")
    draft = str(cfg.draft) if cfg.draft is not None else "none"
    pkg = None
    if draft.lower() not in NO_DRAFT and draft != "lookup":
        pkg = load_draft(draft, loaded)
    cfg, k, k_source = resolve_defaults(cfg, pkg)
    proposer, kind = build_proposer(cfg, loaded, int(model.config.vocab_size), pkg)
    target = Target(model, proposer.layer_ids)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if kind == "plain":
        k, k_source = 0, "plain"
    dec = SpeculativeDecoder(target, proposer, k=k, k_max=cfg.k_max, adaptive=bool(cfg.adaptive_k),
                             fallback=bool(cfg.fallback), acceptance=cfg.acceptance)
    dec.generate(records[0]["prompt_ids"], 2, seed=0)  # warm-up (allocations, kernels)
    samples, stats = decode_set(dec, records, cfg, eos)
    base_tps = stats.tokens_per_s if kind == "plain" else None
    matches = None
    if cfg.baseline and kind != "plain":
        plain = SpeculativeDecoder(Target(model), PlainProposer(), k=0)
        base_samples, base = decode_set(plain, records, cfg, eos)
        base_tps = base.tokens_per_s
        if float(cfg.temperature) == 0.0:  # greedy: lossless means token-identical to plain
            same = [a["output_ids"] == b["output_ids"] for a, b in zip(samples, base_samples)]
            matches = sum(same) / len(same)
    for s in samples:
        s["output_text"] = tok.decode(s["output_ids"], skip_special_tokens=True)
    summary = {**stats.to_dict(),
               "speedup": stats.tokens_per_s / base_tps if base_tps else None,
               "baseline_tokens_per_s": base_tps, "matches_baseline": matches,
               "k": k, "k_source": k_source,
               "tree_size": (getattr(proposer, "total_tokens", None)
                             if getattr(proposer, "tree", False) else None),
               "draft_vocab": getattr(proposer, "draft_vocab", None),
               "draft_kind": kind,
               "draft": None if kind == "plain" else str(cfg.draft), "lossless": dec.lossless,
               "device": str(target.device), "dtype": cfg.dtype,
               "temperature": float(cfg.temperature), "top_k": int(cfg.top_k),
               "top_p": float(cfg.top_p), "prompts": str(cfg.prompts), "limit": cfg.limit,
               "max_new_tokens": int(cfg.max_new_tokens), "n_samples": len(samples)}
    result = {"summary": summary, "samples": samples}
    if cfg.out:
        out = Path(str(cfg.out)).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


def print_summary(summary: Mapping[str, Any]) -> None:
    """A short rich table of the headline numbers."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"draft={summary.get('draft') or 'none'} ({summary['draft_kind']})")
    for col in ("k (source)", "tokens", "tau", "accept", "tok/s", "speedup", "lossless"):
        table.add_column(col, justify="right")
    sp = summary.get("speedup")
    table.add_row(f"{summary['k']} ({summary.get('k_source', '-')})", str(summary["tokens_generated"]), f"{summary['tau']:.2f}",
                  f"{summary['acceptance_rate']:.2f}", f"{summary['tokens_per_s']:.1f}",
                  "-" if sp is None else f"{sp:.2f}x", str(summary["lossless"]))
    Console().print(table)


def _register_config() -> str:
    """Register conf/decode.yaml alone: conf/ also holds the training groups (conf/draft/...),
    which would turn ``draft=DIR`` into a group override."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="draftsmith_decode", node=OmegaConf.load(CONF_FILE))
    return "draftsmith_decode"


def run_overrides(overrides: list[str]) -> dict:
    """Run with Hydra override strings in-process (used by sweeps)."""
    from hydra import compose, initialize

    name = _register_config()
    with initialize(config_path=None, version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides))
    return run(cfg)


def _main(cfg: DictConfig) -> None:
    result = run(cfg)
    print_summary(result["summary"])


def main() -> None:
    hydra.main(config_path=None, config_name=_register_config(), version_base="1.3")(_main)()


if __name__ == "__main__":
    main()
