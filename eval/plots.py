"""Matplotlib (Agg) figures for sweep reports.

Every function takes plain Python data (lists and dicts read from job JSON files) and
writes one PNG, returning its path, or ``None`` when there is nothing to draw. Nothing
here reads files or computes statistics: that is ``eval/report.py``'s job.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the Agg backend must be chosen first


@dataclass
class AcceptanceCurve:
    """Per-position acceptance of one checkpoint at one temperature.

    Attributes:
        label: legend text (checkpoint, temperature).
        served: measured conditional acceptance per draft position (position 1 first).
        trained: training-time estimate alpha_hat per position (validation.json), if any.
    """

    label: str
    served: list[float]
    trained: list[float] | None = None


@dataclass
class SpeedupSeries:
    """Measured (and optionally predicted) speedup against K for one checkpoint.

    Attributes:
        label: legend text.
        ks: draft lengths K that were run.
        speedups: measured speedup for each K (same order as ``ks``).
        best_k: the measured K* (highest speedup), marked with a star.
        predicted_ks: K values of the predicted curve.
        predicted: the cost model's expected speedup
            (:func:`eval.decoding.cost.expected_speedups`) for each of ``predicted_ks``.
    """

    label: str
    ks: list[int]
    speedups: list[float]
    best_k: int | None = None
    predicted_ks: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(curves: Sequence[AcceptanceCurve], path: Path) -> Path | None:
    """Per-position acceptance, served (solid, circles) and trained (dashed, crosses).

    Args:
        curves: one entry per checkpoint and temperature.
        path: output PNG.
    """
    curves = [c for c in curves if c.served]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        pos = list(range(1, len(c.served) + 1))
        ax.plot(pos, c.served, "o-", color=color, label=f"{c.label} served")
        if c.trained:
            tpos = list(range(1, len(c.trained) + 1))
            ax.plot(tpos, c.trained, "x--", color=color, label=f"{c.label} trained")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance alpha_i (conditional)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-position acceptance per checkpoint")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_speedup_vs_k(series: Sequence[SpeedupSeries], path: Path) -> Path | None:
    """Measured speedup against K with the best K starred and the predicted curve dashed.

    Args:
        series: one entry per checkpoint/temperature group.
        path: output PNG.
    """
    series = [s for s in series if s.ks]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        order = sorted(range(len(s.ks)), key=lambda j: s.ks[j])
        ks = [s.ks[j] for j in order]
        ys = [s.speedups[j] for j in order]
        ax.plot(ks, ys, "o-", color=color, label=f"{s.label} measured")
        if s.best_k is not None and s.best_k in ks:
            y = ys[ks.index(s.best_k)]
            ax.plot([s.best_k], [y], "*", color=color, markersize=16,
                    markeredgecolor="black", label=f"{s.label} K*={s.best_k}")
        if s.predicted_ks:
            ax.plot(s.predicted_ks, s.predicted, "--", color=color, alpha=0.7,
                    label=f"{s.label} predicted")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title("Speedup vs K")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_tau_per_category(table: Mapping[str, Mapping[str, float]], path: Path) -> Path | None:
    """Grouped bars: tau (tokens per target forward) per prompt category, one bar per job.

    Args:
        table: job label -> {category -> tau}.
        path: output PNG.
    """
    table = {k: v for k, v in table.items() if v}
    if not table:
        return None
    cats = sorted({c for v in table.values() for c in v})
    n = len(table)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(cats) + 2), 4.5))
    for i, (label, vals) in enumerate(table.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [vals.get(c, 0.0) for c in cats], width=width, label=label, color=f"C{i % 10}")
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("tau per category")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _last_per_step(points: Sequence[tuple[int, object]]) -> list[tuple[int, object]]:
    """Points in step order, the last record of each step only: a resumed run logs the steps
    after its checkpoint again, and drawing both would send the line back in time."""
    return sorted(dict(points).items())


def plot_training_curves(logs: Mapping[str, Sequence[Mapping]], path: Path) -> Path | None:
    """Loss against step (left) and validation alpha_hat per position against step (right).

    Args:
        logs: checkpoint label -> records of train_log.jsonl (``step``, ``loss``, and
            ``alpha_hat`` (list per position) at validation steps).
        path: output PNG.
    """
    logs = {k: v for k, v in logs.items() if v}
    if not logs:
        return None
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-", "--", ":", "-."]
    drew_alpha = False
    for i, (label, recs) in enumerate(logs.items()):
        loss = _last_per_step([(r["step"], r["loss"]) for r in recs
                               if r.get("loss") is not None and "step" in r])
        if loss:
            ax_l.plot(*zip(*loss), color=f"C{i % 10}", label=label)
        val = _last_per_step([(r["step"], r["alpha_hat"]) for r in recs
                              if r.get("alpha_hat") and "step" in r])
        n_pos = max((len(a) for _, a in val), default=0)
        for p in range(n_pos):
            pts = [(s, a[p]) for s, a in val if p < len(a)]
            ax_a.plot(*zip(*pts), styles[i % len(styles)], marker="o", ms=3, color=f"C{p % 10}",
                      label=f"{label} pos {p + 1}")
            drew_alpha = True
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("training loss")
    ax_l.set_title("Training loss")
    ax_l.grid(alpha=0.3)
    ax_l.legend(fontsize=7)
    ax_a.set_xlabel("step")
    ax_a.set_ylabel("validation alpha_hat_i")
    ax_a.set_title("Validation acceptance estimate per position")
    ax_a.set_ylim(0, 1.02)
    ax_a.grid(alpha=0.3)
    if drew_alpha:
        ax_a.legend(fontsize=6, ncol=2)
    return _save(fig, path)
