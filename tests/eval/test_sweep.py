"""Sweeps with fake decoders: job naming, resume after a kill, failures, Hydra multirun, peers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftsmith.eval import CONF_DIR
from draftsmith.eval.sweep import Isolate, run_job, run_sweep, task
from draftsmith.eval.sweep_jobs import is_done, job_id, job_stem, normalize_settings

REPO = Path(__file__).resolve().parents[2]


def fake_result(settings: dict) -> dict:
    k = settings.get("k") or 0
    alpha = [0.9 - 0.1 * i for i in range(k)]
    return {"summary": {"tau": 1 + sum(alpha), "tokens_per_s": 10.0 + k, "speedup": 1 + 0.1 * k,
                        "alpha": alpha, "k": k, "temperature": settings.get("temperature")},
            "samples": [{"id": 0, "category": "c", "output_ids": [1, 2], "tau": 1.0}]}


class CountingRunner:
    """A fake decoder that records its calls; can be told to fail or to 'be killed'."""

    def __init__(self, fail_k: int | None = None, kill_after: int | None = None) -> None:
        self.calls: list[dict] = []
        self.fail_k, self.kill_after = fail_k, kill_after

    def __call__(self, settings: dict) -> dict:
        if self.kill_after is not None and len(self.calls) == self.kill_after:
            raise KeyboardInterrupt  # what a kill (Ctrl-C / SIGINT) looks like in-process
        self.calls.append(settings)
        if settings.get("k") == self.fail_k:
            raise RuntimeError(f"decoder exploded at k={self.fail_k}")
        return fake_result(settings)


def grid(ks=(1, 2, 4, 8), temps=(0.0,)) -> list[dict]:
    return [{"draft": "lookup", "k": k, "temperature": t, "limit": 2} for t in temps for k in ks]


def test_normalize_and_stable_ids(tmp_path):
    a = normalize_settings({"method": "hf_generate", "k": 4, "temperature": 0})
    b = normalize_settings({"method": "hf_generate", "k": 8, "temperature": 0.0, "draft": "x"})
    assert job_id(a) == job_id(b)  # hf_generate ignores draft and K: one job, not two
    p1 = normalize_settings({"draft": "none", "k": 1})
    p2 = normalize_settings({"draft": None, "k": 4})
    assert job_id(p1) == job_id(p2)
    s1 = normalize_settings({"draft": "lookup", "k": 1})
    s2 = normalize_settings({"draft": "lookup", "k": 2})
    assert job_id(s1) != job_id(s2)
    assert job_stem(s1) == job_stem(normalize_settings({"draft": "lookup", "k": "1"}))
    assert normalize_settings({"method": "hf_assisted", "draft": "none", "k": 2}) is None
    with pytest.raises(ValueError, match="method="):
        normalize_settings({"method": "beam"})
    with pytest.raises(ValueError, match="k="):
        normalize_settings({"draft": "lookup", "k": "four"})
    # a retrained checkpoint (new manifest) gets a new id at the same path
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "manifest.json").write_text('{"a": 1}')
    before = job_id(normalize_settings({"draft": str(d), "k": 2}))
    (d / "manifest.json").write_text('{"a": 2}')
    assert job_id(normalize_settings({"draft": str(d), "k": 2})) != before


def test_resume_after_kill_reruns_only_missing_jobs(tmp_path):
    first = CountingRunner(kill_after=2)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(grid(), tmp_path, first, isolate=Isolate.NEVER, progress=False,
                  report=False)
    assert len(first.calls) == 2
    done = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(done) == 2
    # a result file cut short by the kill is not a finished job
    stem = job_stem(normalize_settings(grid()[3]))
    (tmp_path / f"{stem}.json").write_text('{"summary": {"tau": 1')
    assert not is_done(tmp_path / f"{stem}.json")
    second = CountingRunner()
    counts = run_sweep(grid(), tmp_path, second, isolate=Isolate.NEVER, progress=False,
                       report=False)
    assert [c["k"] for c in second.calls] == [4, 8]
    assert counts == {"skipped": 2, "done": 2}
    third = CountingRunner()
    third_counts = run_sweep(grid(), tmp_path, third, isolate=Isolate.NEVER, progress=False)
    assert third_counts["skipped"] == 4
    assert third.calls == []
    assert len((tmp_path / "report.csv").read_text().strip().splitlines()) == 1 + 4


def test_failing_job_is_recorded_and_sweep_goes_on(tmp_path):
    runner = CountingRunner(fail_k=2)
    counts = run_sweep(grid(), tmp_path, runner, isolate=Isolate.NEVER, progress=False)
    assert counts == {"done": 3, "failed": 1}
    assert [c["k"] for c in runner.calls] == [1, 2, 4, 8]
    (err,) = tmp_path.glob("*.error.json")
    rec = json.loads(err.read_text())
    assert rec["error"]["type"] == "RuntimeError"
    assert "decoder exploded at k=2" in rec["error"]["message"]
    assert "Traceback" in rec["error"]["traceback"]
    assert rec["job"]["settings"]["k"] == 2
    assert "decoder exploded" in (tmp_path / "report.md").read_text()
    # the failed job is retried on rerun; success removes its error file
    retry = CountingRunner()
    assert run_sweep(grid(), tmp_path, retry, isolate=Isolate.NEVER, progress=False)["done"] == 1
    assert [c["k"] for c in retry.calls] == [2]
    assert not list(tmp_path.glob("*.error.json"))


def test_runner_returning_garbage_is_an_error(tmp_path):
    s = normalize_settings({"draft": "lookup", "k": 1})
    assert run_job(s, tmp_path, lambda _: {"summary": 3}, isolate=Isolate.NEVER) == "failed"
    (err,) = tmp_path.glob("*.error.json")
    assert "must return" in json.loads(err.read_text())["error"]["message"]


def test_isolate_is_parsed_once_and_bad_values_are_refused():
    from hydra import compose, initialize_config_dir

    # Hydra reads isolate=true / false as booleans: both spellings give the same member
    assert [Isolate.parse(v) for v in ("auto", True, "true", False, "false")] == [
        Isolate.AUTO, Isolate.ALWAYS, Isolate.ALWAYS, Isolate.NEVER, Isolate.NEVER]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="sweep", overrides=["isolate=sometimes", "draft=lookup"])
    with pytest.raises(ValueError, match=r"isolate='sometimes'.*auto, true, false"):
        task(cfg)


FAKE_MODULE = textwrap.dedent("""
    import os

    def fake(settings):
        threads = None
        if settings.get("threads"):
            import torch
            threads = torch.get_num_threads()
        if settings.get("k") == 3:
            raise RuntimeError("boom at k=3")
        k = settings.get("k") or 0
        return {"summary": {"tau": 1.0 + k, "tokens_per_s": 10.0 + k, "speedup": 1.0 + k / 10,
                            "alpha": [0.5] * k, "pid": os.getpid(),
                            "threads": threads},
                "samples": []}
""")


@pytest.mark.slow
def test_child_process_for_process_level_settings(tmp_path, monkeypatch):
    (tmp_path / "fake_runner.py").write_text(FAKE_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    s = normalize_settings({"draft": "lookup", "k": 2, "threads": 1})
    out = tmp_path / "sweep"
    never = CountingRunner()
    assert run_job(s, out, never, isolate=Isolate.AUTO, runner_spec="fake_runner:fake") == "done"
    assert never.calls == []
    summary = json.loads((out / f"{job_stem(s)}.json").read_text())["summary"]
    assert summary["pid"] != os.getpid() and summary["threads"] == 1
    bad = normalize_settings({"draft": "lookup", "k": 3, "threads": 1})
    status = run_job(bad, out, never, isolate=Isolate.AUTO, runner_spec="fake_runner:fake")
    assert status == "failed"
    err = json.loads((out / f"{job_stem(bad)}.error.json").read_text())["error"]
    assert err["type"] == "JobFailedError" and "boom at k=3" in err["message"]


@pytest.mark.slow
def test_hydra_multirun_end_to_end(tmp_path):
    (tmp_path / "fake_runner.py").write_text(FAKE_MODULE)
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "eval" / "sweep.py"), "-m", "draft=prompt_lookup,none",
           "k=1,2,3", "temperature=0", f"sweep_dir={out}", "runner=fake_runner:fake"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(p.name for p in out.glob("*.json") if not p.name.endswith(".error.json"))
    errors = list(out.glob("*.error.json"))
    # prompt_lookup k=1,2 done, k=3 failed; draft=none collapses to one job
    assert len(results) == 3 and len(errors) == 1
    rows = (out / "report.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 3
    assert "1 failed" in (out / "report.md").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*.json")}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p.exists()
               and not p.name.endswith(".error.json"))


def test_peers_lossless_greedy_and_counted():
    import torch
    from conftest import tiny_llama

    from draftsmith.eval.peers import run_peer_on

    torch.manual_seed(0)
    target = tiny_llama(seed=0)
    prompts = [{"id": i, "category": "c", "prompt_ids": [1, 5 + i, 7, 9, 5 + i]} for i in range(2)]
    plain = run_peer_on(target, prompts, "hf_generate", max_new_tokens=10, warmup=False)
    same = run_peer_on(target, prompts, "hf_assisted", max_new_tokens=10, k=4,
                       schedule="constant", assistant=tiny_llama(seed=0), warmup=False)
    other = run_peer_on(target, prompts, "hf_assisted", max_new_tokens=10, k=3,
                        schedule="heuristic", assistant=tiny_llama(seed=5), warmup=False,
                        baseline=False)
    lookup = run_peer_on(target, prompts, "hf_prompt_lookup", max_new_tokens=10, k=3,
                         warmup=False, baseline=False)
    ref = [s["output_ids"] for s in plain["samples"]]
    for res in (same, other, lookup):
        assert [s["output_ids"] for s in res["samples"]] == ref  # greedy peers are lossless
    assert same["summary"]["speedup"] > 0 and same["summary"]["baseline_tokens_per_s"] > 0
    n = sum(len(r) for r in ref)
    assert plain["summary"]["target_forwards"] == n and plain["summary"]["tau"] == 1.0
    # an identical assistant is always accepted: K+1 tokens per target forward
    assert same["summary"]["tau"] > 2.0
    with pytest.raises(ValueError, match="needs a draft LM"):
        run_peer_on(target, prompts, "hf_assisted", k=2)
