"""Measure a draft package on this machine, choose K* and write ``speculation.json`` into it.

    python eval/measure.py draft=DIR prompts=sharegpt limit=8 max_new_tokens=64 temperature=0

Steps: (1) decode the prompts at a long fixed draft length ``k_measure`` (no adaptation, no
fallback) so that the conditional acceptance ``alpha_i`` of every position is observed; (2) time
on this machine, as medians, one plain decode step ``t_ar``, the draft's cost per drafted token
``t_draft`` and the target forward over ``K + 1`` tokens ``t_verify(K)`` (and over the tree the
draft family decodes with: the dynamic tree's ``tree_sizes`` nodes, or the Medusa trees);
(3) choose K* with :func:`eval.kstar.choose_kstar`; (4) decode the prompts again at K* and plainly,
in this run, for the measured speedup; (4b) for EAGLE and draft-LM packages, decode the prompts
with the dynamic tree at every (depth, size) of ``tree_depths`` x ``tree_sizes`` (Medusa: each
static tree of ``medusa_branchings``) and keep the fastest shape (the tree analogue of K*: how
many nodes pay depends on how the target's forward cost grows with width on this machine); (5)
write the record with :func:`heads.package.update_package_json` (the manifest stays valid),
beside the records measured at other temperatures (``temperature=1`` adds the sampling record
and keeps the greedy one). ``eval/decode.py`` with ``k=null`` then starts from the K* and tree
measured at the temperature nearest its own.

Chains are measured for every family (Medusa: the top-1 candidate of each head), since
per-position acceptance needs exactly one draft per position.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.dtype import resolve_dtype
from draftsmith.data.prompts import check_prompt_set
from draftsmith.eval import CONF_DIR, session
from draftsmith.eval.checks import check_noise_tolerance, check_sampling, integer
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.target_model import Target
from draftsmith.eval.draft import build_proposer, load_draft, merge_record, settle
from draftsmith.eval.kstar import measure_speculation
from draftsmith.heads.family import FAMILIES
from draftsmith.heads.foreign import is_model_source
from draftsmith.heads.package import PACKAGE_JSON


def _validate(cfg: DictConfig) -> None:
    if cfg.draft is None or str(cfg.draft).lower() in ("none", "null", "", "lookup"):
        raise ValueError("measure.py needs draft=DIR of a draft package (K* is a property of a "
                         "trained draft)")
    foreign = is_model_source(cfg.draft)  # a model drafting off the shelf: record to out= only
    if foreign and (cfg.write or not cfg.get("out")):
        raise ValueError(f"draft={cfg.draft} is not a draft package: there is no "
                         "speculation.json to write the record into; pass write=false "
                         "out=FILE to keep it")
    if not foreign and not (Path(str(cfg.draft)) / PACKAGE_JSON).is_file():
        raise ValueError(f"draft={cfg.draft} is not a draft package (no {PACKAGE_JSON}); K* is "
                         "written into packages, so measure the package an export came from")
    if int(cfg.k_measure) < 1:
        raise ValueError(f"k_measure must be >= 1, got {cfg.k_measure}")
    bad = [int(v) for v in list(cfg.tree_depths) + list(cfg.tree_sizes) if int(v) < 1]
    if bad:
        raise ValueError(f"tree_depths and tree_sizes take values >= 1, got {bad}; pass "
                         "tree_sizes=[] to skip the tree-shape search")
    for family in FAMILIES.values():  # the families' own keys (Medusa's medusa_branchings)
        family.check_measure_options(cfg)
    bad = [v for v in cfg.draft_vocab_sizes
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ValueError(f"draft_vocab_sizes takes ids counts >= 1, got {bad}; pass "
                         "draft_vocab_sizes=[] to skip the draft-vocabulary search")
    if int(cfg.repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {cfg.repeats}")
    if cfg.dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ValueError(f"dtype={cfg.dtype!r}: allowed float32, bfloat16, float16, auto")
    if integer("max_new_tokens", cfg.max_new_tokens, "an integer >= 1") < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.limit is not None and integer("limit", cfg.limit, "an integer >= 1 or null") < 1:
        raise ValueError(f"limit must be >= 1 or null, got {cfg.limit}")
    check_noise_tolerance(cfg.get("noise_tolerance"))
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    check_prompt_set(cfg.prompts)


def proposer_for(cfg: DictConfig, overrides: dict, loaded: Any, pkg: Any) -> Proposer:
    """The package's proposer drafting exactly as ``cfg`` merged with ``overrides`` says
    (``speculation.json`` is what is being measured, so it is not read)."""
    plan = settle(OmegaConf.merge(cfg, overrides), pkg, measured=False)
    return build_proposer(pkg, plan, loaded, int(loaded.model.config.vocab_size), cfg.device,
                          cfg.dtype)


def tree_shapes(pkg: Any, cfg: DictConfig) -> list[dict[str, Any]]:
    """The tree shapes measure.py decodes ``pkg`` with (``DraftFamily.tree_shapes``: the dynamic
    tree's (depth, size) grid, Medusa's static trees, none for chains only), smallest first."""
    shapes = pkg.family.tree_shapes(cfg, pkg.head_config)
    return sorted(shapes, key=lambda sh: (sh["total_tokens"], sh["depth"]))


def rerun_at_kstar(model: torch.nn.Module, proposer: Any, records: list[dict], cfg: DictConfig,
                   k_star: int, eos: Any) -> dict[str, Any]:
    """Decode at fixed K* and plainly on the same prompts, interleaved per prompt
    (:func:`eval.session.paired`); the measured speedup record: ``speedup`` is the median of the
    per-prompt ratios, ``speedup_spread`` their min and max, ``noisy`` whether the machine's
    speed changed under the prompts (``tokens_per_s`` / ``baseline_tokens_per_s`` are totals)."""
    if k_star == 0:
        return {"k": 0, "speedup": None,
                "note": "K* = 0: plain decoding is fastest with this draft on this machine"}
    dec = session.decoder(model, proposer, records, k=k_star, adaptive=False, fallback=False)
    tolerance = float(cfg.get("noise_tolerance", session.NOISE_TOLERANCE))
    res = session.paired(dec, model, records, session.Sampling.from_config(cfg), eos,
                         noise_tolerance=tolerance)
    spec, base, spread = res.stats, res.baseline_tokens_per_s, res.speedup_spread
    return {"k": k_star, "tokens_per_s": spec.tokens_per_s,
            "baseline_tokens_per_s": base, "speedup": res.speedup,
            "speedup_spread": list(spread) if spread else None, "noisy": res.noisy,
            "noise_tolerance": tolerance,
            "tau": spec.tau, "acceptance_rate": spec.acceptance_rate,
            "tokens": spec.tokens_generated, "prompts": len(records),
            "temperature": float(cfg.temperature), "max_new_tokens": int(cfg.max_new_tokens)}


def decode_grid(model: torch.nn.Module, loaded: Any, pkg: Any, records: list[dict],
                cfg: DictConfig, eos: Any, runs: list[tuple[dict, dict, int]]
                ) -> tuple[list[dict], list[float], list[tuple[Any, Any]]]:
    """Decode ``records`` once per run ``(row, overrides, k)`` (``cfg`` merged with
    ``overrides``, fixed ``k``, no adaptation or fallback), interleaved per prompt with plain
    decoding before and after it (:func:`eval.session.paired_many`): a run's speedup is the
    median over prompts of its tokens/s over the mean of the prompt's two plain runs.

    Returns:
        The rows with ``tokens_per_s``, ``tau``, ``acceptance_rate``, ``speedup`` (and its
        spread) and ``noisy`` added, ``[first, second]`` plain tokens/s over all prompts, and each
        run's ``(DecodeStats, proposer)``.
    """
    sampling = session.Sampling.from_config(cfg)
    proposers = [proposer_for(cfg, overrides, loaded, pkg) for _, overrides, _ in runs]
    decs = [session.decoder(model, p, records, k=k, adaptive=False, fallback=False)
            for p, (_, _, k) in zip(proposers, runs)]
    results = session.paired_many(decs, model, records, sampling, eos,
                                  float(cfg.get("noise_tolerance", session.NOISE_TOLERANCE)))
    grid = [{**row, "tokens_per_s": r.stats.tokens_per_s, "tau": r.stats.tau,
             "acceptance_rate": r.stats.acceptance_rate, "speedup": r.speedup,
             "speedup_spread": r.speedup_spread, "noisy": r.noisy}
            for (row, _, _), r in zip(runs, results)]
    before_after = [_plain_tps(results[0].samples, j) for j in (0, 1)] if results else []
    return grid, before_after, [(r.stats, p) for r, p in zip(results, proposers)]


def _plain_tps(samples: list[dict], which: int) -> float:
    """Plain tokens/s over every prompt's first (0) or second (1) plain run."""
    wall = sum(s["plain_wall_time_s"][which] for s in samples)
    return sum(s["plain_tokens"][which] for s in samples) / wall if wall > 0 else 0.0


def measure_tree(model: torch.nn.Module, loaded: Any, pkg: Any, records: list[dict],
                 cfg: DictConfig, eos: Any) -> dict[str, Any] | None:
    """Decode with each tree shape of :func:`tree_shapes` (:func:`decode_grid`); the fastest
    shape and the grid."""
    shapes = tree_shapes(pkg, cfg)
    if not shapes:
        return None
    grid, before_after, _ = decode_grid(
        model, loaded, pkg, records, cfg, eos,
        [({k: v for k, v in sh.items() if k != "overrides"}, sh["overrides"], sh["depth"])
         for sh in shapes])
    best = max(grid, key=lambda g: g["tokens_per_s"])
    return {**{k: v for k, v in best.items() if k in ("depth", "total_tokens", "branching")},
            "speedup": best["speedup"], "tau": best["tau"],
            "baseline_tokens_per_s": sum(before_after) / 2,
            "baseline_before_after": before_after, "grid": grid,
            "topk": int(cfg.tree_topk), "prompts": len(records),
            "temperature": float(cfg.temperature), "max_new_tokens": int(cfg.max_new_tokens)}


def measure_draft_vocab(model: torch.nn.Module, loaded: Any, pkg: Any, records: list[dict],
                        cfg: DictConfig, eos: Any, rec: dict[str, Any]) -> dict[str, Any] | None:
    """Decode with the drafting ``rec`` makes the default (decode.py's defaults for this record,
    without adaptation or fallback) over each of ``draft_vocab_sizes`` most frequent ids and over
    the whole vocabulary (:func:`decode_grid`); the fastest and the grid (None: nothing to
    measure).

    The draft's vocabulary trades draft time (LM-head rows) against acceptance (targets outside
    the subset can never be drafted), so it is measured like K*; it is chosen after K* and the
    tree shape.
    """
    from dataclasses import replace

    from draftsmith.heads.vocab import TOKEN_FREQUENCY

    vocab = int(model.config.vocab_size)
    own = getattr(pkg.module, "d2t", None) if getattr(pkg.module, "reduced", False) else None
    if own is not None:  # a reduced head: subsets of its own draft vocabulary
        vocab = int(own.numel())
    sizes = sorted({int(n) for n in cfg.draft_vocab_sizes if int(n) < vocab})
    if (not pkg.family.draft_vocab or not sizes
            or not (pkg.path / TOKEN_FREQUENCY).is_file()):
        return None
    base_cfg = OmegaConf.merge(cfg, {"k": None, "draft_vocab": "full"})
    plan = settle(base_cfg, replace(pkg, speculation=rec))
    k = plan.k
    shape_cfg = OmegaConf.merge(cfg, {"tree": "tree" if plan.tree else "chain",
                                      "tree_size": plan.tree_size})
    if k == 0:  # plain decoding is the default: measure the best tree (or chain K = 1) instead
        tree = rec.get("tree") or {}
        k = int(tree.get("depth") or 1)
        shape_cfg = OmegaConf.merge(shape_cfg, {"tree": "tree" if tree else "chain",
                                                "tree_size": tree.get("total_tokens")})
    grid, before_after, runs = decode_grid(
        model, loaded, pkg, records, shape_cfg, eos,
        [({"size": size}, {"draft_vocab": size or "full"}, k) for size in [None] + sizes])
    for g, (st, _) in zip(grid, runs):
        g["draft_ms_per_step"] = 1e3 * st.draft_time_s / max(st.spec_steps, 1)
    proposer = runs[-1][1]
    best = max(grid, key=lambda g: g["tokens_per_s"])
    return {"size": best["size"], "speedup": best["speedup"], "tau": best["tau"],
            "drafting": {"kind": proposer.name, "k": k,
                         "tree_size": proposer.total_tokens if getattr(proposer, "tree", False)
                         else None},
            "baseline_tokens_per_s": sum(before_after) / 2, "baseline_before_after": before_after,
            "grid": grid, "prompts": len(records), "temperature": float(cfg.temperature),
            "max_new_tokens": int(cfg.max_new_tokens)}


def run(cfg: DictConfig, loaded: Any = None) -> dict[str, Any]:
    """Measure ``cfg.draft`` and (``write=true``) store the record as its ``speculation.json``.

    Args:
        cfg: the ``conf/eval/measure.yaml`` keys (``decode.yaml``'s plus the measuring ones).
        loaded: an already loaded ``LoadedTarget`` (else loaded from ``cfg.target_path``).

    Returns:
        The ``speculation.json`` dict (see :func:`eval.kstar.measure_speculation`) with
        ``measured_speedup``, ``draft_kind``, ``prompts`` and ``command`` added.
    """
    from draftsmith.heads.package import update_package_json

    _validate(cfg)
    cfg.dtype = resolve_dtype(cfg.dtype, str(cfg.device))  # auto: the faster one measured here
    loaded = session.open_target(cfg, loaded)
    model = loaded.model
    records = session.prompt_records(cfg.prompts, loaded.tokenizer, cfg.limit)
    pkg = load_draft(cfg.draft, loaded)
    proposer = proposer_for(cfg, {"tree": "chain"}, loaded, pkg)
    k_max = int(cfg.k_measure)
    longest = pkg.family.max_draft_length(pkg.head_config)  # Medusa: one position per head
    if longest is not None:
        k_max = min(k_max, longest)
    target = Target(model, proposer.layer_ids)
    rec = measure_speculation(target, proposer, [r["prompt_ids"] for r in records], k_max=k_max,
                              max_new_tokens=int(cfg.max_new_tokens),
                              temperature=float(cfg.temperature), repeats=int(cfg.repeats),
                              seed=int(cfg.seed),
                              tree_nodes=sorted({sh["total_tokens"] for sh in
                                                 tree_shapes(pkg, cfg)}),
                              min_reached=int(cfg.min_reached))
    eos = session.eos_ids(model)
    if cfg.rerun:
        rec["measured_speedup"] = rerun_at_kstar(model, proposer, records, cfg, rec["k_star"], eos)
    tree = measure_tree(model, loaded, pkg, records, cfg, eos)
    if tree is not None:
        rec["tree"] = tree
    vocab_rec = measure_draft_vocab(model, loaded, pkg, records, cfg, eos, rec)
    if vocab_rec is not None:
        rec["draft_vocab"] = vocab_rec
    rec.update(draft_kind=pkg.family.name, prompts=str(cfg.prompts), limit=cfg.limit,
               command="python eval/measure.py " + " ".join(sys.argv[1:]))
    if cfg.write:  # beside the records of other temperatures (eval.draft.merge_record)
        update_package_json(pkg.path, "speculation.json", merge_record(pkg.speculation, rec))
    if cfg.get("out"):
        out = Path(str(cfg.out)).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rec, indent=1))
    return rec


def print_record(rec: dict[str, Any]) -> None:
    """K*, the expected speedup per K and the measured one."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"K* = {rec['k_star']} ({rec['draft_kind']}, {rec['hardware']['device']}, "
                        f"{rec['dtype']})")
    for col in ("K", "alpha_K", "t_verify(K) ms", "expected speedup"):
        table.add_column(col, justify="right")
    for k, sp in rec["expected_speedup"].items():
        a = rec["alpha"][int(k) - 1] if int(k) > 0 else None
        table.add_row(k, "-" if a is None else f"{a:.2f}",
                      f"{rec['costs']['t_verify'][k] * 1e3:.1f}", f"{sp:.2f}x")
    console = Console()
    console.print(table)
    m = rec.get("measured_speedup") or {}
    if m.get("speedup") is not None:
        console.print(f"measured at K*={m['k']}: {m['speedup']:.2f}x "
                      f"({m['tokens_per_s']:.1f} vs {m['baseline_tokens_per_s']:.1f} tokens/s)")
    tree = rec.get("tree")
    if tree:
        shape = (f"branching {tree['branching']}" if "branching" in tree
                 else f"depth {tree['depth']}")
        grid = Table(title=f"tree shapes: best {shape}, {tree['total_tokens']} nodes")
        for col in ("shape", "nodes", "tau", "tokens/s", "speedup"):
            grid.add_column(col, justify="right")
        for g in tree["grid"]:
            grid.add_row(str(g.get("branching", f"depth {g['depth']}")), str(g["total_tokens"]),
                         f"{g['tau']:.2f}", f"{g['tokens_per_s']:.1f}", f"{g['speedup']:.2f}x")
        console.print(grid)
        console.print(f"plain decoding before / after the grid: "
                      f"{tree['baseline_before_after'][0]:.1f} / "
                      f"{tree['baseline_before_after'][1]:.1f} tokens/s")
    dv = rec.get("draft_vocab")
    if dv:
        d = dv["drafting"]
        grid = Table(title=f"draft vocabulary ({d['kind']}, K = {d['k']}): best "
                           f"{dv['size'] or 'full'}")
        for col in ("ids", "tau", "draft ms / step", "tokens/s", "speedup"):
            grid.add_column(col, justify="right")
        for g in dv["grid"]:
            grid.add_row(str(g["size"] or "full"), f"{g['tau']:.2f}",
                         f"{g['draft_ms_per_step']:.1f}", f"{g['tokens_per_s']:.1f}",
                         f"{g['speedup']:.2f}x")
        console.print(grid)


def run_overrides(overrides: list[str], loaded: Any = None) -> dict[str, Any]:
    """Run with Hydra override strings in-process (tests, benchmarks)."""
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose(config_name="measure", overrides=list(overrides))
    return run(cfg, loaded)


@hydra.main(config_path=str(CONF_DIR), config_name="measure", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: measure, write speculation.json, then print K* and the tables."""
    print_record(run(cfg))


if __name__ == "__main__":
    main()
