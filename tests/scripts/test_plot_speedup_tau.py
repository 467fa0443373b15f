"""scripts/plot_speedup_tau.py: a run's round cost is its tau over its paired speedup, split by
its own timers; each goal's tau follows from it; bad inputs are refused by name."""
from __future__ import annotations

import csv
import json

import pytest
from omegaconf import OmegaConf

from draftsmith.eval import decode
from draftsmith.scripts import plot_speedup_tau


def _result(path, tau=2.0, speedup=1.6, **summary):
    """A decode.py result: two prompts around the given whole."""
    s = {"tau": tau, "speedup": speedup, "draft_time_s": 1.0, "verify_time_s": 3.0,
         "wall_time_s": 5.0, "k": 3, "tree": False, "prompts": "../x/mt_bench/question.jsonl",
         "temperature": 0.0, "batch_size": 1, **summary}
    samples = [{"tau": 1.5, "speedup": 1.2}, {"tau": 2.5, "speedup": 2.0}]
    path.write_text(json.dumps({"summary": s, "samples": samples}))
    return path


def _cfg(runs, out, **kw):
    return OmegaConf.create({"runs": runs, "out": str(out), "goals": [2.5, 1.8],
                             "projections": {}, "title": "", **kw})


def test_round_cost_split_and_the_tau_each_goal_needs(tmp_path):
    a = _result(tmp_path / "a.json")
    b = _result(tmp_path / "b.json", tau=3.0, speedup=1.5, tree=True, tree_size=8)
    out = tmp_path / "fig" / "svt.png"
    runs = plot_speedup_tau.run(_cfg({"head": str(a), "sibling": str(b)}, out,
                                     projections={"amx": 1.0}))
    head, sib = runs
    assert head.round_cost == pytest.approx(1.25) and sib.round_cost == pytest.approx(2.0)
    assert (head.draft_share, head.verify_share) == pytest.approx((0.25, 0.75))  # 1/5, 3/5 of r
    assert head.tau_for(2.5) == pytest.approx(3.125) and sib.tau_for(1.8) == pytest.approx(3.6)
    assert head.prompts == "mt_bench/question.jsonl" and sib.shape == "tree K 3, 8 nodes"
    assert head.points == [(1.5, 1.2), (2.5, 2.0)]
    md = out.with_suffix(".md").read_text()
    assert ("| head | mt_bench/question.jsonl | 0 | chain K 3 | 2.00 | 1.60x | "
            "1.25 (0.25 + 0.75 + 0.25) | 3.12 | 2.25 |") in md
    assert "| projection: amx | | | | | | 1.00 | 2.50 | 1.80 |" in md
    rows = list(csv.reader(out.with_suffix(".csv").read_text().splitlines()))
    assert rows[0] == ["run", "tau", "speedup", "whole"] and len(rows) == 1 + 2 * 3
    assert rows[3] == ["head", "2.0000", "1.6000", "1"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_real_decode_result_reads_back(decode_setup, tmp_path):
    """The file decode.py writes (paired with plain decoding) is the one this script reads."""
    res = tmp_path / "run.json"
    decode.run_overrides([f"draft={decode_setup['lm']}", f"target_path={decode_setup['target']}",
                          f"prompts={decode_setup['questions']}", "max_new_tokens=8", "limit=2",
                          "temperature=0", "k=2", f"out={res}"])
    (run,) = plot_speedup_tau.run(_cfg([str(res)], tmp_path / "svt.png"))
    summary = json.loads(res.read_text())["summary"]
    assert run.label == "run" and len(run.points) == 2
    assert run.round_cost == pytest.approx(summary["tau"] / summary["speedup"])
    assert 0 < run.draft_share and 0 < run.verify_share
    assert run.draft_share + run.verify_share <= run.round_cost * (1 + 1e-9)


@pytest.mark.parametrize("change,match", [
    ({"speedup": None}, "baseline=true"),
    ({"batch_size": 4}, "batch-one runs"),
])
def test_runs_without_a_paired_speedup_or_at_batch_size_above_one_are_refused(tmp_path, change,
                                                                                match):
    bad = _result(tmp_path / "bad.json", **change)
    with pytest.raises(SystemExit, match=match):
        plot_speedup_tau.run(_cfg([str(bad)], tmp_path / "svt.png"))


def test_bad_files_outputs_and_projections_are_refused(tmp_path):
    good = _result(tmp_path / "good.json")
    (tmp_path / "log.txt").write_text("not json")
    with pytest.raises(SystemExit, match="not a result file of eval/decode.py"):
        plot_speedup_tau.run(_cfg([str(tmp_path / "log.txt")], tmp_path / "svt.png"))
    with pytest.raises(SystemExit, match="a new .png file"):
        plot_speedup_tau.run(_cfg([str(good)], tmp_path / "svt.json"))
    with pytest.raises(SystemExit, match="> 0"):
        plot_speedup_tau.run(_cfg([str(good)], tmp_path / "svt.png", projections={"x": 0}))
    with pytest.raises(SystemExit, match="runs= and out= are required"):
        plot_speedup_tau.run(_cfg([], tmp_path / "svt.png"))
    assert good.read_text().startswith("{") and not (tmp_path / "svt.png").exists()
