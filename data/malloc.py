"""The tuned allocator of the training commands, applied by restarting the process, its safety
valve (freed pages handed back when memory is scarce), and the bounds on the per-shape caches of
a CPU's bf16 matmuls. On the lowest floor (``data``) because feature caching (data/features.py)
calls the valve too, like training.

Standard library only (the valve imports ctypes when it trims): a command calls
:func:`restart_as_command` at the top of its module, before torch and the rest load, so the
restart costs an interpreter start and not the ~5 s of imports (each rank of an ``accelerate
launch`` restarts).
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("draftsmith.distill")

# glibc's malloc serves every block above 32 MiB with a fresh mmap and unmaps it on free, so each
# vocabulary-wide (N, V) temporary of a distillation step (about 400 MB for 2,000 tokens x 49,152
# ids) is page-faulted in anew: on a 2-core CPU that made the elementwise passes of the loss 3-10x
# slower than the memory they read. Keeping freed blocks in the heap instead (no mmap, no trim)
# took a quickstart training step from 1.71 s to 0.74 s (see README, "Training throughput").
TUNED_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
MALLOC_SWITCH = "DRAFTSMITH_MALLOC"  # "off": leave malloc alone; "tuned": already applied
# oneDNN, which runs a CPU's bf16 matmuls, and PyTorch's ideep layer above it each keep what they
# build for every matmul shape (primitives, JIT kernels), up to 1,024 shapes by default. Batches of
# varying length bring new row counts every micro-batch, so both caches grew through the run, and
# on the tuned heap their long-lived blocks, scattered among the freed (N, V) temporaries, kept
# resident memory growing step after step (tests/train/test_trim.py: +0.8 MiB a new row count;
# about 0.1 MiB with the caps). 128 shapes still hold a micro-batch's own, which its unrolled
# steps and its backward reuse.
SHAPE_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "128"}


def reexec_with_tuned_malloc() -> None:
    """Restart this process (same argv, same PID) with ``TUNED_MALLOC`` in its environment.

    glibc reads these settings once at start-up, so a running process cannot apply them; the
    training commands call this (:func:`restart_as_command`) before importing torch. A no-op off
    Linux, when ``DRAFTSMITH_MALLOC=off`` (or already ``tuned``), and when the variables are set
    already (the user's own values win).
    """
    if not sys.platform.startswith("linux") or os.environ.get(MALLOC_SWITCH) in ("off", "tuned"):
        return
    if any(k in os.environ for k in TUNED_MALLOC):
        return
    env = {**os.environ, **TUNED_MALLOC, MALLOC_SWITCH: "tuned"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def limit_shape_caches() -> None:
    """Bound oneDNN's and ideep's per-shape caches (``SHAPE_CACHES``), keeping the user's own
    values. Both libraries read their variable when they first build a matmul, so this holds
    for a process that has not run a bf16 matmul yet (and for the processes it starts)."""
    for key, value in SHAPE_CACHES.items():
        os.environ.setdefault(key, value)


def restart_as_command(module_name: str, command: str) -> None:
    """:func:`limit_shape_caches` and :func:`reexec_with_tuned_malloc` when this process was
    started as the command whose module calls this with its ``__name__``: run by path or
    ``python -m`` (``__main__``), or as its console script ``command`` (``draftsmith-distill``,
    whose wrapper imports the module before calling it). A module merely imported by another
    program (tests, the demo) changes nothing in its host."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    if module_name == "__main__" or script == command:
        limit_shape_caches()
        reexec_with_tuned_malloc()


RESIDENT_LIMIT = 0.5  # of physical memory: above it the tuned heap's free blocks are handed back
_trims = {"count": 0}


def trim_freed_memory(limit_fraction: float = RESIDENT_LIMIT) -> bool:
    """Hand the heap's freed pages back to the kernel (glibc ``malloc_trim``) when this process
    holds more than ``limit_fraction`` of the machine's memory; True when it trimmed.

    The tuned allocator keeps every freed block resident so that (N, V) temporaries are not
    page-faulted in anew each step. With a large vocabulary and varying batch shapes those blocks
    fragment the heap and resident memory grows past what is live (Gemma 3's 262,144-id draft LM
    reached 24 GB, the kernel's OOM kill, for an 11.7 GiB estimate; caching Qwen2.5-Coder-1.5B's
    final hidden states and log-normalisers, batches sorted by growing length, reached 24 GB at
    79k of 122k tokens). Trimming returns the free pages only when memory is scarce, so small runs
    keep the speed. Called after every training micro-batch and every feature-cache batch; a
    no-op off Linux or with ``DRAFTSMITH_MALLOC=off``.
    """
    if os.environ.get(MALLOC_SWITCH) != "tuned" or not sys.platform.startswith("linux"):
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * page
    if resident <= limit_fraction * os.sysconf("SC_PHYS_PAGES") * page:
        return False
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    _trims["count"] += 1
    if _trims["count"] == 1:
        log.info("resident memory %.1f GB is over %.0f%% of this machine's: freed heap pages are "
                 "handed back after each batch from now on (data/malloc.py "
                 "trim_freed_memory)", resident / 1e9, 100 * limit_fraction)
    return True
