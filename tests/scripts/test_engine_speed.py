"""The engines' paired speed (scripts/engine_speed.py), llama-server's runner with stand-in
servers, and how engines.py judges a run: none of it needs an engine."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.heads.family import get_family
from draftsmith.scripts import engine_jobs, engines
from draftsmith.scripts.engine_speed import best_draft_length, from_timings, paired_speedup

REPO = Path(__file__).resolve().parents[2]


# ----- paired speedup ---------------------------------------------------------------------------
def test_the_speedup_is_the_median_ratio_over_each_prompts_two_plain_runs():
    s = paired_speedup([10, 20, 40], [15, 20, 100], [10, 20, 40])
    assert s.ratios == pytest.approx([1.5, 1.0, 2.5])
    assert s.speedup == pytest.approx(1.5) and s.spread == pytest.approx((1.0, 2.5))
    assert s.noisy is False and s.noisy_prompts == 0 and s.prompts == 3


def test_plain_runs_that_disagree_flag_the_run_noisy():
    """The twin of the quiet case: the machine's speed changed under two prompts of four (plain
    runs 30% apart), more than a quarter of them, so the speedup is flagged."""
    s = paired_speedup([10, 10, 10, 10], [12, 12, 12, 12], [10, 13, 7, 10])
    assert s.noisy_prompts == 2 and s.noisy is True
    quiet = paired_speedup([10, 10, 10, 10], [12, 12, 12, 12], [10, 10.5, 10, 10])
    assert quiet.noisy is False and quiet.speedup == pytest.approx(12 / 10.25, rel=0.05)
    with pytest.raises(ValueError, match="one tokens/s per prompt"):
        paired_speedup([1, 2], [1], [1, 2])


def test_runner_timings_become_tokens_per_s_and_the_best_k_is_the_fastest():
    prompts = [{"plain_s": [2.0, 2.0], "plain_tokens": [32, 32], "spec_s": 1.0,
                "spec_tokens": 32}]
    assert from_timings(prompts).speedup == pytest.approx(2.0)
    slow = [{**prompts[0], "spec_s": 4.0}]
    assert best_draft_length({2: from_timings(prompts), 3: from_timings(slow)}) == 2
    assert best_draft_length({}) is None


# ----- llama-server's runner --------------------------------------------------------------------
def _runner():
    spec = importlib.util.spec_from_file_location("llama_server_run",
                                                  engine_jobs.RUNNERS / "llama_server_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeServer:
    """Answers like llama-server: fixed tokens, a draft count per request, cumulative metrics."""

    def __init__(self, name: str, log: list, drafted: int = 0, accepted: int = 0):
        self.name, self.log, self.drafted, self.accepted, self.requests = (name, log, drafted,
                                                                           accepted, 0)

    def complete(self, ids, job, n_predict=None):
        self.log.append((self.name, n_predict))
        self.requests += 1
        timings = {"draft_n": self.drafted, "draft_n_accepted": self.accepted} if \
            self.drafted else {}
        return {"tokens": [5, 6, 7], "wall_s": 0.5 if self.drafted else 1.0, "timings": timings,
                "stop_type": "limit"}

    def metrics(self):
        return {"spec_decode_num_drafts_total": 3 * self.requests,
                "accepted_per_position": {0: 2 * self.requests, 1: self.requests}}


def test_llama_server_runs_plain_spec_plain_per_prompt_after_a_warm_up():
    runner, log = _runner(), []
    plain, spec = FakeServer("plain", log), FakeServer("spec", log, drafted=4, accepted=3)
    res = runner.paired(plain, spec, [[1, 2], [3, 4]], {"max_tokens": 3})
    assert log == [("plain", 8), ("spec", 8)] + [("plain", None), ("spec", None),
                                                 ("plain", None)] * 2
    assert res["draft_n"] == 8 and res["draft_n_accepted"] == 6  # warm-up not counted
    assert res["metrics"] == {"spec_decode_num_drafts_total": 6, "accepted_per_position": [4, 2]}
    assert res["prompts"][0] == {"plain_s": [1.0, 1.0], "plain_tokens": [3, 3], "spec_s": 0.5,
                                 "spec_tokens": 3, "stop_type": "limit"}
    assert res["plain_outputs"] == [[[5, 6, 7], [5, 6, 7]]] * 2


def test_llama_server_metrics_lines_are_parsed():
    m = _runner().METRIC
    assert m.match('llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 7'
                   ).groups() == ("spec_decode_num_accepted_tokens_per_pos_total", "1", "7")
    assert m.match("llamacpp:spec_decode_num_drafts_total 38").groups() == (
        "spec_decode_num_drafts_total", None, "38")


# ----- judging a run ----------------------------------------------------------------------------
def _cfg(**kw):
    cfg = OmegaConf.load(REPO / "conf" / "eval" / "engines.yaml")
    return OmegaConf.merge(cfg, kw)


class _Pkg:
    def __init__(self, family, head_config):
        self.family, self.head_config = family, head_config


def test_draft_lengths_follow_the_head_and_the_engine():
    from draftsmith.heads.dflash import DFlashConfig
    from draftsmith.heads.eagle_config import EagleConfig

    cfg = _cfg(k=2, sweep=[1, 2, 3, 7, 9])
    eagle = _Pkg(get_family("eagle"), EagleConfig())
    assert engines.draft_lengths(cfg, "vllm", eagle) == (2, [1, 3, 7, 9])
    dflash = _Pkg(get_family("dflash"), DFlashConfig(block_size=8, fuse_layers=[1, 2],
                                                     mask_token_id=2))
    assert engines.draft_lengths(cfg, "vllm", dflash) == (7, [])  # vLLM's block is fixed
    assert engines.draft_lengths(cfg, "llama_server", dflash) == (7, [1, 2, 3])


def _result(outputs, plain, spec):
    prompts = [{"plain_s": [1.0, 1.0], "plain_tokens": [3, 3], "spec_s": 0.5, "spec_tokens": 3}]
    return {"ok": True, "version": "x", "outputs": outputs, "plain_outputs": plain,
            "spec": spec, "prompts": prompts * len(outputs), "sweep": []}


def test_a_run_is_judged_against_the_engines_plain_output_and_ours(monkeypatch):
    mine = {"outputs": [[5, 6, 7]], "spec_steps": 10, "accepted_at": [4, 2], "drafted": 20,
            "accepted": 6}
    monkeypatch.setattr(engines, "ours", lambda *a, **kw: mine)
    spec = {"draft_n": 20, "draft_n_accepted": 6, "spec_decode_num_drafts_total": 10,
            "accepted_per_position": [4, 2]}
    cfg = _cfg(sweep_prompts=1)
    row = engines.compare("llama_server", "gguf", Path("x"), cfg, None, [{}],
                          _result([[5, 6, 7]], [[[5, 6, 7], [5, 6, 7]]], spec), 2)
    assert row["greedy_identical_to_engine_plain"] and row["greedy_identical_to_ours"]
    assert row["acceptance_within_10pct"] and row["engine_speedup"] == pytest.approx(2.0)
    # the twins: a token off, and an engine accepting 30% more than we do
    off = engines.compare("llama_server", "gguf", Path("x"), cfg, None, [{}],
                          _result([[5, 6, 8]], [[[5, 6, 7], [5, 6, 7]]], spec), 2)
    assert off["greedy_identical_to_engine_plain"] is False
    assert off["greedy_identical_to_ours"] is False
    more = engines.compare("llama_server", "gguf", Path("x"), cfg, None, [{}],
                           _result([[5, 6, 7]], [[[5, 6, 7], [5, 6, 7]]],
                                   {**spec, "draft_n_accepted": 8}), 2)
    assert more["acceptance_within_10pct"] is False
