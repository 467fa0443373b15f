"""llama.cpp's own programs for the CPU, built once from the vendored llama.cpp of the pinned
llama-cpp-python sdist (``scripts/engine_envs.py``: ``llama_cpp_sources``), the first time
``scripts/engines.py`` runs the engine ``llama_server``.

``llama-server`` (the engine ``llama_server`` in ``scripts/engines.py``) and
``llama-speculative-simple`` drive llama.cpp's EAGLE-3 and DFlash drafts, which the Python
binding does not. The build goes to ``<engines_dir>/llama.cpp/build`` (configure with Ninja,
Release, ``-march=native``; about 200 compile units: 15-30 minutes on two idle cores), its
output to ``build.log`` beside it, with a progress line every tenth of the units; a stamp that
records the sdist and the flags makes later calls reuse it, and a lock makes concurrent callers
wait for one build. A build that stopped halfway resumes where it stopped (Ninja).

On a CPU with AMX, ``-march=native`` routes Q4_0 / Q4_1 / Q8_0 and K-quant weights through
``ggml_backend_amx_mul_mat``, which crashes in this llama.cpp (ggml-org/llama.cpp#20824): the
engines run F32 targets and drafts only, and start the server with ``--no-repack``, which keeps
weights out of the AMX (and other repacked) buffers whatever their type.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from draftsmith.data.cache_lock import make_once
from draftsmith.scripts.engine_envs import (
    ENGINES_DIR,
    LLAMA_CPP_DIR,
    LLAMA_CPP_SDIST,
    EngineUnavailable,
    llama_cpp_sources,
    note,
)

PROGRAMS = ("llama-server", "llama-speculative-simple")
CMAKE_FLAGS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF")
BUILT = ".draftsmith-built"  # in the build folder: the sdist, flags and programs it was made with
PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def build_dir(root: Path = ENGINES_DIR) -> Path:
    return root / LLAMA_CPP_DIR / "build"


def programs(root: Path = ENGINES_DIR) -> dict[str, Path]:
    """Where each built program lies (built or not)."""
    return {p: build_dir(root) / "bin" / p for p in PROGRAMS}


def _recipe() -> str:
    return json.dumps({"sdist": "==".join(LLAMA_CPP_SDIST), "flags": list(CMAKE_FLAGS),
                       "programs": list(PROGRAMS)}, sort_keys=True)


def built(root: Path = ENGINES_DIR) -> bool:
    """Whether the programs were built from this sdist with these flags."""
    stamp = build_dir(root) / BUILT
    return (stamp.is_file() and stamp.read_text() == _recipe()
            and all(p.is_file() for p in programs(root).values()))


def ensure_built(root: Path = ENGINES_DIR, jobs: int | None = None) -> dict[str, Path]:
    """The programs, built on first use (progress shown, ``build.log`` kept) and reused after.

    Raises:
        EngineUnavailable: the sources could not be fetched or the build failed (the log's tail
            in the message).
    """
    make_once(lambda: built(root), lambda: _build(root, jobs or os.cpu_count() or 2),
              root / ".llama.cpp-build.lock")
    return programs(root)


def _build(root: Path, jobs: int) -> None:
    src = llama_cpp_sources(root)
    out = build_dir(root)
    log_path = out.parent / "build.log"
    out.mkdir(parents=True, exist_ok=True)
    (out / BUILT).unlink(missing_ok=True)
    note(f"building {', '.join(PROGRAMS)} from {src} into {out} with {jobs} jobs "
         f"(15-30 minutes on two idle cores, once; log: {log_path})")
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: configure and build\n")
        log.flush()
        _run(["cmake", "-S", str(src), "-B", str(out), *CMAKE_FLAGS], log, log_path, t0)
        _run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *PROGRAMS], log,
             log_path, t0)
    missing = [str(p) for p in programs(root).values() if not p.is_file()]
    if missing:
        raise EngineUnavailable(f"the llama.cpp build ended without {missing}; see {log_path}")
    (out / BUILT).write_text(_recipe())
    note(f"llama.cpp built in {(time.monotonic() - t0) / 60:.1f} min")


def _run(cmd: list[str], log, log_path: Path, t0: float) -> None:
    """Run ``cmd`` with its output into ``log``; a progress line per tenth of Ninja's units."""
    shown = -1
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = PROGRESS.match(line)
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                tenth = 10 * done // max(total, 1)
                if tenth > shown:
                    shown = tenth
                    note(f"llama.cpp build {done}/{total} units "
                         f"({(time.monotonic() - t0) / 60:.1f} min)")
        rc = proc.wait()
    log.flush()
    if rc:
        tail = log_path.read_text()[-3000:]
        raise EngineUnavailable(f"{' '.join(cmd[:3])} ... failed (exit {rc}); the end of "
                                f"{log_path}:\n{tail}")
