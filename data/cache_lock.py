"""Make a cache entry once when several processes want it at the same time.

Ranks of one launch on a fresh machine, or test workers, all find the converted target missing;
without a lock each converts it (tens of seconds of CPU each, Gemma 3 270M over a minute) and all
but one throw the result away. With it, the first converts and the others wait and read.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: concurrent makers stay correct (atomic renames), only slower
    fcntl = None


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created if needed); released when the block
    ends or the holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def make_once(done: Callable[[], bool], make: Callable[[], object], lock_path: Path) -> bool:
    """Run ``make()`` unless ``done()``; concurrent callers with the same ``lock_path`` wait for
    the one that makes it. Returns whether this call made it."""
    if done():
        return False
    with exclusive(lock_path):
        if done():  # made by the holder this call waited for
            return False
        make()
        return True
