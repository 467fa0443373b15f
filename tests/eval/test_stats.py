"""DecodeStats counting, merging and serialising."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest

from draftsmith.eval.decoding.stats import DecodeStats


def stats_of(steps: list[tuple[int, int]], tokens: int, forwards: int, wall: float,
             reason: str = "max_new_tokens") -> DecodeStats:
    st = DecodeStats(tokens_generated=tokens, target_forwards=forwards, wall_time_s=wall,
                     draft_time_s=wall / 4, verify_time_s=wall / 2, stop_reason=reason)
    for depth, accepted in steps:
        st.record_step(depth, accepted)
    return st.finalize()


def test_record_step_and_finalize_by_hand():
    st = stats_of([(3, 1), (3, 3), (2, 0), (0, 0)], tokens=10, forwards=5, wall=2.0)
    assert (st.spec_steps, st.plain_steps, st.drafted, st.accepted) == (3, 1, 8, 4)
    assert st.reached == [3, 2, 1] and st.accepted_at == [2, 1, 1]
    assert st.alpha == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert st.alpha_cumulative == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert st.acceptance_rate == 0.5 and st.tau == 2.0 and st.tokens_per_s == 5.0


def test_merge_sums_counts_and_recomputes():
    a = stats_of([(3, 1), (3, 3), (2, 0)], tokens=10, forwards=5, wall=2.0)
    b = stats_of([(1, 1), (0, 0)], tokens=4, forwards=2, wall=1.0)
    m = DecodeStats.merge([a, b])
    assert m.reached == [4, 2, 1] and m.accepted_at == [3, 1, 1]
    assert m.alpha == pytest.approx([0.75, 0.5, 1.0])
    assert (m.tokens_generated, m.target_forwards, m.drafted, m.accepted) == (14, 7, 9, 5)
    assert (m.spec_steps, m.plain_steps) == (4, 1)
    assert m.wall_time_s == 3.0 and m.draft_time_s == 0.75 and m.verify_time_s == 1.5
    assert m.tau == 2.0 and m.tokens_per_s == pytest.approx(14 / 3)
    assert m.stop_reason == "max_new_tokens"
    assert DecodeStats.merge([a, stats_of([], 1, 1, 1.0, reason="eos")]).stop_reason == "mixed"
    assert DecodeStats.merge([b, a]).alpha == m.alpha  # order does not matter


def test_to_dict_is_a_json_ready_copy():
    st = stats_of([(2, 1)], tokens=3, forwards=2, wall=0.5)
    d = st.to_dict()
    assert set(d) == {f.name for f in fields(DecodeStats)}
    assert d["alpha"] == st.alpha and d["reached"] == [1, 1]
    d["alpha"].append(9.0)
    assert st.alpha == [1.0, 0.0]  # position 2 was reached but not accepted
    assert json.loads(json.dumps(st.to_dict())) == st.to_dict()
