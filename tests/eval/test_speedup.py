"""The one paired speedup (eval/speedup.py): per unit the method's median tokens/s over the
baseline's median, then the median over units."""
from __future__ import annotations

import pytest

from draftsmith.eval.speedup import paired_speedup


def test_the_speedup_is_the_median_of_per_prompt_ratios():
    fast, base = [10.0, 20.0, 15.0], [5.0, 10.0, 5.0]
    res = paired_speedup(fast, base)
    assert res.per_unit == [2.0, 2.0, 3.0] and res.median == 2.0
    assert paired_speedup(fast[:2], base[1:]).median == 2.5  # ratios 1, 4: the middle of two
    assert res.spread == (2.0, 3.0) and res.base_drift == [0.0] * 3


def test_repeated_runs_count_by_their_median_and_the_baseline_drift_is_their_range():
    # plain before and after: the ratio is over their mean, the drift |a - b| / mean(a, b)
    res = paired_speedup([4.0], [[1.0, 3.0]])
    assert res.per_unit == [2.0] and res.base_drift == [1.0]
    # rounds: medians on both sides; one slow round of the method does not move it
    res = paired_speedup([[6.0, 1.0, 6.0]], [[3.0, 3.0, 2.0, 3.0]])
    assert res.median == 2.0 and res.base_drift == [pytest.approx(1 / 3)]


def test_a_unit_whose_baseline_took_no_time_has_no_ratio():
    res = paired_speedup([10.0, 20.0], [0.0, 10.0])
    assert res.per_unit == [None, 2.0] and res.ratios == [2.0] and res.median == 2.0
    none = paired_speedup([10.0], [0.0])
    assert (none.median, none.spread, none.base_drift) == (None, None, [0.0])


def test_twin_pooled_tokens_per_s_are_not_the_paired_speedup():
    """A prompt-by-prompt speedup of 2x, measured on prompts of very different speeds: pooling
    the tokens/s before dividing (what the pairing replaces) lets the fast prompt decide."""
    fast, base = [100.0, 2.0, 2.0], [100.0, 1.0, 1.0]
    assert paired_speedup(fast, base).median == 2.0
    assert sum(fast) / sum(base) == pytest.approx(1.02, abs=0.01)


def test_both_sides_need_the_same_units():
    with pytest.raises(ValueError, match="same units"):
        paired_speedup([1.0, 2.0], [1.0])
