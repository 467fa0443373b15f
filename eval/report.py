"""Aggregate a sweep directory into ``report.csv``, ``report.md`` and PNG plots.

Usage::

    python eval/report.py outputs/sweeps/NAME [gap_threshold=0.1] [plots=true]

The rows and their derived numbers (speedup against the sweep's plain job, K*, tau per category,
trained vs served, predicted speedup) come from :mod:`eval.report_rows`; this module renders
them: the job table as CSV (and the categories as a second CSV), ``report.md`` and the plots.
"""
from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftsmith.eval import CONF_DIR, plots
from draftsmith.eval.markdown import table, write_markdown
from draftsmith.eval.report_rows import (
    build_category_rows,
    build_rows,
    draft_name,
    is_tree,
    k_groups,
    load_jobs,
    predicted_speedup,
    read_draft_info,
)

CSV_COLUMNS = [
    "job", "label", "method", "draft", "draft_kind", "k", "tree_size", "schedule", "temperature",
    "prompts", "limit", "max_new_tokens", "dtype", "device", "n_samples", "tokens_generated",
    "target_forwards", "tau", "acceptance_rate", "tokens_per_s", "speedup", "speedup_vs_plain",
    "speedup_vs_hf_generate", "k_star", "alpha", "trained_alpha_hat", "trained_temperature",
    "gap_max", "gap_position", "gap_flag", "lossless", "file",
]


@dataclass
class Report:
    """Result of :func:`build_report`: the rows and the files written."""

    rows: list[dict]
    categories: list[dict]
    errors: list[dict]
    files: dict[str, Path]


def _fmt(v, nd: int = 3) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{nd}f}"
    if isinstance(v, list):
        return " ".join(_fmt(x, 2) for x in v)
    return str(v)


def write_csv(rows: list[dict], path: Path) -> Path:
    """Write the job table; list cells are space-separated numbers."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: (" ".join(str(x) for x in r[c]) if isinstance(r.get(c), list)
                            else r.get(c)) for c in CSV_COLUMNS})
    return path


def _headline(rows: list[dict]) -> list[dict]:
    """The K* row of every K group plus every job without K (plain, peers without K)."""
    return [r for r in rows if r["k_star"] or r["k"] in (None, 0)]


def report_markdown(rows: list[dict], cats: list[dict], errors: list[dict],
                    plot_files: dict[str, Path], gap_threshold: float,
                    sweep_dir: Path) -> list[str]:
    """``report.md``'s lines: job table, K*, trained vs served, categories, errors, plots."""
    lines = [f"# Sweep report: {sweep_dir}", "",
             f"{len(rows)} finished jobs, {len(errors)} failed.", "", "## Jobs", ""]
    cols = ["label", "tau", "acceptance_rate", "tokens_per_s", "speedup", "speedup_vs_plain",
            "speedup_vs_hf_generate", "k_star", "gap_flag", "job"]
    lines += table(["job" if c == "label" else c for c in cols[:-1]] + ["file id"],
                   [[r[c] for c in cols] for r in rows], _fmt)
    ks = [r for r in rows if r["k_star"]]
    if ks:
        lines += ["", "## Best K (K*) per checkpoint and temperature", ""]
        lines += table(["method", "checkpoint", "T", "K*", "speedup", "tokens/s"],
                       [[r["method"], draft_name(r["draft"]), r["temperature"], r["k"],
                         r["speedup"], r["tokens_per_s"]] for r in ks], _fmt)
    lines += _trained_vs_served_section(rows, gap_threshold)
    lines += _category_section(rows, cats)
    if errors:
        lines += ["", "## Failed jobs", ""]
        body = []
        for e in errors:
            err = e.get("error") or {}
            msg = str(err.get("message", "")).replace("|", "/").replace("\n", " ")[:200]
            body.append([e["file"], f"{err.get('type', '')}: {msg}"])
        lines += table(["file", "error"], body, _fmt)
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{k}]({p.name})" for k, p in plot_files.items()]
    return lines


def _trained_vs_served_section(rows: list[dict], gap_threshold: float) -> list[str]:
    tvs = [r for r in rows if r["trained_alpha_hat"] is not None]
    lines = ["", f"## Trained vs served (gap threshold {gap_threshold})", ""]
    if not tvs:
        return lines + [("No chain job ran a checkpoint with validation.json at its validation "
                         "temperature (or at T = 0, compared with validation top-1 agreement). "
                         "Tree jobs are not compared: their per-depth acceptance counts several "
                         "candidates.")]
    lines += table(["job", "T", "trained alpha_hat", "served alpha", "drafts reached",
                    "max gap", "at", "flag"],
                   [[r["label"], r["temperature"], r["trained_alpha_hat"], r["alpha"],
                     " ".join(map(str, r["reached"] or [])) or "-", r["gap_max"],
                     r["gap_position"], "**GAP**" if r["gap_flag"] else "ok"] for r in tvs],
                   _fmt)
    flagged = [r for r in tvs if r["gap_flag"]]
    if flagged:
        lines += ["", (f"**{len(flagged)} job(s) serve an acceptance more than {gap_threshold} "
                       "away from the training-time estimate, beyond two standard errors "
                       "of the drafts reached: a bug or a data shift.**")]
    return lines


def _category_section(rows: list[dict], cats: list[dict]) -> list[str]:
    by_job = defaultdict(dict)
    for c in cats:
        by_job[c["label"]][c["category"]] = c["tau"]
    shown = [r["label"] for r in _headline(rows) if r["label"] in by_job][:10]
    if not shown:
        return []
    cat_names = sorted({c for lab in shown for c in by_job[lab]})
    return ["", "## tau per category (K* jobs and jobs without K)", ""] + table(
        ["category"] + shown, [[c] + [by_job[lab].get(c) for lab in shown] for c in cat_names],
        _fmt)


def make_plots(rows: list[dict], cats: list[dict], out_dir: Path) -> dict[str, Path]:
    """Draw every plot the data allows; returns {name: path} of the PNGs written."""
    files: dict[str, Path] = {}
    groups = k_groups(rows)
    curves, series = [], []
    for group in groups.values():
        longest = max(group, key=lambda r: len(r["alpha"]))
        if longest["method"] != "spec":
            continue
        base = f"{draft_name(longest['draft'])} T={longest['temperature']}"
        trained = next((r["trained_alpha_hat"] for r in group if r["trained_alpha_hat"]), None)
        curves.append(plots.AcceptanceCurve(base, [float(a) for a in longest["alpha"]], trained))
        pts = [r for r in group if r["speedup"] is not None]
        if not pts:
            continue
        best = next((r["k"] for r in group if r["k_star"]), None)
        pred = {} if is_tree(longest) else predicted_speedup(
            read_draft_info(longest["draft"]).speculation,
            range(1, max(int(r["k"]) for r in group) + 1), longest["temperature"])
        series.append(plots.SpeedupSeries(f"{longest['method']} {base}", [int(r["k"]) for r in pts],
                                          [float(r["speedup"]) for r in pts], best,
                                          list(pred), list(pred.values())))
    if (p := plots.plot_acceptance(curves, out_dir / "acceptance.png")) is not None:
        files["acceptance"] = p
    if (p := plots.plot_speedup_vs_k(series, out_dir / "speedup_vs_k.png")) is not None:
        files["speedup_vs_k"] = p
    head = {r["label"] for r in _headline(rows)}
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for c in cats:
        if c["label"] in head:
            table[c["label"]][c["category"]] = c["tau"]
    if (p := plots.plot_tau_per_category(table, out_dir / "tau_per_category.png")) is not None:
        files["tau_per_category"] = p
    logs = {draft_name(d): read_draft_info(d).train_log
            for d in sorted({r["draft"] for r in rows if r["draft"]})}
    if (p := plots.plot_training_curves(logs, out_dir / "training_curves.png")) is not None:
        files["training_curves"] = p
    return files


def build_report(sweep_dir: str | Path, gap_threshold: float = 0.1,
                 make_figures: bool = True) -> Report:
    """Aggregate a sweep directory; writes report.csv, report_categories.csv, report.md, PNGs.

    Raises:
        FileNotFoundError: the directory does not exist.
        ValueError: ``gap_threshold`` is negative.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {sweep_dir} does not exist: pass the folder "
                                "that eval/sweep.py wrote (its sweep_dir=)")
    if gap_threshold < 0:
        raise ValueError(f"gap_threshold must be >= 0, got {gap_threshold}")
    jobs, errors = load_jobs(sweep_dir)
    rows = build_rows(jobs, gap_threshold)
    cats = build_category_rows(rows)
    files = {"csv": write_csv(rows, sweep_dir / "report.csv")}
    with (sweep_dir / "report_categories.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["job", "label", "category", "n", "tokens", "tau"])
        w.writeheader()
        w.writerows(cats)
    files["categories_csv"] = sweep_dir / "report_categories.csv"
    plot_files = make_plots(rows, cats, sweep_dir) if make_figures else {}
    files["markdown"] = write_markdown(sweep_dir / "report.md", report_markdown(
        rows, cats, errors, plot_files, gap_threshold, sweep_dir))
    files.update(plot_files)
    return Report(rows=rows, categories=cats, errors=errors, files=files)


def run(cfg: DictConfig) -> Report:
    """Build the report of ``cfg.sweep_dir`` (options: ``conf/eval/report.yaml``)."""
    rep = build_report(str(cfg.sweep_dir), float(cfg.gap_threshold),
                       str(cfg.plots).lower() in ("1", "true", "yes"))
    print(f"{len(rep.rows)} jobs, {len(rep.errors)} failed; wrote "
          + ", ".join(str(p) for p in rep.files.values()))
    return rep


@hydra.main(config_path=str(CONF_DIR), config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """CLI: ``python eval/report.py DIR [gap_threshold=0.1] [plots=false]`` (DIR: sweep_dir)."""
    run(cfg)


def cli() -> None:  # draftsmith-report or python eval/report.py: the DIR form, or overrides
    if len(sys.argv) > 1 and "=" not in sys.argv[1] and not sys.argv[1].startswith("-"):
        sys.argv[1] = "sweep_dir='" + sys.argv[1].replace("'", "\\'") + "'"  # the DIR form
    main()


if __name__ == "__main__":
    cli()
