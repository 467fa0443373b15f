"""The report's trained-vs-served flag weighs each position's gap by the drafts that reached it."""
from __future__ import annotations

import pytest
from test_report import make_draft, settings, write_job

from draftsmith.eval.report import build_report
from draftsmith.eval.report_rows import _beyond_noise


def test_a_gap_is_noise_only_when_few_drafts_reached_the_position():
    assert not _beyond_noise(0.3, 0.3, reached=2)  # 2 drafts: 0.0 served is unremarkable
    assert _beyond_noise(0.3, 0.3, reached=200)  # 200 drafts: far beyond 2 standard errors
    assert not _beyond_noise(0.3, 0.3, reached=0)
    assert _beyond_noise(0.3, 0.3, reached=None)  # unknown count: judged on the gap alone


@pytest.mark.parametrize("reached, flagged", [([400, 300, 2], False), ([400, 300, 200], True)])
def test_the_flag_follows_the_drafts_reached(tmp_path, reached, flagged):
    d = str(make_draft(tmp_path / "runs" / "lm", [0.3, 0.3, 0.3], temperature=0.0))
    # position 3 served 0.0 against 0.3 trained: noise on 2 drafts, a real gap on 200
    write_job(tmp_path, "t0", settings(d, 3, 0.0),
              {"alpha": [0.31, 0.29, 0.0], "reached": reached, "speedup": 1.1})
    rows = {r["job"]: r for r in build_report(tmp_path, make_figures=False).rows}
    assert rows["t0"]["gap_position"] == 3
    assert rows["t0"]["gap_flag"] is flagged
    assert rows["t0"]["reached"] == reached
