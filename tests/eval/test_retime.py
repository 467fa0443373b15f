"""Re-timing a speculation.json record on the machine at hand (eval/retime.py, retime=)."""
import json
import shutil
from dataclasses import replace

import pytest

from draftsmith.eval import decode
from draftsmith.eval.draft import DraftSettings
from draftsmith.eval.machine import environment
from draftsmith.eval.retime import (
    MARGIN,
    Shape,
    check_retime,
    chosen,
    describe,
    measured_here,
    monotone,
    predict,
)
from draftsmith.heads.package import update_package_json
from tests.conftest import draft_package

ALPHA = [0.8, 0.7, 0.6]


def _record(**extra) -> dict:
    """A record measured elsewhere: a plain step of 10 ms, verify nearly flat, a tree grid."""
    grid = [{"depth": 2, "total_tokens": 8, "tau": 2.4, "tokens_per_s": 2.4 / 0.014},
            {"depth": 3, "total_tokens": 16, "tau": 3.2, "tokens_per_s": 3.2 / 0.016}]
    return {"k_star": 3, "alpha": ALPHA, "dtype": "bfloat16",
            "costs": {"t_ar": 0.010, "t_draft": 0.001,
                      "t_verify": {"0": 0.010, "1": 0.0105, "2": 0.011, "3": 0.0115},
                      "t_verify_tree": {"8": 0.011, "16": 0.012}},
            "tree": {"depth": 3, "total_tokens": 16, "baseline_tokens_per_s": 1 / 0.011,
                     "grid": grid},
            "hardware": {"cpu": "elsewhere", "device": "cpu"}, **extra}


def _local(verify_per_token: float, t_draft: float = 0.001) -> dict:
    """Costs of a machine where a forward of w tokens costs 10 ms + w x ``verify_per_token``."""
    fwd = {k: 0.010 + k * verify_per_token for k in range(4)}
    return {"t_ar": 0.010, "t_draft": t_draft, "t_verify": fwd,
            "t_verify_tree": {n: 0.010 + n * verify_per_token for n in (8, 16)}}


def test_cheap_verification_keeps_the_tree():
    shapes = predict(_record(), _local(0.0001))
    best = shapes[0]
    assert (best.k, best.nodes, best.tokens) == (3, 16, 3.2)
    # the record's own remainder (1 ms a round, 1 ms a plain step) enters both sides
    assert best.speedup == pytest.approx(3.2 * 0.011 / (3 * 0.001 + 0.0116 + 0.001))
    assert [s.speedup for s in shapes] == sorted((s.speedup for s in shapes), reverse=True)
    assert describe(best).startswith("re-timed here: tree 16 nodes, predicted")


def test_expensive_verification_drafts_nothing():
    """The twin: the same record where a verified token costs most of a plain step (bf16
    without bf16 instructions): no shape pays, plain decoding is chosen."""
    shapes = predict(_record(), _local(0.008))
    assert shapes[0].speedup < MARGIN
    assert describe(shapes[0]).endswith("plain decoding")
    # in between, a short chain beats every tree
    mid = predict(_record(), _local(0.003, t_draft=0.0002))[0]
    assert mid.nodes is None and mid.speedup >= MARGIN


def test_the_records_own_shape_stays_unless_another_is_clearly_faster():
    shapes = [Shape(3, 16, 3.2, 2.0), Shape(2, 8, 2.4, 1.95), Shape(1, None, 1.8, 1.5)]
    plan = DraftSettings(k=2, k_source="speculation.json", tree=True, tree_size=8, tree_topk=8,
                         draft_vocab=None)
    assert chosen(plan, shapes) == (shapes[1], True)  # within 5% of the best: kept
    assert describe(shapes[1], True).startswith("re-timed here: the record's tree 8 nodes")
    far = [shapes[0]._replace(speedup=2.4), *shapes[1:]]
    assert chosen(plan, far) == (far[0], False)
    assert chosen(replace(plan, k=7, tree=False), shapes) == (shapes[0], False)  # not measured
    slow = [s._replace(speedup=s.speedup / 1.6) for s in shapes]  # own 1.22x: below MARGIN
    best, kept = chosen(plan, slow)
    assert best.speedup < MARGIN and describe(best, kept).endswith("plain decoding")


def test_chains_only_and_a_record_without_grid():
    rec = _record()
    rec.pop("tree")
    shapes = predict(rec, _local(0.0001))
    assert {s.nodes for s in shapes} == {None} and shapes[0].k == 3
    assert shapes[0].tokens == pytest.approx(1 + 0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.6)
    assert all(s.nodes is None for s in predict(_record(), _local(0.0001), trees=False))


def test_a_stalled_narrow_forward_is_bounded_by_the_wider_ones():
    local = _local(0.0001)
    local["t_verify"][0] = local["t_ar"] = 0.015  # one stall: the 1-token forward timed slow
    fixed = monotone(local)
    assert fixed["t_ar"] == fixed["t_verify"][0] == pytest.approx(0.0101)
    assert [fixed["t_verify"][k] for k in (1, 2, 3)] == [local["t_verify"][k] for k in (1, 2, 3)]
    # the twin: trusted as timed, the stall makes every shape look 1.5x faster than it is
    assert predict(_record(), local)[0].speedup > 1.4 * predict(_record(), fixed)[0].speedup
    # a tree's forward is bounded by the larger trees' (a stalled 8-node tree no longer loses to
    # the 16-node one)
    local["t_verify_tree"][8] = 0.030
    assert monotone(local)["t_verify_tree"] == {8: pytest.approx(0.0116), 16: pytest.approx(0.0116)}


def test_measured_here_needs_the_same_machine_and_dtype():
    here = environment("cpu")["hardware"]
    rec = {"dtype": "float32", "hardware": dict(here)}
    assert measured_here(rec, "float32", "cpu")
    assert not measured_here(rec, "bfloat16", "cpu")
    other_isa = {**here, "isa": [*here["isa"], "another_flag"]}
    assert not measured_here({**rec, "hardware": other_isa}, "float32", "cpu")
    no_isa = {k: v for k, v in here.items() if k != "isa"}  # older records cannot show it
    assert not measured_here({**rec, "hardware": no_isa}, "float32", "cpu")
    assert not measured_here({**rec, "hardware": {**here, "cpu_count": 999}}, "float32", "cpu")


def test_bad_retime_value_is_refused():
    assert check_retime(True) == "true" and check_retime("auto") == "auto"
    with pytest.raises(ValueError, match="retime='sometimes'"):
        check_retime("sometimes")


def _decode(setup, pkg, *extra):
    return decode.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                                 f"prompts={setup['questions']}", "max_new_tokens=10",
                                 "temperature=0", "limit=1", *extra])["summary"]


def test_decode_retimes_a_foreign_record_and_stays_lossless(decode_setup, tmp_path):
    src, _ = draft_package(decode_setup, "eagle")
    pkg = tmp_path / "eagle"
    shutil.copytree(src, pkg)
    rec = {**_record(dtype="float32"), "tree": None}
    update_package_json(pkg, "speculation.json", rec)
    summary = _decode(decode_setup, pkg)
    assert summary["k_source"].startswith("re-timed here: ")
    assert summary["matches_baseline"] == 1.0  # greedy: token-identical to plain decoding
    # trusted as is when asked to, or when K was given
    assert _decode(decode_setup, pkg, "retime=false", "baseline=false")["k_source"] == (
        "speculation.json")
    assert _decode(decode_setup, pkg, "k=2", "baseline=false")["k_source"] == "config"
    # a draft that the record says is never accepted: plain decoding, whatever the timings
    update_package_json(pkg, "speculation.json", {**rec, "alpha": [0.0, 0.0, 0.0]})
    summary = _decode(decode_setup, pkg, "retime=true")
    # (the package waits for its shadow drafts' verdict; suffix chains are drafted meanwhile)
    assert "plain decoding" in summary["k_source"] and summary["matches_baseline"] == 1.0
    assert summary["k"] == 0 or "suffix chains meanwhile" in summary["k_source"]
    with pytest.raises(ValueError, match="retime="):
        _decode(decode_setup, pkg, "retime=maybe")
    assert json.loads((pkg / "speculation.json").read_text())["alpha"] == [0.0, 0.0, 0.0]
