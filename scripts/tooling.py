"""What the benchmark and engine commands share: paths given relative to the repository, and
their progress lines."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_path(p: str | Path) -> Path:
    """A path from a config: relative paths are relative to the repository."""
    p = Path(str(p)).expanduser()
    return p if p.is_absolute() else (REPO / p).resolve()


def note(tool: str, msg: str) -> None:
    """A progress line of ``tool`` on stdout, flushed at once: ``[tool] msg``."""
    print(f"[{tool}] {msg}", flush=True)
