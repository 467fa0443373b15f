"""Speedup against tau, from decode.py's result files: how far a draft is from a speedup goal,
and whether tokens per round (tau) or the cost of a round stands in the way.

    python scripts/plot_speedup_tau.py runs=[bench/qwen/release/he_t0.json,...] \
        out=bench/qwen/speedup_vs_tau.png goals=[2.5,1.8] +projections.amx=1.0
    python scripts/plot_speedup_tau.py "runs={release HumanEval: he_t0.json, ...}" out=...

Each run's speedup is its tau over the cost of one of its rounds (drafting, verification and the
rest, counted from prefill to the last token) in plain steps of the same run:
``speedup = tau / r``, so ``r = tau / speedup``. A run is drawn as its prompts (small dots: each
prompt's tau and paired speedup), its whole (a large marker) and its line ``speedup = tau / r``,
the speedup it would reach at any tau if its rounds cost what they cost here; a goal ``g`` needs
``tau >= g * r``. ``projections`` draws lines for round costs measured elsewhere (label: r), for
instance a CPU where verifying the block costs one plain step. The split of ``r`` comes from the
run's own timers (``draft_time_s``, ``verify_time_s`` of ``wall_time_s``).

Writes the PNG, a CSV of the plotted points and a Markdown table beside it.
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import matplotlib
from omegaconf import DictConfig

from draftsmith.eval import CONF_DIR

matplotlib.use("Agg")
import matplotlib.pyplot as plt

USAGE = ("usage: python scripts/plot_speedup_tau.py runs=[RUN.json,...] out=FILE.png "
         "[goals=[2.5]] [+projections.NAME=R]")


@dataclass
class Run:
    """One decode.py result: its prompts' (tau, speedup), its whole, and its round's cost."""

    label: str
    path: Path
    shape: str  # "chain K 3", "tree K 3, 8 nodes"
    prompts: str
    temperature: float
    tau: float
    speedup: float
    points: list[tuple[float, float]]
    draft_share: float  # of the round's cost r, in plain steps: drafting and bookkeeping
    verify_share: float  # verification (the target's forward)

    @property
    def round_cost(self) -> float:
        """Plain steps per round: ``tau / speedup``."""
        return self.tau / self.speedup

    def tau_for(self, goal: float) -> float:
        return goal * self.round_cost


def _shape(s: dict) -> str:
    if s.get("tree"):
        return f"tree K {s.get('k')}, {s.get('tree_size')} nodes"
    return f"chain K {s.get('k')}"


def _prompts(name: str) -> str:
    """A prompt set's name; a file's folder and name (``../x/mt_bench/question.jsonl``:
    ``mt_bench/question.jsonl``)."""
    path = Path(name)
    return f"{path.parent.name}/{path.name}" if name.endswith(".jsonl") else name


def load_run(label: str, path: Path) -> Run:
    """The file ``eval/decode.py out=...`` wrote (batch size one, paired with plain decoding:
    ``baseline=true``), drawn as ``label``."""
    try:
        data = json.loads(path.read_text())
        s, samples = data["summary"], data["samples"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: not a result file of eval/decode.py ({e}); pass the out= "
                         f"file of a run with baseline=true") from e
    if not s.get("speedup") or not s.get("wall_time_s"):
        raise SystemExit(f"{path}: no speedup: decode it with baseline=true (paired plain runs)")
    if int(s.get("batch_size", 1)) != 1:
        raise SystemExit(f"{path}: batch size {s['batch_size']}: a round here is one row's; "
                         f"pass batch-one runs")
    r = s["tau"] / s["speedup"]
    return Run(label=label, path=path, shape=_shape(s),
               prompts=_prompts(str(s.get("prompts", "?"))),
               temperature=float(s.get("temperature", 0.0)), tau=s["tau"], speedup=s["speedup"],
               points=[(x["tau"], x["speedup"]) for x in samples if x.get("speedup")],
               draft_share=r * s.get("draft_time_s", 0.0) / s["wall_time_s"],
               verify_share=r * s.get("verify_time_s", 0.0) / s["wall_time_s"])


def plot(runs: list[Run], out: Path, goals: list[float], projections: dict[str, float],
         title: str) -> None:
    """The PNG: per run its prompts, its whole and its line; goals and projections."""
    top = max([t for r in runs for t, _ in r.points] + [r.tau for r in runs]
              + [g * r.round_cost for g in goals for r in runs]) * 1.1
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    for i, r in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot(*zip(*r.points), ".", color=color, alpha=0.45)
        ax.plot([r.tau], [r.speedup], "o", color=color, markersize=9, markeredgecolor="black",
                label=f"{r.label}: tau {r.tau:.2f}, {r.speedup:.2f}x, r = {r.round_cost:.2f}")
        ax.plot([1, top], [1 / r.round_cost, top / r.round_cost], "--", color=color, alpha=0.7)
    for j, (name, cost) in enumerate(projections.items()):
        ax.plot([1, top], [1 / cost, top / cost], ":", color="black", alpha=0.4 + 0.2 * (j % 3),
                label=f"{name}: r = {cost:.2f} plain steps")
    for g in goals:
        ax.axhline(g, color="grey", lw=0.8, ls="-.")
        ax.text(1.02, g, f" {g:g}x", va="bottom", fontsize=8, color="grey")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlim(1, top)
    ax.set_ylim(0, max([y for r in runs for _, y in r.points] + goals) * 1.1)
    ax.set_xlabel("tau (tokens per target forward)")
    ax.set_ylabel("speedup against plain decoding (paired)")
    ax.set_title(title + "  (dashed: speedup = tau / r, r: a round in plain steps)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def table(runs: list[Run], goals: list[float], projections: dict[str, float],
          command: str) -> str:
    """The Markdown: per run its tau, speedup, round cost and split, and the tau each goal
    needs at that cost (and at each projection's)."""
    head = ["run", "prompts", "T", "drafting", "tau", "speedup",
            "r: a round in plain steps (drafting and bookkeeping + verification + rest)",
            *[f"tau for {g:g}x" for g in goals]]
    lines = [f"`{command}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        rest = r.round_cost - r.draft_share - r.verify_share
        lines.append(f"| {r.label} | {r.prompts} | {r.temperature:g} | {r.shape} | {r.tau:.2f} | "
                     f"{r.speedup:.2f}x | {r.round_cost:.2f} ({r.draft_share:.2f} + "
                     f"{r.verify_share:.2f} + {rest:.2f}) | "
                     + " | ".join(f"{r.tau_for(g):.2f}" for g in goals) + " |")
    for name, cost in projections.items():
        lines.append(f"| projection: {name} | | | | | | {cost:.2f} | "
                     + " | ".join(f"{g * cost:.2f}" for g in goals) + " |")
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> list[Run]:
    """Plot ``cfg.runs`` into ``cfg.out`` (options: ``conf/eval/plot_speedup_tau.yaml``), with
    the CSV and Markdown beside it; prints the table and returns the runs."""
    if not cfg.runs or cfg.out is None:
        sys.exit(f"runs= and out= are required\n{USAGE}")
    if isinstance(cfg.runs, str):
        specs = {Path(cfg.runs).stem: cfg.runs}
    elif isinstance(cfg.runs, DictConfig):  # label: file
        specs = {str(k): str(v) for k, v in cfg.runs.items()}
    else:
        specs = {Path(str(s)).stem: str(s) for s in cfg.runs}
    runs = [load_run(label, Path(path)) for label, path in specs.items()]
    goals = [float(g) for g in cfg.goals]
    projections = {str(k): float(v) for k, v in (cfg.projections or {}).items()}
    bad = {k: v for k, v in projections.items() if v <= 0}
    if bad:
        sys.exit(f"projections: a round's cost in plain steps is > 0, got {bad}")
    out = Path(str(cfg.out))
    if out.suffix != ".png" or any(out.resolve() == r.path.resolve() for r in runs):
        sys.exit(f"out={out}: a new .png file (the CSV and Markdown go beside it)")
    plot(runs, out, goals, projections, str(cfg.title or ""))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "tau", "speedup", "whole"])
        for r in runs:
            w.writerows([r.label, f"{t:.4f}", f"{s:.4f}", 0] for t, s in r.points)
            w.writerow([r.label, f"{r.tau:.4f}", f"{r.speedup:.4f}", 1])
    command = "python scripts/plot_speedup_tau.py " + " ".join(sys.argv[1:])
    text = table(runs, goals, projections, command)
    out.with_suffix(".md").write_text(text)
    print(text, end="")
    medians = [statistics.median(s / t for t, s in r.points) for r in runs if r.points]
    if medians:  # per prompt, speedup / tau: the spread behind each run's one r
        print("per-prompt 1/r medians: " + ", ".join(f"{m:.2f}" for m in medians))
    return runs


@hydra.main(config_path=str(CONF_DIR), config_name="plot_speedup_tau", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: Hydra overrides of ``conf/eval/plot_speedup_tau.yaml``."""
    run(cfg)


if __name__ == "__main__":
    main()
