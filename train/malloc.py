"""The tuned allocator of the training commands, applied by restarting the process.

Standard library only: a command calls :func:`restart_as_command` at the top of its module,
before torch and the rest load, so the restart costs an interpreter start and not the ~5 s of
imports (each rank of an ``accelerate launch`` restarts).
"""
from __future__ import annotations

import os
import sys

# glibc's malloc serves every block above 32 MiB with a fresh mmap and unmaps it on free, so each
# vocabulary-wide (N, V) temporary of a distillation step (about 400 MB for 2,000 tokens x 49,152
# ids) is page-faulted in anew: on a 2-core CPU that made the elementwise passes of the loss 3-10x
# slower than the memory they read. Keeping freed blocks in the heap instead (no mmap, no trim)
# took a quickstart training step from 1.71 s to 0.74 s (see README, "Training throughput").
TUNED_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
MALLOC_SWITCH = "DRAFTSMITH_MALLOC"  # "off": leave malloc alone; "tuned": already applied


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


def restart_as_command(module_name: str, command: str) -> None:
    """:func:`reexec_with_tuned_malloc` when this process was started as the command whose
    module calls this with its ``__name__``: run by path or ``python -m`` (``__main__``), or as
    its console script ``command`` (``draftsmith-distill``, whose wrapper imports the module
    before calling it). A module merely imported by another program (tests, the demo) does not
    restart its host."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    if module_name == "__main__" or script == command:
        reexec_with_tuned_malloc()
