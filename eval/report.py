"""Aggregate a sweep directory into ``report.csv``, ``report.md`` and PNG plots.

Usage::

    python eval/report.py outputs/sweeps/NAME [gap_threshold=0.1] [plots=true]

Every ``*.json`` at the top of the directory that holds ``summary`` and ``samples`` is one
job (written by ``eval/sweep.py`` with a ``job`` block, or straight by ``eval/decode.py``);
``*.error.json`` files are failed jobs. Derived numbers:

- ``speedup``: as the job measured it (against plain decoding in the same run).
- ``speedup_vs_plain``: tokens/s over the tokens/s of the sweep's own plain job
  (``draft=none``) on the same prompts, limit, length, temperature, dtype and device.
- ``k_star``: within a group of jobs that differ only in K, the K with the highest
  ``speedup`` (``tokens_per_s`` when a job has no speedup); ties go to the smaller K.
- per-category tau: sum of output tokens over the sum of target forwards, where a
  sample's forwards are its tokens over its tau (the definition of the overall tau).
- trained vs served: the draft package's ``validation.json`` ``alpha_hat`` next to the
  served conditional ``alpha`` of jobs at the same temperature (at T = 0: validation's top-1
  agreement, the greedy acceptance probability); ``gap_flag``: some ``|alpha_hat_i - alpha_i|``
  exceeds ``gap_threshold`` and two binomial standard errors of the drafts reached there.
- predicted speedup (chain groups): the cost model of :mod:`eval.decoding.cost` on the alpha and
  costs of the draft package's ``speculation.json``, i.e. the expected speedups ``eval/measure.py``
  printed; only for groups at the temperature it was measured at.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftsmith.eval import CONF_DIR, plots
from draftsmith.eval.decoding.cost import expected_speedups, parse_costs

CSV_COLUMNS = [
    "job", "label", "method", "draft", "draft_kind", "k", "tree_size", "schedule", "temperature",
    "prompts", "limit", "max_new_tokens", "dtype", "device", "n_samples", "tokens_generated",
    "target_forwards", "tau", "acceptance_rate", "tokens_per_s", "speedup", "speedup_vs_plain",
    "speedup_vs_hf_generate", "k_star", "alpha", "trained_alpha_hat", "trained_temperature",
    "gap_max", "gap_position", "gap_flag", "lossless", "file",
]
# Settings that must match for two jobs to be the same experiment apart from K.
GROUP_KEYS = ("method", "draft", "temperature", "prompts", "limit", "max_new_tokens", "dtype",
              "device", "tree_size", "schedule")
PLAIN_KEYS = ("prompts", "limit", "max_new_tokens", "temperature", "dtype", "device")


@dataclass
class DraftInfo:
    """What a draft package folder tells the report (all optional)."""

    validation: dict | None = None
    speculation: dict | None = None
    train_log: list[dict] = field(default_factory=list)


@dataclass
class Report:
    """Result of :func:`build_report`: the rows and the files written."""

    rows: list[dict]
    categories: list[dict]
    errors: list[dict]
    files: dict[str, Path]


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def load_jobs(sweep_dir: Path) -> tuple[list[dict], list[dict]]:
    """Read finished and failed jobs of a sweep directory.

    Returns:
        (jobs, errors): jobs are dicts with ``file``, ``job`` (settings block, may be empty),
        ``summary``, ``samples``; errors are the ``*.error.json`` contents plus ``file``.
    """
    jobs, errors = [], []
    for path in sorted(sweep_dir.glob("*.json")):
        if path.name.startswith("report"):
            continue
        obj = _read_json(path)
        if obj is None:
            continue
        if path.name.endswith(".error.json"):
            errors.append({**obj, "file": path.name})
        elif isinstance(obj.get("summary"), dict) and isinstance(obj.get("samples"), list):
            jobs.append({"file": path.name, "job": obj.get("job") or {}, "summary": obj["summary"],
                         "samples": obj["samples"]})
    return jobs, errors


def read_draft_info(draft: str | None) -> DraftInfo:
    """Read ``validation.json``, ``speculation.json`` and ``train_log.jsonl`` of a package."""
    info, d = DraftInfo(), Path(draft or ".")
    if not draft or not d.is_dir():
        return info
    info.validation = _read_json(d / "validation.json")
    info.speculation = _read_json(d / "speculation.json")
    log = d / "train_log.jsonl"
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                info.train_log.append(rec)
    packaged = _read_json(d / "train_log.json")  # what training stores in the package
    if not info.train_log and isinstance(packaged, dict):
        info.train_log = [r for r in packaged.get("records", []) if isinstance(r, dict)]
    return info


def draft_name(draft: str | None) -> str:
    """Short display name: ``none``/``prompt_lookup`` as is, a path as ``parent/name``."""
    if not draft:
        return "-"
    p = Path(str(draft))
    if len(p.parts) <= 1:
        return str(draft)
    return f"{p.parent.name}/{p.name}"


def _setting(job: dict, key: str):
    """A job setting from the sweep's ``job.settings`` block, falling back to the summary."""
    settings = job["job"].get("settings") or {}
    if key in settings:
        return settings[key]
    return job["summary"].get(key)


def predicted_speedup(speculation: Mapping | None, ks: Sequence[int],
                      temperature: float | None = None) -> dict[int, float]:
    """Expected speedup per K of ``ks`` from a ``speculation.json``'s ``alpha`` and ``costs`` (what
    ``eval/measure.py`` printed); empty without them or when it measured another temperature."""
    spec = speculation or {}
    costs, alpha = parse_costs(spec.get("costs") or {}), spec.get("alpha")
    measured_t = (spec.get("measured") or {}).get("temperature")
    other_t = None not in (temperature, measured_t) and not math.isclose(
        float(temperature), float(measured_t), abs_tol=1e-6)
    if costs is None or not alpha or other_t:
        return {}
    return expected_speedups(alpha, costs, ks)


def category_tau(samples: Sequence[Mapping]) -> dict[str, dict]:
    """Per category: n samples, tokens, tau = sum(tokens) / sum(tokens / tau_sample)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for s in samples:
        cat, tau = s.get("category"), s.get("tau")
        if cat is None or not tau:
            continue
        n_tok = len(s.get("output_ids") or [])
        a = acc[str(cat)]
        a[0] += 1
        a[1] += n_tok
        a[2] += n_tok / tau
    return {c: {"n": int(a[0]), "tokens": int(a[1]), "tau": a[1] / a[2] if a[2] else float("nan")}
            for c, a in sorted(acc.items())}


def _label(row: dict) -> str:
    method = row["method"] or "spec"
    if method == "spec":
        if row["draft"] in (None, "none"):
            head = "plain"
        elif row["draft"] in ("lookup", "prompt_lookup"):
            head = "lookup"
        else:
            head = f"{row['draft_kind'] or 'spec'}:{draft_name(row['draft'])}"
    else:
        head = method + ("" if row["draft"] in (None, "none") else ":" + draft_name(row["draft"]))
        if row.get("schedule"):
            head += f"({row['schedule']})"
    k = f" K={row['k']}" if row["k"] not in (None, 0) else ""
    return f"{head}{k} T={row['temperature']}"


def build_rows(jobs: list[dict], gap_threshold: float = 0.1) -> list[dict]:
    """One row per job with derived columns (see the module docstring)."""
    rows = []
    for j in jobs:
        s = j["summary"]
        row = {key: _setting(j, key) for key in
               ("method", "draft", "k", "tree_size", "schedule", "temperature", "prompts",
                "limit", "max_new_tokens", "dtype", "device")}
        row["method"] = row["method"] or "spec"
        row.update(job=j["job"].get("id") or Path(j["file"]).stem, file=j["file"],
                   draft_kind=s.get("draft_kind"), n_samples=len(j["samples"]),
                   lossless=s.get("lossless"), _summary=s, _samples=j["samples"])
        for key in ("tokens_generated", "target_forwards", "tau", "acceptance_rate",
                    "tokens_per_s", "speedup"):
            row[key] = s.get(key)
        row["alpha"] = list(s.get("alpha") or [])
        row["label"] = _label(row)
        rows.append(row)
    _mark_k_star(rows)
    _speedup_vs_plain(rows)
    _trained_vs_served(rows, gap_threshold)
    return rows


def _key(row: dict, keys: Sequence[str]) -> tuple:
    return tuple(json.dumps(row.get(k), sort_keys=True) for k in keys)


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["k"] not in (None, 0):
            groups[_key(r, GROUP_KEYS)].append(r)
    return groups


def _score(r: dict) -> float:
    v = r["speedup"] if r["speedup"] is not None else r["tokens_per_s"]
    return float("-inf") if v is None else float(v)


def _mark_k_star(rows: list[dict]) -> None:
    for r in rows:
        r["k_star"] = False
    for group in _groups(rows).values():
        best = max(group, key=lambda r: (_score(r), -int(r["k"])))
        if _score(best) > float("-inf"):
            best["k_star"] = True


def _speedup_vs_plain(rows: list[dict]) -> None:
    """Tokens/s over the sweep's plain decoder job and over its transformers generate job."""
    refs = {"speedup_vs_plain": lambda r: r["method"] == "spec" and r["draft"] in (None, "none"),
            "speedup_vs_hf_generate": lambda r: r["method"] == "hf_generate"}
    for col, is_ref in refs.items():
        ref = {_key(r, PLAIN_KEYS): r for r in rows if is_ref(r) and r["tokens_per_s"]}
        for r in rows:
            p = ref.get(_key(r, PLAIN_KEYS))
            r[col] = (r["tokens_per_s"] / p["tokens_per_s"]
                      if p is not None and r["tokens_per_s"] is not None else None)


def _is_tree(row: dict) -> bool:
    """Whether a job drafted a tree (its per-depth acceptance is not a chain's alpha)."""
    return bool(row["_summary"].get("tree"))


def _trained_vs_served(rows: list[dict], gap_threshold: float) -> None:
    infos: dict[str, DraftInfo] = {}
    for r in rows:
        r.update(trained_alpha_hat=None, trained_temperature=None, gap_max=None,
                 gap_position=None, gap_flag=False, reached=None)
        d = r["draft"]
        if not d or d in ("none", "lookup", "prompt_lookup"):
            continue
        if _is_tree(r):
            continue  # a tree's per-depth acceptance counts several candidates: not comparable
        info = infos.setdefault(d, read_draft_info(d))
        val = info.validation
        if not val or not val.get("alpha_hat"):
            continue
        # At T = 0 the served acceptance of a position is the chance that the draft's argmax is
        # the target's: validation's top-1 agreement. At T > 0 it is alpha-hat, when training
        # validated at that temperature.
        if r["temperature"] is not None and float(r["temperature"]) == 0.0 and val.get("top1"):
            r["trained_temperature"] = 0.0
            r["trained_alpha_hat"] = [float(a) for a in val["top1"]]
        else:
            r["trained_temperature"] = val.get("temperature")
            if r["temperature"] is None or val.get("temperature") is None or not math.isclose(
                    float(r["temperature"]), float(val["temperature"]), abs_tol=1e-6):
                continue
            r["trained_alpha_hat"] = [float(a) for a in val["alpha_hat"]]
        n = min(len(r["alpha"]), len(r["trained_alpha_hat"]))
        if n == 0:
            continue
        gaps = [abs(r["trained_alpha_hat"][i] - float(r["alpha"][i])) for i in range(n)]
        i_max = max(range(n), key=gaps.__getitem__)
        reached = list(r["_summary"].get("reached") or [])
        r.update(gap_max=gaps[i_max], gap_position=i_max + 1, reached=reached[:n],
                 gap_flag=any(gaps[i] > gap_threshold and _beyond_noise(
                     r["trained_alpha_hat"][i], gaps[i], reached[i] if i < len(reached) else None)
                     for i in range(n)))


def _beyond_noise(alpha_hat: float, gap: float, reached: int | None) -> bool:
    """Whether a served-vs-trained gap at one position is more than two standard errors of a
    binomial acceptance measured on ``reached`` drafts (None: the count is unknown, so yes);
    a position drafted a handful of times says little."""
    if reached is None:
        return True
    if reached == 0:
        return False
    se = math.sqrt(max(alpha_hat * (1.0 - alpha_hat), 1e-6) / reached)
    return gap > 2.0 * se


def build_category_rows(rows: list[dict]) -> list[dict]:
    """Long-format table: one row per (job, category)."""
    out = []
    for r in rows:
        for cat, v in category_tau(r["_samples"]).items():
            out.append({"job": r["job"], "label": r["label"], "category": cat, **v})
    return out


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


def _md_table(header: Sequence[str], body: Sequence[Sequence]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in body]
    return lines


def _headline(rows: list[dict]) -> list[dict]:
    """The K* row of every K group plus every job without K (plain, peers without K)."""
    return [r for r in rows if r["k_star"] or r["k"] in (None, 0)]


def write_markdown(rows, cats, errors, plot_files, gap_threshold, path: Path) -> Path:
    """Write ``report.md``: job table, K*, trained vs served, categories, errors, plots."""
    lines = [f"# Sweep report: {path.parent}", "",
             f"{len(rows)} finished jobs, {len(errors)} failed.", "", "## Jobs", ""]
    cols = ["label", "tau", "acceptance_rate", "tokens_per_s", "speedup", "speedup_vs_plain",
            "speedup_vs_hf_generate", "k_star", "gap_flag", "job"]
    lines += _md_table(["job" if c == "label" else c for c in cols[:-1]] + ["file id"],
                       [[r[c] for c in cols] for r in rows])
    ks = [r for r in rows if r["k_star"]]
    if ks:
        lines += ["", "## Best K (K*) per checkpoint and temperature", ""]
        lines += _md_table(["method", "checkpoint", "T", "K*", "speedup", "tokens/s"],
                           [[r["method"], draft_name(r["draft"]), r["temperature"], r["k"],
                             r["speedup"], r["tokens_per_s"]] for r in ks])
    tvs = [r for r in rows if r["trained_alpha_hat"] is not None]
    lines += ["", f"## Trained vs served (gap threshold {gap_threshold})", ""]
    if tvs:
        lines += _md_table(["job", "T", "trained alpha_hat", "served alpha", "drafts reached",
                            "max gap", "at", "flag"],
                           [[r["label"], r["temperature"], r["trained_alpha_hat"], r["alpha"],
                             " ".join(map(str, r["reached"] or [])) or "-", r["gap_max"],
                             r["gap_position"], "**GAP**" if r["gap_flag"] else "ok"]
                            for r in tvs])
        flagged = [r for r in tvs if r["gap_flag"]]
        if flagged:
            lines += ["", (f"**{len(flagged)} job(s) serve an acceptance more than {gap_threshold} "
                           "away from the training-time estimate, beyond two standard errors "
                           "of the drafts reached: a bug or a data shift.**")]
    else:
        lines.append("No chain job ran a checkpoint with validation.json at its validation "
                     "temperature (or at T = 0, compared with validation top-1 agreement). Tree "
                     "jobs are not compared: their per-depth acceptance counts several candidates.")
    head = _headline(rows)
    by_job = defaultdict(dict)
    for c in cats:
        by_job[c["label"]][c["category"]] = c["tau"]
    shown = [r["label"] for r in head if r["label"] in by_job][:10]
    if shown:
        cat_names = sorted({c for lab in shown for c in by_job[lab]})
        lines += ["", "## tau per category (K* jobs and jobs without K)", ""]
        lines += _md_table(["category"] + shown,
                           [[c] + [by_job[lab].get(c) for lab in shown] for c in cat_names])
    if errors:
        lines += ["", "## Failed jobs", ""]
        body = []
        for e in errors:
            err = e.get("error") or {}
            msg = str(err.get("message", "")).replace("|", "/").replace("\n", " ")[:200]
            body.append([e["file"], f"{err.get('type', '')}: {msg}"])
        lines += _md_table(["file", "error"], body)
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{k}]({p.name})" for k, p in plot_files.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def make_plots(rows: list[dict], cats: list[dict], out_dir: Path) -> dict[str, Path]:
    """Draw every plot the data allows; returns {name: path} of the PNGs written."""
    files: dict[str, Path] = {}
    groups = _groups(rows)
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
        pred = {} if _is_tree(longest) else predicted_speedup(
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
    files["markdown"] = write_markdown(rows, cats, errors, plot_files, gap_threshold,
                                       sweep_dir / "report.md")
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
