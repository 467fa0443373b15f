"""scripts/llama_cpp_build.py's bookkeeping with a stand-in cmake: one build, progress lines,
the log, the stamp that makes later calls reuse it, and a failed build's message. The real build
runs in ``make engines`` (engine ``llama_server``)."""
from __future__ import annotations

import os
import stat

import pytest

from draftsmith.scripts import llama_cpp_build
from draftsmith.scripts.engine_envs import EngineUnavailable

FAKE_CMAKE = """#!/bin/sh
# a stand-in cmake: configure does nothing; --build prints Ninja's progress and makes the programs
if [ "$1" = "--build" ]; then
  echo "$*" >> "$2/../builds"
  [ -n "$FAIL_BUILD" ] && { echo "error: no compiler"; exit 1; }
  i=1; while [ $i -le 20 ]; do echo "[$i/20] Building CXX object $i.o"; i=$((i+1)); done
  mkdir -p "$2/bin"; touch "$2/bin/llama-server" "$2/bin/llama-speculative-simple"
fi
"""


@pytest.fixture
def fake_cmake(tmp_path, monkeypatch):
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    cmake = bin_dir / "cmake"
    cmake.write_text(FAKE_CMAKE)
    cmake.chmod(cmake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.setattr(llama_cpp_build, "llama_cpp_sources", lambda root: src)
    return tmp_path / "engines"


def test_llama_cpp_builds_once_with_progress_and_a_log(fake_cmake, capsys):
    root = fake_cmake
    assert not llama_cpp_build.built(root)
    progs = llama_cpp_build.ensure_built(root, jobs=2)
    assert set(progs) == {"llama-server", "llama-speculative-simple"}
    assert all(p.is_file() for p in progs.values())
    out = capsys.readouterr().out
    assert "llama.cpp build 2/20 units" in out and "llama.cpp build 20/20 units" in out
    assert out.count(" units (") == 11  # the first unit, then a line per tenth of them
    assert "[20/20] Building CXX object 20.o" in (root / "llama.cpp" / "build.log").read_text()
    llama_cpp_build.ensure_built(root)  # stamped: reused
    assert (root / "llama.cpp" / "builds").read_text().count("--build") == 1
    # a stamp from other flags is not this build: built again
    (llama_cpp_build.build_dir(root) / llama_cpp_build.BUILT).write_text("{}")
    llama_cpp_build.ensure_built(root)
    assert (root / "llama.cpp" / "builds").read_text().count("--build") == 2


def test_a_failed_llama_cpp_build_says_why_and_leaves_no_stamp(fake_cmake, monkeypatch):
    monkeypatch.setenv("FAIL_BUILD", "1")
    with pytest.raises(EngineUnavailable, match="(?s)exit 1.*error: no compiler"):
        llama_cpp_build.ensure_built(fake_cmake)
    assert not llama_cpp_build.built(fake_cmake)
