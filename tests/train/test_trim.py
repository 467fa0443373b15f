"""The tuned allocator's safety valve: freed heap pages go back to the kernel once the process
holds more than its share of memory, and stay resident below it (the speed the tuning buys)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftsmith.train.malloc import TUNED_MALLOC
from draftsmith.train.runtime import trim_freed_memory

# Under the tuned allocator: allocate 40 blocks of 8 MB, free every other one with a live block
# between (fragments the heap: nothing at its top to release), then call the valve.
SCRIPT = """
import os
import torch
from draftsmith.train.runtime import trim_freed_memory

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

blocks = [torch.ones(2 * 1024 * 1024) for _ in range(40)]  # 40 x 8 MB, touched
del blocks[::2]
before = resident()
trimmed = trim_freed_memory({limit})
print(trimmed, before, resident())
"""


def run(limit: float) -> tuple[bool, int, int]:
    env = {**os.environ, **TUNED_MALLOC, "DRAFTSMITH_MALLOC": "tuned"}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(limit=limit)],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_over_the_limit_freed_pages_go_back():
    trimmed, before, after = run(0.0)  # any resident memory is over a zero limit
    assert trimmed
    assert before - after > 100e6  # most of the 20 freed 8 MB blocks


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_under_the_limit_freed_pages_stay():
    """The twin: below the limit nothing is handed back (the tuned heap keeps its blocks)."""
    trimmed, before, after = run(0.99)
    assert not trimmed
    assert abs(before - after) < 20e6


def test_off_without_the_tuned_allocator(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_MALLOC", "off")
    assert trim_freed_memory(0.0) is False
