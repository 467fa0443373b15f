"""The draft packages a benchmark runs (``scripts/bench.py``, ``scripts/bench_fallback.py``):
those given on its command line, each with its K and measured tree shape."""
from __future__ import annotations

import json

from omegaconf import DictConfig

from draftsmith.eval.draft import DEFAULT_K, Measured, resolve_k
from draftsmith.heads.family import FAMILIES
from draftsmith.scripts.tooling import note, repo_path


def draft_paths(cfg: DictConfig) -> dict[str, str]:
    """The draft packages given on the command line that exist (a note for each one skipped)."""
    drafts = {}
    for fam in FAMILIES:
        path = cfg.get(fam)
        if path is None:
            note("bench", f"no {fam}= package given: skipping {fam} methods")
        elif not repo_path(path).is_dir():
            note("bench", f"{fam}={path} does not exist: skipping {fam} methods")
        else:
            drafts[fam] = str(repo_path(path))
    return drafts


def speculation_of(path: str | None) -> dict | None:
    """The package's ``speculation.json``, or None."""
    spec = repo_path(path) / "speculation.json" if path else None
    return json.loads(spec.read_text()) if spec is not None and spec.is_file() else None


def package_k(path: str | None, k: int | None, dtype: str | None = None,
              device: str | None = None) -> tuple[int, str]:
    """K for a package: ``k`` when set, else its measured K* (``speculation.json``), else 4.

    A measured K* of 0 (plain decoding wins) would turn the draft's methods into plain decoding,
    so they run at the default K instead, and the source says so.
    """
    k_used, source = resolve_k(k, speculation_of(path), dtype, device)
    if k_used == 0:
        return DEFAULT_K, "default (measured K*=0)"
    return k_used, source


def measured_tree(path: str, cfg: DictConfig, temperature: float | None = None) -> int | None:
    """The depth of the package's measured tree shape for this run (``speculation.json``, the
    record measured nearest ``temperature``; None: the top-level one), or None."""
    measured, _ = Measured.of(speculation_of(path), cfg.dtype, cfg.device, temperature)
    return measured.tree.depth if measured is not None and measured.tree is not None else None
