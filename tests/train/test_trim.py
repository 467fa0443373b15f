"""The tuned allocator's safety valve: freed heap pages go back to the kernel once the process
holds more than its share of memory, and stay resident below it (the speed the tuning buys). And
the bounded per-shape caches of bf16 matmuls: new row counts do not grow a training command."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from draftsmith.data.malloc import MALLOC_SWITCH, SHAPE_CACHES, TUNED_MALLOC, trim_freed_memory

# Under the tuned allocator: allocate 40 blocks of 8 MB, free every other one with a live block
# between (fragments the heap: nothing at its top to release), then call the valve.
SCRIPT = """
import os
import torch
from draftsmith.data.malloc import trim_freed_memory

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


# A training command's first lines (train/distill.py), then bf16 matmuls of 200 row counts (the
# caches fill) and of 300 more, as varying batch lengths bring them: resident memory grown over
# the last 300.
SHAPES = """
import os
from draftsmith.data.malloc import restart_as_command

restart_as_command("__main__", "draftsmith-distill")
import torch

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.set_num_threads(1)
w = torch.randn(512, 512, dtype=torch.bfloat16)
for rows in range(1, 501):
    if rows == 201:
        before = resident()
    torch.nn.functional.linear(torch.randn(rows, 512, dtype=torch.bfloat16), w)
print(os.environ["DRAFTSMITH_MALLOC"], resident() - before)
"""


def growth_over_new_shapes(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in (MALLOC_SWITCH, *SHAPE_CACHES)}
    out = subprocess.run([sys.executable, "-c", SHAPES], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "tuned"  # it ran as the command runs: restarted with the tuned allocator
    return int(out[1])


bf16_onednn = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="bf16 matmuls run through oneDNN (Linux, a CPU with bf16 support)")


@pytest.mark.slow
@bf16_onednn
def test_new_row_counts_do_not_grow_a_training_command():
    # capped: 0.1 MiB a row count with avx512_bf16, 0.15 MiB with AMX (43-45 MB over the 300);
    # uncapped (the twin): 0.6-0.85 MiB a row count (253 MB on the AMX CPU)
    assert growth_over_new_shapes() < 80e6


@pytest.mark.slow
@bf16_onednn
def test_with_the_libraries_default_caches_new_row_counts_grow_it():
    """The twin: the caches at oneDNN's and ideep's default (1,024 shapes) grow by each shape."""
    assert growth_over_new_shapes(**dict.fromkeys(SHAPE_CACHES, "1024")) > 100e6
