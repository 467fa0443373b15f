"""Writing a folder so that readers never see half of it: it is built in ``<out>.tmp-<pid>``
and moved into place with ``os.replace``; what killed writers leave beside ``out`` is removed
by the next writer. Draft packages (``heads/package.py``) and exports (``scripts/export.py``)
are published this way.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``os.kill(pid, 0)``; another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists but belongs to someone else
        return True
    return True


def remove_stale_siblings(out: Path, states: tuple[str, ...] = ("tmp", "old")) -> list[Path]:
    """Remove ``<out>.tmp-<pid>`` / ``<out>.old-<pid>`` left beside ``out`` by killed writers.

    Only folders whose pid is not a live process are removed (a live writer's are kept, this
    process's own included), each with a log line. A dead writer's ``.old-<pid>`` is removed
    only while ``out`` exists: without ``out`` it is the only copy of the previous package (a
    kill between the two renames of :func:`publish_dir`), so it is kept and named in a warning.

    Returns:
        The folders removed.
    """
    removed = []
    for state in states:
        for path in sorted(out.parent.glob(f"{glob.escape(out.name)}.{state}-*")):
            pid = path.name[len(out.name) + len(state) + 2:]
            if not pid.isdigit() or int(pid) <= 0 or _pid_alive(int(pid)):
                continue
            if state == "old" and not out.exists():
                log.warning("%s is the previous version of %s left by killed process %s and "
                            "nothing is at %s: kept (move it back with: mv %s %s)",
                            path, out, pid, out, path, out)
                continue
            log.warning("removing %s, left by process %s that was killed while writing %s",
                        path, pid, out)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed


def publish_dir(tmp: Path, out: Path) -> None:
    """Move a complete folder ``tmp`` to ``out``, replacing an older ``out`` without a half state.

    ``os.replace`` cannot replace a non-empty folder, so an old ``out`` is first renamed aside;
    a kill between the two renames leaves no package at ``out`` (and the old one beside it as
    ``<out>.old-<pid>``), never a mixed one. Once ``out`` is in place, ``.old-<pid>`` folders
    of dead processes are superseded and removed (:func:`remove_stale_siblings`).
    """
    _fsync_tree(tmp)
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)
    remove_stale_siblings(out, states=("old",))


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Build a folder for ``out`` in a fresh temporary sibling (:func:`fresh_tmp_dir`): it is
    published as ``out`` (:func:`publish_dir`) when the block ends, and removed if it raises."""
    tmp = fresh_tmp_dir(out)
    try:
        yield tmp
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fresh_tmp_dir(out: Path) -> Path:
    """An empty ``<out>.tmp-<pid>`` folder next to ``out``; first the temporary folders of
    killed writers beside ``out`` are removed (:func:`remove_stale_siblings`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp
