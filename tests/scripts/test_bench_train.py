"""The training-throughput benchmark: its rate arithmetic, and one tiny run end to end."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from draftsmith.scripts import bench_train


def _records(step_s: list[float], tokens_per_step: list[int]) -> list[dict]:
    recs, t, n = [{"step": 1, "flops_first_step": 6.0e9, "tokens_first_step": 1000}], 0.0, 0
    for i, (dt, k) in enumerate(zip(step_s, tokens_per_step), start=1):
        t, n = t + dt, n + k
        recs.append({"step": i, "loss": 1.0, "tokens": n, "elapsed_s": t})
    return recs


def test_step_rates_leave_out_the_warm_up_steps():
    # a slow first step (FLOP counting) and a slow second one must not enter the rate
    recs = _records([9.0, 5.0, 1.0, 2.0, 1.0], [1000, 1000, 1000, 2000, 1000])
    got = bench_train.step_rates(recs, warmup_steps=2)
    assert got["tokens_per_s"] == pytest.approx(4000 / 4.0)
    assert got["median_step_s"] == pytest.approx(1.0)
    assert got["tokens_per_step"] == pytest.approx(4000 / 3)
    assert got["flops_per_token"] == pytest.approx(6.0e6)
    # with the warm-up counted the rate would be lower: the exclusion is what the test pins
    assert bench_train.step_rates(recs, warmup_steps=0)["tokens_per_s"] == pytest.approx(6000 / 18)


def test_step_rates_report_nothing_when_too_few_steps_were_logged():
    got = bench_train.step_rates(_records([1.0, 1.0], [10, 10]), warmup_steps=2)
    assert "tokens_per_s" not in got


@pytest.mark.slow
def test_bench_train_runs_variants_and_caching_on_a_tiny_target(tmp_path):
    from draftsmith.data.tiny import tiny_target_dir

    target = tiny_target_dir(initializer_range=0.3)
    cfg = OmegaConf.merge(OmegaConf.load(bench_train.CONF_FILE), {
        "steps": 4, "warmup_steps": 1, "micro_batch_size": 2, "target_path": str(target),
        "out_dir": str(tmp_path / "bt"), "baseline": "old",
        "data_overrides": ["data=sharegpt_tiny", "data.num_conversations=16",
                           "data.max_length=96"],
        "caching": {"conversations": 4, "max_length": 64, "tv_sequences": 2}})
    cfg.variants = [
        {"name": "old", "what": "reference", "env": {"DRAFTSMITH_MALLOC": "off"},
         "overrides": ["draft=eagle", "train.teacher_per_token=false", "loss.fused=false"]},
        {"name": "new", "what": "fast path", "overrides": ["draft=eagle"]}]
    cfg.caching.settings = [{"dtype": "float32", "batch_size": 2},
                            {"dtype": "float32", "batch_size": 2, "layers": [1], "final_from": 1}]
    res = bench_train.run(cfg)
    rows = {r["name"]: r for r in res["training"]}
    for r in rows.values():
        assert r["exit_code"] == 0, r.get("error_tail")
        assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0 and 0 < r["mfu_bf16"]
    assert rows["old"]["vs_baseline"] == pytest.approx(1.0)
    # the benchmark itself runs with the tuned allocator: the old variant must not inherit it
    assert (rows["old"]["malloc"], rows["new"]["malloc"]) == ("off", "tuned")
    cache = res["caching"][0]
    assert cache["tokens"] > 0 and cache["max_tv"] < 1e-2 and cache["bytes_per_token"] == 137
    recomputed = res["caching"][1]  # layer 1 stored, the final hidden state recomputed from it
    assert recomputed["max_tv"] < 1e-2 and recomputed["bytes_per_token"] == 137
    on_disk = json.loads((tmp_path / "bt" / "results.json").read_text())
    assert on_disk["gemm_gflops"]["float32"] > 0
    md = (tmp_path / "bt" / "results.md").read_text()
    assert "| old | reference | off |" in md and "| float32 | 2 | - |" in md
    assert "| float32 | 2 | [1], final from 1 |" in md
