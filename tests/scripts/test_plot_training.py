"""scripts/plot_training.py: the plotted points are the run's validations against its tokens."""
from __future__ import annotations

import csv
import json
import math

import pytest

from draftsmith.scripts import plot_training


def _log(path, vals):
    lines = [{"step": 0, "tag": "init", "alpha_hat": [0.01, 0.0]}]
    for step, tokens, a in vals:
        lines.append({"step": step, "loss": 1.0, "tokens": tokens, "elapsed_s": 1.0})
        lines.append({"step": step, "tag": "val", "alpha_hat": a, "top1": a})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_curve_pairs_each_validation_with_the_tokens_trained_by_then(tmp_path):
    _log(tmp_path / "train_log.jsonl", [(10, 1000, [0.2, 0.1]), (20, 10000, [0.3, 0.2]),
                                        (30, 100000, [0.4, 0.3])])
    pts = plot_training.curve(tmp_path / "train_log.jsonl")
    assert [(p["step"], p["tokens"]) for p in pts] == [(0, 0), (10, 1000), (20, 10000),
                                                       (30, 100000)]
    a, b = plot_training.log_fit(pts, 0)
    assert b == pytest.approx(0.1) and a + b * math.log10(1e6) == pytest.approx(0.5)
    fits = plot_training.plot(pts, tmp_path / "a.png", "run")
    assert fits[0]["at_10x"] == pytest.approx(0.5) and fits[1]["at_10x"] == pytest.approx(0.4)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.reader((tmp_path / "a.csv").read_text().splitlines()))
    assert rows[0] == ["step", "tokens", "alpha_hat_pos1", "alpha_hat_pos2"]
    assert [float(x) for x in rows[-1][2:]] == [0.4, 0.3]


def test_a_resumed_run_chains_its_token_counts(tmp_path):
    """A run killed after step 40 and resumed from its step-20 checkpoint: the old log restarts
    its count (the redone steps 30-40 replace the lost ones); a newer log has tokens_total."""
    recs = [{"step": 0, "tag": "init", "alpha_hat": [0.0]}]
    for step in (10, 20, 30, 40):  # 100 tokens per step
        recs.append({"step": step, "tokens": 100 * step})
        recs.append({"step": step, "tag": "val", "alpha_hat": [step / 100]})
    for step in (30, 40, 50):  # resumed at 20, 90 tokens per step now
        recs.append({"step": step, "tokens": 90 * (step - 20)})
        recs.append({"step": step, "tag": "val", "alpha_hat": [step / 200]})
    (tmp_path / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    pts = plot_training.curve(tmp_path / "train_log.jsonl")
    assert [(p["step"], p["tokens"]) for p in pts] == [
        (0, 0), (10, 1000), (20, 2000), (30, 2900), (40, 3800), (50, 4700)]
    assert pts[3]["alpha_hat"] == [0.15]  # the resumed run's validation, not the lost one
    new = [{**r, "tokens_total": 2000 + r["tokens"]} if "tokens" in r and i > 8 else r
           for i, r in enumerate(recs)]
    assert plot_training.trained_tokens(new)[50] == 2000 + 2700


def test_a_log_without_token_counts_is_refused(tmp_path):
    (tmp_path / "train_log.jsonl").write_text(json.dumps(
        {"step": 0, "tag": "init", "alpha_hat": [0.0]}) + "\n")
    with pytest.raises(ValueError, match="log_every"):
        plot_training.curve(tmp_path / "train_log.jsonl")


def test_compare_extrapolates_each_run_to_the_goal(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir(), slow.mkdir()
    # fast: alpha-hat = 0.1 log10(tokens) - 0.1 (0.2, 0.3, 0.4) -> 0.7 at 1e8 tokens;
    # slow: flat after its first validation -> no extrapolation
    _log(fast / "train_log.jsonl", [(10, 1000, [0.2, 0.1]), (20, 10000, [0.3, 0.2]),
                                    (30, 100000, [0.4, 0.3])])
    _log(slow / "train_log.jsonl", [(10, 1000, [0.1, 0.1]), (20, 10000, [0.05, 0.1]),
                                    (30, 100000, [0.05, 0.1])])
    fits = plot_training.compare([fast, slow], tmp_path / "c.png", goal=0.7)
    assert fits[0]["tokens_for_goal"] == pytest.approx(1e8, rel=1e-6)
    assert fits[0]["alpha_hat"] == pytest.approx(0.4) and fits[0]["tokens"] == 100000
    assert fits[1]["b_per_decade"] == pytest.approx(0.0) and fits[1]["tokens_for_goal"] is None
    rows = list(csv.reader((tmp_path / "c.csv").read_text().splitlines()))
    assert rows[0] == ["run", "step", "tokens", "alpha_hat_pos1"] and len(rows) == 7
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
