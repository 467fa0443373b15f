"""Markdown the tools write: one table writer and one file writer.

The sweep report (``eval/report.py``), the benchmarks (``scripts/bench*.py``) and the engines'
comparison (``scripts/engines_report.py``) build their documents as lines with :func:`table`
and write them with :func:`write_markdown`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def table(header: Sequence[str], rows: Iterable[Sequence[Any]],
          cell: Callable[[Any], str] = str) -> list[str]:
    """A markdown table as lines: the header, its rule, then one line per row, each cell
    written by ``cell`` (``str`` by default: rows of ready-made strings)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def write_markdown(path: Path, lines: Iterable[str]) -> Path:
    """Write ``lines`` as one markdown file (a newline after the last); returns ``path``."""
    path.write_text("\n".join(lines) + "\n")
    return path
