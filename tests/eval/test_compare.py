"""eval/compare.py: several drafts against the same plain runs, in one process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
from conftest import draft_package

from draftsmith.eval import CONF_DIR, compare
from tests.eval.test_shadow import foreign_eagle

REPO = Path(__file__).resolve().parents[2]


def _cfg(decode_setup, *overrides: str):
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra.compose(config_name="compare", overrides=[
            f"target_path={decode_setup['target']}", f"prompts={decode_setup['questions']}",
            "limit=2", "max_new_tokens=10", "dtype=float32", *overrides])


def test_every_draft_is_paired_with_the_same_plain_runs(decode_setup, tmp_path):
    eagle, _ = draft_package(decode_setup, "eagle")
    out = tmp_path / "cmp.json"
    drafts = (f"drafts={{lm: {{draft: {decode_setup['lm']}, k: 3, suffix: false}}, "
              f"eagle: {{draft: {eagle}, tree: tree, k: 2, tree_size: 6}}, "
              "lookup: {draft: lookup}}")
    proc = subprocess.run(
        [sys.executable, str(REPO / "eval" / "compare.py"),
         f"target_path={decode_setup['target']}", f"prompts={decode_setup['questions']}",
         "limit=2", "max_new_tokens=10", "dtype=float32", f"out={out}", drafts],
        check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    s = result["summaries"]
    assert list(s) == ["lm", "eagle", "lookup"]
    assert s["lm"]["draft_kind"] == "lm" and s["lm"]["k"] == 3 and s["lm"]["suffix_rounds"] is None
    assert s["eagle"]["tree"] and s["eagle"]["tree_size"] == 6 and s["eagle"]["k"] == 2
    assert s["lookup"]["draft_kind"] == "lookup"
    # one set of plain runs: every draft's baseline is the same figure
    assert len({v["baseline_tokens_per_s"] for v in s.values()}) == 1
    for name, v in s.items():  # greedy and lossless: every output equals plain decoding's
        assert v["matches_baseline"] == 1.0, name
        assert v["n_samples"] == 2 and len(result["speedup_per_prompt"][name]) == 2
        assert v["speedup"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| lm |" in md and "| eagle |" in md and "python eval/compare.py" in md
    assert result["environment"]["hardware"]["cpu_count"] >= 1 and "cores" in md
    assert "| lm |" in proc.stdout


def test_a_foreign_record_is_retimed_and_judged_as_decode_py_does(decode_setup, tmp_path,
                                                                   monkeypatch):
    pkg = foreign_eagle(decode_setup, tmp_path, monkeypatch)
    s = compare.run(_cfg(decode_setup, f"drafts={{foreign: {{draft: {pkg}}}}}"))["summaries"]
    # re-timed to plain decoding on the first prompt, the package judged by shadow chains
    assert s["foreign"]["k_source"].startswith("re-timed here: ")
    assert s["foreign"]["shadow"] is not None and s["foreign"]["matches_baseline"] == 1.0


@pytest.mark.parametrize(("drafts", "says"), [
    ("{}", "drafts is empty"),
    ("{a: {k: 2}}", "drafts.a needs draft="),
    ("{a: {draft: lookup, limit: 3}}", "shared by every draft"),
    ("{a: {draft: lookup, batch_size: 2}}", "compared at batch 1"),
    ("{a: {draft: lookup, kk: 2}}", "not a decode.py setting"),
    ("{a: {draft: lookup, k: -1}}", "k must be >= 0"),
    ("{a: {draft: /no/such/folder}}", "no such folder"),
])
def test_bad_drafts_are_refused_before_any_model_loads(decode_setup, drafts, says):
    with pytest.raises(ValueError, match=says):
        compare.run(_cfg(decode_setup, f"drafts={drafts}"))


def test_an_out_file_that_is_an_input_is_refused(decode_setup):
    cfg = _cfg(decode_setup, "drafts={a: {draft: lookup}}", f"out={decode_setup['questions']}")
    with pytest.raises(ValueError, match="out"):
        compare.run(cfg)
    assert decode_setup["questions"].read_text()  # not overwritten
