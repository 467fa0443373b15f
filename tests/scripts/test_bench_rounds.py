"""scripts/bench_rounds.py on a tiny target: every round logged and split into draft, verify and
bookkeeping against plain decoding's step, the profiler's phases, the stored tables."""
from __future__ import annotations

import json

import pytest
from conftest import draft_package
from omegaconf import OmegaConf

from draftsmith.eval.decoding.stats import RoundTime
from draftsmith.scripts import bench_rounds


def test_round_anatomy_on_a_tiny_target(decode_setup, tmp_path):
    pkg, _ = draft_package(decode_setup, "eagle")
    cfg = OmegaConf.merge(OmegaConf.load(bench_rounds.CONF_FILE), {
        "questions": str(decode_setup["questions"]), "limit": 2, "max_new_tokens": 8,
        "draft": str(pkg), "methods": list(bench_rounds.METHODS), "adaptive_k": False,
        "target_path": str(decode_setup["target"]), "dtype": "float32", "name": "tiny",
        "out_dir": str(tmp_path / "rounds")})
    entry = bench_rounds.run(cfg)
    rows = {r["method"]: r for r in entry["methods"]}
    assert set(rows) == {"lookup", "suffix", "draft", "hybrid"}
    assert rows["draft"]["suffix_rounds"] is None and sum(rows["hybrid"]["suffix_rounds"].values())
    eagle = rows["draft"]
    # fixed K: every round drafts but a prompt's last token (the budget leaves no room)
    assert 0 < eagle["speculative_rounds"] and eagle["rounds"] - eagle["speculative_rounds"] <= 2
    assert eagle["draft_ms"] > 0 and eagle["verify_ms"] > 0 and eagle["bookkeeping_ms"] > 0
    assert eagle["overhead_of_plain_step"] == pytest.approx(
        (eagle["draft_ms"] + eagle["bookkeeping_ms"]) / eagle["plain_step_ms"])
    assert eagle["matches_plain"] == 1.0  # greedy, fp32: lossless
    phases = eagle["profile"]["phase_ms_per_round"]
    assert set(phases) == set(bench_rounds.PHASES) and phases["verify"] > 0
    assert eagle["profile"]["top_ops_ms_per_round"]["verify"]  # the target's ops were seen
    # a second name is added beside the first; the same name replaces its entry
    cfg.name, cfg.profile, cfg.methods = "again", False, ["lookup"]
    bench_rounds.run(cfg)
    stored = json.loads((tmp_path / "rounds" / "results.json").read_text())
    assert set(stored) == {"tiny", "again"}
    cfg.name, cfg.merge, cfg.methods = "tiny", True, ["suffix"]  # one row replaced, others kept
    bench_rounds.run(cfg)
    stored = json.loads((tmp_path / "rounds" / "results.json").read_text())
    assert [r["method"] for r in stored["tiny"]["methods"]] == list(bench_rounds.METHODS)
    assert stored["tiny"]["methods"][1]["date"] >= stored["tiny"]["methods"][0]["date"]
    cfg.name, cfg.merge, cfg.methods, cfg.tree = "chain", False, ["draft"], "chain"
    assert bench_rounds.run(cfg)["methods"][0]["draft_kind"] == "eagle"
    cfg.tree = "tree"
    assert bench_rounds.run(cfg)["methods"][0]["draft_kind"] == "eagle-tree"
    md = (tmp_path / "rounds" / "results.md").read_text()
    assert "## tiny:" in md and "## again:" in md  # no record: a chain
    assert "| draft (eagle, fused step) |" in md  # the fused draft step by default


def test_summary_takes_speculative_rounds_against_the_plain_step():
    plain = [RoundTime(0, 0, 0, 1, 0.0, 0.010, 0.011)] * 3
    rounds = [RoundTime(2, 2, 1, 2, 0.002, 0.012, 0.015), RoundTime(0, 0, 0, 1, 0, 0.01, 0.5)]
    s = bench_rounds.summarize(rounds, plain)
    assert s["speculative_rounds"] == 1 and s["rounds"] == 2  # the plain round is left out
    assert s["plain_step_ms"] == pytest.approx(11.0)
    assert s["bookkeeping_ms"] == pytest.approx(1.0)
    assert s["overhead_of_plain_step"] == pytest.approx(3.0 / 11.0)


def test_settings_are_checked_before_loading(decode_setup, tmp_path):
    cfg = OmegaConf.merge(OmegaConf.load(bench_rounds.CONF_FILE), {
        "questions": str(decode_setup["questions"]), "methods": ["lookup", "medusa"],
        "out_dir": str(tmp_path / "rounds")})
    with pytest.raises(ValueError, match="methods"):
        bench_rounds.run(cfg)
    cfg.methods, cfg.draft = ["draft"], None
    with pytest.raises(ValueError, match="nothing to run"):
        bench_rounds.run(cfg)
    cfg.draft = str(draft_package(decode_setup, "eagle")[0])
    for key, value, says in (("tree", "bush", "bush"), ("compile_draft", "maybe", "compile_draft")):
        bad = OmegaConf.merge(cfg, {key: value})
        with pytest.raises(ValueError, match=says):
            bench_rounds.run(bad)
