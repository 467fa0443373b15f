"""The K controller's decisions: adaptive K by the cost model, the fallback test and its probes."""
from __future__ import annotations

import math
import random

import pytest

from draftsmith.eval.decoding.cost import expected_tokens_constant
from draftsmith.eval.decoding.k_controller import KController


def test_adaptive_k_takes_the_cost_models_best_by_hand():
    # one step drafting 2, accepting 1: a = (1 + 1) / (2 + 2) = 0.5, t_d = 1 ms, verify flat 50 ms:
    # E_K / (K t_d + 50 ms) = 29.4, 33.7, 35.4, 35.9, 35.8, ... per second: K = 4
    ctl = KController(k=2, k_max=8, fallback=False)
    ctl.record(depth=2, nodes=2, accepted=1, tokens=2, t_draft=0.002, t_verify=0.05)
    rates = {k: expected_tokens_constant(0.5, k) / (0.001 * k + 0.05) for k in range(1, 9)}
    assert ctl.k == 4 == max(rates, key=rates.get)


def test_adaptive_k_prices_verification_by_fed_tokens():
    # plain step 40 ms (1 token fed), verifying 2 drafts 60 ms (3 tokens): 30 ms + 10 ms per token,
    # so K drafts cost 30 + 10 (K + 1) ms; K = 1 (29.4/s) beats K = 2 (28.2/s)
    ctl = KController(k=2, k_max=8, fallback=False)
    ctl.record_plain(0.04)
    ctl.record(depth=2, nodes=2, accepted=1, tokens=2, t_draft=0.002, t_verify=0.06)
    assert ctl._verify_fit() == pytest.approx((0.03, 0.01))
    assert ctl.k == 1


def test_fixed_and_zero_k():
    ctl = KController(k=3, adaptive=False, fallback=False)
    for _ in range(5):
        ctl.record(depth=3, nodes=3, accepted=3, tokens=4, t_draft=0.0, t_verify=0.05)
        assert ctl.next_k() == 3
    plain = KController(k=0)
    assert [plain.next_k() for _ in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="k must be"):
        KController(k=-1)


def test_plain_time_and_the_fallback_test_by_hand():
    ctl = KController(k=2, adaptive=False, fallback=False)
    ctl.record(depth=2, nodes=2, accepted=0, tokens=1, t_draft=0.01, t_verify=0.05)
    assert ctl.t_plain() == 0.05  # no plain step yet: the fastest verify
    for t in (0.04, 0.02, 0.03):
        ctl.record_plain(t)
    assert ctl.t_plain() == 0.03
    for tokens in (1, 2, 1):
        ctl.record(depth=2, nodes=2, accepted=tokens - 1, tokens=tokens, t_draft=0.01,
                   t_verify=0.05)
    # tokens 1, 1, 2, 1: mean 1.25, squared deviations 0.75; pooled with 4 pseudo-steps of
    # variance 0.25: (1 + 0.75) / 8; cost 0.06 / 0.03 = 2.0 plain steps
    upper = 1.25 + 2.0 * math.sqrt((1.75 / 8) / 4)
    assert upper == pytest.approx(1.7177, abs=1e-4)
    assert ctl.is_loss()  # 1.72 tokens per step cannot pay for 2.0 plain steps
    ctl.record_plain(0.06)  # slower plain steps: median 0.05, cost 1.2 plain steps
    ctl.record_plain(0.06)
    ctl.record_plain(0.06)
    assert ctl.t_plain() == pytest.approx(0.05) and not ctl.is_loss()


def _simulate(ctl_kw: dict, dist: list[float], cost: float, requests: int = 150,
              tokens: int = 128) -> tuple[float, float]:
    """Drive the controller with synthetic steps: a speculative step yields 1, 2 or 3 tokens
    with probabilities ``dist`` and costs ``cost`` plain steps. Returns (speedup over plain
    decoding, share of speculative steps), pooled over ``requests`` seeded requests."""
    rng = random.Random(0)
    spent = made = spec = steps = 0.0
    for _ in range(requests):
        ctl = KController(k=2, adaptive=False, **ctl_kw)
        ctl.record_plain(1.0)
        n = 0
        while n < tokens:
            steps += 1
            if ctl.next_k() == 0:
                ctl.record_plain(1.0)
                n, spent = n + 1, spent + 1
                continue
            x = rng.choices([1, 2, 3], dist)[0]
            ctl.record(depth=2, nodes=2, accepted=x - 1, tokens=x, t_draft=0.0, t_verify=cost)
            n, spent, spec = n + x, spent + cost, spec + 1
        made += n
    return made / spent, spec / steps


GOOD = ([0.5, 0.25, 0.25], 1.39)  # 1.75 tokens per step at 1.39 plain steps: 1.26x
USELESS = ([1.0, 0.0, 0.0], 1.3)  # one token per step at 1.3 plain steps: 0.77x


def test_fallback_keeps_a_paying_draft_and_drops_a_useless_one():
    speedup, share = _simulate({}, *GOOD)
    assert share > 0.9 and speedup > 1.2  # speculates on nearly every step: close to 1.26x
    speedup, share = _simulate({}, *USELESS)
    assert share < 0.12 and speedup > 0.96  # falls back: within 4% of plain decoding


def test_twin_the_earlier_rule_drops_a_paying_draft():
    # the earlier rule (mean of the last 8 steps, decided after 3, no noise allowance) falls
    # back on early rejection streaks of a draft that pays
    speedup, share = _simulate({"z": 0.0, "fallback_window": 8}, *GOOD)
    assert share < 0.5 and speedup < 1.15


def test_fallback_waits_for_min_steps():
    ctl = KController(k=2, adaptive=False, probe_every=4)
    lose = {"depth": 2, "nodes": 2, "accepted": 0, "tokens": 1, "t_draft": 0.05, "t_verify": 0.05}
    for _ in range(2):
        ctl.record(**lose)
    assert ctl.next_k() == 2  # two losing steps are not enough to decide (min_steps = 3)
    ctl.record(**lose)
    assert [ctl.next_k() for _ in range(5)] == [0, 0, 0, 0, 2]
    assert ctl.backoff == 1
