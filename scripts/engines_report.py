"""What ``scripts/engines.py`` writes: ``out`` (JSON: the rows and the config) and a markdown
table of the rows beside it (``.md``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftsmith.eval.markdown import table, write_markdown
from draftsmith.scripts.engine_envs import note


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return " ".join("-" if x is None else f"{x:.2f}" for x in v)
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def _speed_cell(r: dict) -> str:
    """``1.23x (0.9-1.4, noisy)``: the paired speedup, its spread and the noise flag."""
    if r.get("engine_speedup") is None:
        return "-"
    lo, hi = r.get("engine_speedup_spread") or (None, None)
    spread = f" ({lo:.2f}-{hi:.2f}" if lo is not None else " ("
    return (f"{r['engine_speedup']:.2f}x{spread}, {r.get('engine_paired_prompts')} prompts"
            f"{', noisy' if r.get('engine_noisy') else ''})")


def rows_markdown(rows: list[dict]) -> list[str]:
    """The comparison's rows as one markdown table."""
    return table(
        ["draft", "format", "engine", "loads", "greedy = engine plain", "greedy = ours",
         "acceptance per position (engine)", "(ours)", "within 10%", "engine speedup (paired)",
         "K / best K (engine) / K* (ours)", "error"],
        [(r["draft"], r["format"],
          " ".join(x for x in (r["engine"], r.get("version"),
                               r.get("engine_target") and f"({r['engine_target']})") if x),
          r["loads"], r.get("greedy_identical_to_engine_plain"),
          r.get("greedy_identical_to_ours"), r.get("engine_acceptance"),
          r.get("our_acceptance"), r.get("acceptance_within_10pct"), _speed_cell(r),
          " / ".join(_cell(r.get(x)) for x in ("k", "engine_best_k", "our_k_star")),
          (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]) for r in rows],
        _cell)


def write_report(out: Path, rows: list[dict], cfg: DictConfig) -> None:
    """``out`` (the rows and ``cfg``, JSON) and the rows' table beside it (``.md``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "config": OmegaConf.to_container(cfg)}, indent=1))
    write_markdown(out.with_suffix(".md"), rows_markdown(rows))
    note(f"wrote {out} and {out.with_suffix('.md')}")
