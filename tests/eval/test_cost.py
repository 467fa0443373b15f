"""The one cost model: hand-computed E_K, speedups and K*, and the sweep report's predicted curve
equal to the expected speedups eval/measure.py records for the same speculation.json."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from draftsmith.eval import report, report_rows
from draftsmith.eval.decoding.cost import (
    Costs,
    best_k,
    choose_kstar,
    expected_speedups,
    expected_tokens,
    expected_tokens_constant,
    parse_costs,
    speedup,
)
from draftsmith.eval.decoding.proposers import DraftLMProposer
from draftsmith.eval.decoding.target_model import Target
from draftsmith.eval.kstar import measure_speculation
from tests.conftest import tiny_llama

ALPHA = [0.8, 0.5, 0.25]
COSTS = Costs(t_ar=0.05, t_draft=0.01, t_verify={0: 0.05, 1: 0.06, 2: 0.07, 3: 0.08})


def test_expected_tokens_by_hand():
    assert expected_tokens(ALPHA, 0) == 1.0
    assert expected_tokens(ALPHA, 1) == pytest.approx(1.8)
    assert expected_tokens(ALPHA, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens(ALPHA, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert expected_tokens_constant(0.5, 0) == 1.0
    assert expected_tokens_constant(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_constant(0.5, 3) == expected_tokens([0.5] * 3, 3)
    with pytest.raises(ValueError, match="positions"):
        expected_tokens(ALPHA, 4)


def test_speedups_by_hand():
    sp = expected_speedups(ALPHA, COSTS)
    assert list(sp) == [0, 1, 2, 3]
    assert sp == pytest.approx({0: 1.0, 1: 1.8 * 0.05 / 0.07, 2: 2.2 * 0.05 / 0.09,
                                3: 2.3 * 0.05 / 0.11})
    assert speedup(2.2, 2, COSTS) == sp[2]
    # K without a verify cost or an alpha is left out; the range is sorted
    assert list(expected_speedups(ALPHA, COSTS, [7, 2, 1, 2])) == [1, 2]
    assert list(expected_speedups([0.9], COSTS)) == [0, 1]
    assert choose_kstar(ALPHA, COSTS) == (1, sp)


def test_costs_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        speedup(2.0, 1, Costs(0.0, 0.01, {1: 0.05}))
    with pytest.raises(ValueError, match="positive"):
        speedup(2.0, 1, Costs(0.05, 0.0, {1: 0.0}))


def test_kstar_ties_go_to_the_smaller_k():
    # position 2 never accepts: K = 1 and K = 2 yield the same tokens at the same (free) draft cost
    k, sp = choose_kstar([1.0, 0.0], Costs(1.0, 0.0, {0: 1.0, 1: 1.0, 2: 1.0}))
    assert sp[1] == sp[2] == 2.0 and k == 1
    assert best_k({3: 1.5, 2: 1.5, 4: 1.2}) == 2
    # a draft that never helps ties with plain decoding: plain wins
    k, sp = choose_kstar([0.0], Costs(1.0, 0.0, {0: 1.0, 1: 1.0}))
    assert sp == {0: 1.0, 1: 1.0} and k == 0


def test_kstar_is_zero_when_nothing_pays():
    k, sp = choose_kstar([0.3, 0.3], Costs(0.05, 0.02, {1: 0.06, 2: 0.07}))  # no K = 0 timing
    assert set(sp) == {1, 2} and all(v < 1 for v in sp.values()) and k == 0
    assert choose_kstar([0.9], Costs(0.05, 0.0, {})) == (0, {})


def test_parse_costs_one_spelling():
    assert parse_costs({"t_ar": 0.05, "t_draft": 0.01, "t_verify": {"0": 0.05, "2": 0.07}}) == (
        0.05, 0.01, {0: 0.05, 2: 0.07})
    assert parse_costs({"t_ar": 0.05, "t_draft": 0.01, "t_verify": [0.05, None, 0.07]}) == (
        0.05, 0.01, {0: 0.05, 2: 0.07})
    for other in ("t_AR", "t_target"):  # the spellings nothing writes are not read
        assert parse_costs({other: 0.05, "t_draft": 0.01, "t_verify": {"1": 0.06}}) is None


def speculation_record(alpha: list[float], t_ar: float, t_draft: float,
                       t_verify: dict[int, float], temperature: float = 0.0) -> dict:
    """A speculation.json as eval/kstar.measure_speculation shapes it (string keys, via JSON)."""
    k_star, sp = choose_kstar(alpha, Costs(t_ar, t_draft, t_verify))
    rec = {"k_star": k_star, "expected_speedup": {str(k): v for k, v in sp.items()},
           "alpha": alpha, "measured": {"k": 8, "temperature": temperature},
           "costs": {"t_ar": t_ar, "t_draft": t_draft,
                     "t_verify": {str(k): v for k, v in t_verify.items()}, "t_verify_tree": {},
                     "unit": "seconds", "statistic": "median of 7", "context_tokens": 64},
           "proposer": "lm", "dtype": "float32", "hardware": {"device": "cpu"}}
    return json.loads(json.dumps(rec))


# Verifying K drafts feeds K + 1 tokens; the forward gets dearer with every token fed.
SPEC = speculation_record([0.54, 0.4, 0.3], t_ar=0.040, t_draft=0.004,
                          t_verify={0: 0.040, 1: 0.042, 2: 0.050, 3: 0.060})


def measured_expectation(spec: dict, ks) -> dict[int, float]:
    return {k: spec["expected_speedup"][str(k)] for k in ks if str(k) in spec["expected_speedup"]}


def test_report_prediction_equals_measure_expectation():
    pred = report_rows.predicted_speedup(SPEC, range(1, 9), temperature=0.0)
    assert list(pred) == [1, 2, 3]
    assert pred == measured_expectation(SPEC, range(1, 9))  # exactly, not approximately
    assert best_k({0: 1.0, **pred}) == SPEC["k_star"]
    # twin: had t_verify(K) meant a forward over K + 2 tokens (indexed K + 1), the numbers differ
    t_ver = {int(k): v for k, v in SPEC["costs"]["t_verify"].items()}
    off_by_one = expected_tokens(SPEC["alpha"], 1) * 0.040 / (0.004 + t_ver[2])
    assert off_by_one != pytest.approx(pred[1], rel=1e-3)
    assert pred[1] == pytest.approx(1.54 * 0.040 / (0.004 + 0.042))


def test_report_prediction_needs_alpha_costs_and_the_measured_temperature():
    assert report_rows.predicted_speedup(SPEC, [1, 2], temperature=1.0) == {}
    assert report_rows.predicted_speedup({**SPEC, "alpha": []}, [1, 2]) == {}
    assert report_rows.predicted_speedup({"alpha": [0.5]}, [1]) == {}
    assert report_rows.predicted_speedup(None, [1]) == {}
    assert report_rows.predicted_speedup(SPEC, [1, 2], temperature=None) == measured_expectation(
        SPEC, [1, 2])


def write_sweep(tmp_path: Path, spec: dict, served_alpha: list[float], kind: str = "lm",
                temperature: float = 0.0) -> None:
    draft = tmp_path / "pkg"
    draft.mkdir(exist_ok=True)
    (draft / "speculation.json").write_text(json.dumps(spec))
    for k in (1, 2, 4, 8):
        settings = {"method": "spec", "draft": str(draft), "k": k, "temperature": temperature,
                    "prompts": "p.jsonl", "limit": 4, "max_new_tokens": 32}
        summary = {"speedup": 1.0 + 0.1 * k, "tokens_per_s": 10.0 + k, "draft_kind": kind,
                   "tree": kind != "lm", "alpha": served_alpha[:k]}
        (tmp_path / f"{kind}-k{k}.json").write_text(json.dumps(
            {"job": {"id": f"{kind}-k{k}", "settings": settings}, "summary": summary,
             "samples": []}))


def drawn_series(tmp_path: Path, monkeypatch) -> list:
    """The speedup-vs-K series the report hands to the plot."""
    drawn: list = []
    monkeypatch.setattr(report.plots, "plot_speedup_vs_k",
                        lambda series, path: drawn.extend(series))
    report.build_report(tmp_path)
    return drawn


def test_report_curve_is_measure_expectation_whatever_the_jobs_served(tmp_path, monkeypatch):
    # the jobs served a much higher alpha than the measuring run (different prompts, adaptive K):
    # the predicted curve still is the speculation.json's expected speedup, not a new number
    write_sweep(tmp_path, SPEC, served_alpha=[0.95] * 8)
    (series,) = drawn_series(tmp_path, monkeypatch)
    assert series.ks == [1, 2, 4, 8] and series.predicted_ks == [1, 2, 3]
    assert dict(zip(series.predicted_ks, series.predicted)) == measured_expectation(SPEC, [1, 2, 3])


@pytest.mark.parametrize("kind, temperature", [("lm-tree", 0.0), ("medusa", 0.0), ("lm", 1.0)])
def test_report_draws_no_chain_prediction_it_cannot_make(tmp_path, monkeypatch, kind, temperature):
    # a tree's per-depth curve is not a chain's; the record is for T = 0 only
    write_sweep(tmp_path, SPEC, served_alpha=[0.9] * 8, kind=kind, temperature=temperature)
    (series,) = drawn_series(tmp_path, monkeypatch)
    assert series.predicted_ks == [] and series.predicted == []


def test_measured_record_and_report_agree_on_a_tiny_model():
    model = tiny_llama(seed=0, vocab=64)
    rec = measure_speculation(Target(model), DraftLMProposer(copy.deepcopy(model), 64),
                              [[1, 5, 9, 13], [1, 7, 8]], k_max=3, max_new_tokens=9, repeats=3,
                              min_reached=1)
    rec = json.loads(json.dumps(rec))  # as read back from speculation.json
    costs = parse_costs(rec["costs"])
    assert costs is not None and costs.t_ar == costs.t_verify[0]
    sp = expected_speedups(rec["alpha"], costs)
    assert {str(k): v for k, v in sp.items()} == rec["expected_speedup"]
    assert choose_kstar(rec["alpha"], costs)[0] == rec["k_star"]
    pred = report_rows.predicted_speedup(rec, range(1, 4), temperature=0.0)
    assert pred == measured_expectation(rec, range(1, 4)) and list(pred) == [1, 2, 3]
