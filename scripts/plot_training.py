"""Validation alpha-hat per draft position against trained tokens, from a run's train_log.jsonl.

    python scripts/plot_training.py run=outputs/eagle3_long out=bench/train/alpha_vs_tokens_long.png

Writes the PNG and a CSV beside it (the plotted points), and prints a log-linear fit per
position, alpha-hat = a + b log10(tokens), over the validations after the first, with what it
extrapolates to at 10x the trained tokens: a rough reading of the headroom that more data or
steps would buy, labelled as such, not a measurement.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import hydra
import matplotlib
from omegaconf import DictConfig

from draftsmith.eval import CONF_DIR

matplotlib.use("Agg")
import matplotlib.pyplot as plt

USAGE = ("usage: python scripts/plot_training.py run=OUT_DIR out=FILE.png\n"
         "       python scripts/plot_training.py runs=[DIR,DIR] out=FILE.png [goal=0.7]")


def trained_tokens(recs: list[dict]) -> dict[int, int]:
    """Trained position-1 tokens by step. Train records carry ``tokens_total`` (counted across
    resumes). Logs written before it count ``tokens`` from each (re)start: a count that goes
    down starts a resumed segment, whose resume step is estimated from its first count at the
    earlier segment's tokens per step (snapped to a logged step); the earlier segment's records
    after that step (work the resume redid) are dropped and its count there carries on."""
    by_step: dict[int, int] = {0: 0}
    base, seg_start, prev = 0, 0, None  # prev: the previous record of the current segment
    for r in (r for r in recs if "tokens" in r):
        if "tokens_total" in r:
            by_step[r["step"]] = r["tokens_total"]
            continue
        if prev is not None and r["tokens"] < prev["tokens"]:  # a resumed segment starts
            rate = prev["tokens"] / max(prev["step"] - seg_start, 1)
            guess = r["step"] - r["tokens"] / max(rate, 1e-9)
            seg_start = max((s for s in by_step if s <= guess + 0.5), default=0)
            by_step = {s: t for s, t in by_step.items() if s <= seg_start}
            base = by_step[seg_start]
        by_step[r["step"]] = base + r["tokens"]
        prev = r
    return by_step


def curve(log_path: Path) -> list[dict]:
    """``[{"step", "tokens", "alpha_hat": [...]}]`` for every validation, tokens = trained
    position-1 tokens by then (from the train records logged at the same steps)."""
    recs = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
    tokens = trained_tokens(recs)
    points = {}
    for r in recs:  # a validation repeated by a resumed run: the later one
        if r.get("tag") in ("init", "val") and r["step"] in tokens:
            points[r["step"]] = {"step": r["step"], "tokens": tokens[r["step"]],
                                 "alpha_hat": r["alpha_hat"]}
    points = [points[s] for s in sorted(points)]
    if len(points) < 2:
        raise ValueError(f"{log_path}: fewer than two validations with a token count; log with "
                         "train.log_every dividing train.eval_every")
    return points


def log_fit(points: list[dict], k: int) -> tuple[float, float] | None:
    """Least-squares a + b log10(tokens) for position k over the points with tokens > 0."""
    xs = [math.log10(p["tokens"]) for p in points if p["tokens"] > 0]
    ys = [p["alpha_hat"][k] for p in points if p["tokens"] > 0]
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def plot(points: list[dict], out: Path, title: str) -> list[dict]:
    """Write the PNG and CSV; returns per position the fit and its 10x extrapolation."""
    n_pos = len(points[0]["alpha_hat"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    fits = []
    last = points[-1]["tokens"]
    for k in range(n_pos):
        trained = [p for p in points if p["tokens"] > 0]
        ax.plot([p["tokens"] for p in trained], [p["alpha_hat"][k] for p in trained], "o-",
                label=f"position {k + 1}")
        fit = log_fit(trained[1:] if len(trained) > 2 else trained, k)
        if fit is not None:
            a, b = fit
            ax.plot([last, 10 * last], [a + b * math.log10(last), a + b * math.log10(10 * last)],
                    "--", color=ax.lines[-1].get_color(), alpha=0.6)
            fits.append({"position": k + 1, "a": a, "b_per_decade": b,
                         "at_10x": a + b * math.log10(10 * last)})
    ax.set_xscale("log")
    ax.set_xlabel("trained tokens (position 1)")
    ax.set_ylabel("validation alpha-hat")
    ax.set_title(title + "  (dashed: log-linear extrapolation to 10x)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "tokens", *[f"alpha_hat_pos{k + 1}" for k in range(n_pos)]])
        for p in points:
            w.writerow([p["step"], p["tokens"], *[f"{a:.4f}" for a in p["alpha_hat"]]])
    return fits


def tokens_for(fit: tuple[float, float], alpha: float) -> float | None:
    """Trained tokens at which the fit a + b log10(tokens) reaches ``alpha`` (None: flat)."""
    a, b = fit
    return 10 ** ((alpha - a) / b) if b > 0 else None


def compare(runs: list[Path], out: Path, goal: float) -> list[dict]:
    """Position-1 alpha-hat against trained tokens of several runs on one plot (+ CSV); per run
    the log-linear fit and the tokens it extrapolates to for alpha-hat ``goal``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rows, fits = [], []
    for run in runs:
        points = [p for p in curve(run / "train_log.jsonl") if p["tokens"] > 0]
        ax.plot([p["tokens"] for p in points], [p["alpha_hat"][0] for p in points], "o-",
                label=run.name)
        rows += [[run.name, p["step"], p["tokens"], f"{p['alpha_hat'][0]:.4f}"] for p in points]
        fit = log_fit(points[1:] if len(points) > 2 else points, 0)
        need = tokens_for(fit, goal) if fit else None
        fits.append({"run": run.name, "tokens": points[-1]["tokens"],
                     "alpha_hat": points[-1]["alpha_hat"][0],
                     "b_per_decade": fit[1] if fit else None, "tokens_for_goal": need})
    ax.axhline(goal, ls=":", color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("trained tokens (position / slot 1)")
    ax.set_ylabel("validation alpha-hat, position / slot 1")
    ax.set_title(f"dotted: alpha-hat {goal}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        csv.writer(f).writerows([["run", "step", "tokens", "alpha_hat_pos1"], *rows])
    return fits


def run(cfg: DictConfig) -> list[dict]:
    """Plot ``cfg.run`` (every position) or ``cfg.runs`` (position 1 of each) into ``cfg.out``
    and print the fits (options: ``conf/eval/plot_training.yaml``); returns the fits."""
    if cfg.run is None and not cfg.runs:
        sys.exit(f"run= or runs= is required\n{USAGE}")
    if cfg.runs:  # runs=[DIR,DIR,...]: position 1 of each, one plot
        runs = [cfg.runs] if isinstance(cfg.runs, str) else list(cfg.runs)
        goal = float(cfg.goal)
        fits = compare([Path(str(r)) for r in runs], Path(str(cfg.out)), goal)
        for f in fits:
            need = f["tokens_for_goal"]
            print(f"{f['run']}: {f['tokens']} tokens, alpha-hat {f['alpha_hat']:.3f}; fit "
                  + (f"+{f['b_per_decade']:.3f} per 10x tokens" if f["b_per_decade"] is not None
                     else "none")
                  + (f"; alpha-hat {goal} extrapolated at {need:.3g} tokens" if need else ""))
        return fits
    folder = Path(str(cfg.run))
    points = curve(folder / "train_log.jsonl")
    fits = plot(points, Path(str(cfg.out)), folder.name)
    for p in points:
        print(f"step {p['step']:>5}  tokens {p['tokens']:>9}  alpha-hat "
              + " ".join(f"{a:.3f}" for a in p["alpha_hat"]))
    for f in fits:
        print(f"position {f['position']}: +{f['b_per_decade']:.3f} alpha-hat per 10x tokens; "
              f"extrapolated at 10x the trained tokens: {f['at_10x']:.3f}")
    return fits


@hydra.main(config_path=str(CONF_DIR), config_name="plot_training", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: Hydra overrides of ``conf/eval/plot_training.yaml``."""
    run(cfg)


if __name__ == "__main__":
    main()
