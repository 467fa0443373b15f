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

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


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


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    if "run" not in args or "out" not in args:
        sys.exit("usage: python scripts/plot_training.py run=OUT_DIR out=FILE.png")
    run = Path(args["run"])
    points = curve(run / "train_log.jsonl")
    fits = plot(points, Path(args["out"]), run.name)
    for p in points:
        print(f"step {p['step']:>5}  tokens {p['tokens']:>9}  alpha-hat "
              + " ".join(f"{a:.3f}" for a in p["alpha_hat"]))
    for f in fits:
        print(f"position {f['position']}: +{f['b_per_decade']:.3f} alpha-hat per 10x tokens; "
              f"extrapolated at 10x the trained tokens: {f['at_10x']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
