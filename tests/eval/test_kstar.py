"""K* on synthetic alphas and costs, and the measured speculation record on a tiny model."""
from __future__ import annotations

import copy
import json

import pytest

from draftsmith.eval.decoding.cost import Costs, choose_kstar, expected_tokens, parse_costs
from draftsmith.eval.decoding.k_controller import KController
from draftsmith.eval.decoding.proposers import DraftLMProposer
from draftsmith.eval.decoding.target_model import Target
from draftsmith.eval.kstar import measure_speculation
from tests.conftest import tiny_llama


def test_expected_tokens_formula():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0  # a zero cuts later positions
    with pytest.raises(ValueError, match="positions"):
        expected_tokens([0.5], 2)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_tokens([1.5], 1)


def test_kstar_free_verify_and_free_draft_takes_the_longest_useful_k():
    # perfect draft, free drafting, verify cost flat -> longest K wins
    k, sp = choose_kstar([1.0] * 6, Costs(1.0, 0.0, {k: 1.0 for k in range(7)}))
    assert k == 6 and sp[6] == pytest.approx(7.0)


def test_kstar_matches_brute_force_on_synthetic_costs():
    alpha = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    t_ar, t_draft = 0.047, 0.006
    t_verify = {0: 0.047, 1: 0.049, 2: 0.051, 4: 0.072, 8: 0.086}
    k, sp = choose_kstar(alpha, Costs(t_ar, t_draft, t_verify))
    brute = {}
    for kk, tv in t_verify.items():
        e, prod = 1.0, 1.0
        for a in alpha[:kk]:
            prod *= a
            e += prod
        brute[kk] = e * t_ar / (kk * t_draft + tv)
    assert sp == pytest.approx(brute)
    assert k == max(brute, key=brute.get)
    assert sp[0] == pytest.approx(1.0)


def test_kstar_is_the_one_a_hand_computed_cost_table_implies():
    """alpha [0.8, 0.5, 0.5], a plain step 10 ms, a drafted token 1 ms, verifying K drafts
    10 / 11 / 12 / 20 ms. By hand: E[tokens] = 1, 1.8, 2.2, 2.4; speedup = E * 10 / (K * 1 +
    t_verify[K]) = 10/10, 18/12, 22/14, 24/23 = 1.000, 1.500, 1.571, 1.043: K* = 2."""
    k, sp = choose_kstar([0.8, 0.5, 0.5], Costs(10.0, 1.0, {0: 10.0, 1: 11.0, 2: 12.0, 3: 20.0}))
    assert k == 2
    assert [round(sp[i], 3) for i in range(4)] == [1.0, 1.5, 1.571, 1.043]
    # one drafted token dearer (3 ms): 18/14, 22/18, 24/29 = 1.286, 1.222, 0.828 -> K* = 1
    k, sp = choose_kstar([0.8, 0.5, 0.5], Costs(10.0, 3.0, {0: 10.0, 1: 11.0, 2: 12.0, 3: 20.0}))
    assert k == 1 and [round(sp[i], 3) for i in range(4)] == [1.0, 1.286, 1.222, 0.828]


def test_kstar_useless_draft_picks_plain():
    k, sp = choose_kstar([0.0] * 4, Costs(0.05, 0.01, {k: 0.05 + 0.001 * k for k in range(5)}))
    assert k == 0 and all(v < 1 for kk, v in sp.items() if kk)


def test_kstar_ignores_k_without_alpha():
    k, sp = choose_kstar([0.9], Costs(1.0, 0.0, {0: 1.0, 1: 1.0, 2: 1.0}))
    assert set(sp) == {0, 1} and k == 1


def test_controller_shrinks_k_for_poor_acceptance_and_grows_for_good():
    ctl = KController(k=4, k_max=8, fallback=False)
    for _ in range(8):
        ctl.record(depth=ctl.k, nodes=ctl.k, accepted=0, tokens=1, t_draft=0.01 * ctl.k,
                   t_verify=0.05)
    assert ctl.k == 1
    ctl = KController(k=2, k_max=8, fallback=False)
    for _ in range(8):
        ctl.record(depth=ctl.k, nodes=ctl.k, accepted=ctl.k, tokens=ctl.k + 1,
                   t_draft=0.001 * ctl.k, t_verify=0.05)
    assert ctl.k == 8


def test_controller_falls_back_and_probes():
    ctl = KController(k=2, k_max=4, adaptive=False, probe_every=5)
    for _ in range(4):
        assert ctl.next_k() == 2
        ctl.record(depth=2, nodes=2, accepted=0, tokens=1, t_draft=0.02, t_verify=0.05)
    assert [ctl.next_k() for _ in range(6)] == [0, 0, 0, 0, 0, 2]
    # a failed probe doubles the plain stretch (5 -> 10 -> 20, at most 2 doublings here) ...
    lose = {"depth": 2, "nodes": 2, "accepted": 0, "tokens": 1, "t_draft": 0.02, "t_verify": 0.05}
    pay = {"depth": 2, "nodes": 2, "accepted": 2, "tokens": 3, "t_draft": 0.002, "t_verify": 0.055}
    ctl = KController(k=2, k_max=4, adaptive=False, probe_every=5, max_backoff=2)
    for _ in range(4):
        ctl.record(**lose)
    stretches = []
    for _ in range(4):
        n = 0
        while ctl.next_k() == 0:
            n += 1
        stretches.append(n)
        ctl.record(**lose)  # the probe loses again
    assert stretches == [5, 10, 20, 20]
    # ... and a window that pays ends the backoff: the next fallback starts at probe_every again
    ctl.record_plain(0.05)
    for _ in range(8):
        ctl.record(**pay)
    assert ctl.backoff == 0
    while ctl.backoff == 0:
        ctl.record(**lose)
    assert ctl.plain_left == 5


def test_measure_speculation_record():
    model = tiny_llama(seed=0, vocab=64)
    rec = measure_speculation(Target(model), DraftLMProposer(copy.deepcopy(model), 64),
                              [[1, 5, 9, 13], [1, 7, 8]], k_max=3, max_new_tokens=9, repeats=3,
                              min_reached=1)
    assert rec["alpha"] == [1.0, 1.0, 1.0]  # the draft is the target itself (greedy)
    costs = rec["costs"]  # the shape eval/report.py reads
    # K* and the expected speedups are those the record's own alpha and costs imply
    k, sp = choose_kstar(rec["alpha"], parse_costs(costs))
    assert rec["k_star"] == k
    assert rec["expected_speedup"] == pytest.approx({str(i): v for i, v in sp.items()}, rel=1e-3)
    assert set(rec["expected_speedup"]) == {"0", "1", "2", "3"}
    assert costs["t_ar"] > 0 and costs["t_draft"] > 0
    assert set(costs["t_verify"]) == {"0", "1", "2", "3"} and costs["t_verify_tree"] == {}
    assert rec["dtype"] == "float32" and "torch" in rec["versions"]
    assert rec["hardware"]["cpu"] and rec["date"]
    json.dumps(rec)  # serialisable as speculation.json


def test_rarely_reached_positions_do_not_choose_k_star():
    model = tiny_llama(seed=0, vocab=64)
    rec = measure_speculation(Target(model), DraftLMProposer(copy.deepcopy(model), 64),
                              [[1, 5, 9, 13]], k_max=3, max_new_tokens=9, repeats=2,
                              min_reached=1000)
    # no position was reached 1000 times: only position 1 is kept, K* is chosen from it alone
    assert len(rec["alpha"]) == 1 and len(rec["alpha_all"]) == 3
    assert set(rec["expected_speedup"]) == {"0", "1"}
    assert rec["k_star"] == choose_kstar(rec["alpha"], parse_costs(rec["costs"]))[0]


def test_measure_speculation_times_tree_verification():
    model = tiny_llama(seed=0, vocab=64)
    rec = measure_speculation(Target(model), DraftLMProposer(copy.deepcopy(model), 64), [[1, 5, 9]],
                              k_max=2, max_new_tokens=6, repeats=2, tree_nodes=[5, 12])
    assert set(rec["costs"]["t_verify_tree"]) == {"5", "12"}
    assert all(t > 0 for t in rec["costs"]["t_verify_tree"].values())


def test_measure_speculation_refuses_a_k_the_draft_cannot_reach():
    model = tiny_llama(seed=0, vocab=64)
    with pytest.raises(ValueError, match="k_max"):
        measure_speculation(Target(model), DraftLMProposer(copy.deepcopy(model), 64), [[1, 5]],
                            k_max=0, max_new_tokens=4, repeats=1)
