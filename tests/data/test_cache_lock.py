"""data/cache_lock.py: concurrent makers of one cache entry make it once; the others wait."""
from __future__ import annotations

import contextlib
import threading
import time

from draftsmith.data import cache_lock


def _race(tmp_path, callers: int = 3) -> tuple[int, list[bool]]:
    """``callers`` threads want the same entry at once -> (times it was made, what each said)."""
    entry, made, said = tmp_path / "entry", [], []

    def make():
        made.append(1)
        time.sleep(0.3)  # a slow conversion: the other callers arrive while it runs
        entry.write_text("done")

    def call():
        said.append(cache_lock.make_once(entry.exists, make, tmp_path / ".entry.lock"))

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert entry.read_text() == "done"
    return len(made), said


def test_concurrent_callers_make_an_entry_once_and_the_others_read_it(tmp_path):
    made, said = _race(tmp_path)
    assert made == 1 and sorted(said) == [False, False, True]
    assert cache_lock.make_once(lambda: True, lambda: 1 / 0, tmp_path / ".x.lock") is False


def test_twin_without_the_lock_every_caller_makes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_lock, "exclusive", lambda path: contextlib.nullcontext())
    made, _ = _race(tmp_path)
    assert made == 3
