"""Sweep reports from synthetic job files: table numbers, K*, categories, gap flag, plots."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from draftsmith.eval.decoding.cost import Costs, expected_speedups, expected_tokens, parse_costs
from draftsmith.eval.report import build_report, run
from draftsmith.eval.report_rows import predicted_speedup

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "eval"


def _cli(*overrides: str):
    """The command line's config: conf/eval/report.yaml with these Hydra overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="report", overrides=list(overrides))


def write_job(d: Path, stem: str, settings: dict, summary: dict,
              samples: list | None = None) -> Path:
    path = d / f"{stem}.json"
    path.write_text(json.dumps({"job": {"id": stem, "settings": settings},
                                "summary": summary, "samples": samples or []}))
    return path


def make_draft(d: Path, alpha_hat: list[float], temperature: float = 0.0,
               train_log: list[dict] | None = None, costs: dict | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "validation.json").write_text(json.dumps(
        {"temperature": temperature, "alpha_hat": alpha_hat, "top1": alpha_hat, "step": 100}))
    if train_log is not None:
        (d / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in train_log) + "\n")
    if costs is not None:
        (d / "speculation.json").write_text(json.dumps({"costs": costs, "alpha": alpha_hat}))
    return d


def settings(draft: str, k: int | None, t: float = 0.0, method: str = "spec") -> dict:
    return {"method": method, "draft": draft, "k": k, "temperature": t, "prompts": "p.jsonl",
            "limit": 4, "max_new_tokens": 32}


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def random_summary(rng: random.Random, k: int | None) -> dict:
    alpha = [round(rng.uniform(0.2, 0.95), 4) for _ in range(k or 0)]
    return {"tau": rng.uniform(1, 4), "acceptance_rate": rng.uniform(0, 1),
            "tokens_per_s": rng.uniform(5, 50), "speedup": rng.uniform(0.5, 3),
            "alpha": alpha, "tokens_generated": rng.randint(50, 500),
            "target_forwards": rng.randint(20, 200), "k": k, "draft_kind": "lm" if k else "plain"}


def test_table_numbers_equal_job_files(tmp_path):
    rng = random.Random(7)
    draft = str(tmp_path / "runs" / "lm")
    written = {}
    for k in (None, 1, 2, 4, 8):
        stem = f"job-k{k}"
        s = random_summary(rng, k)
        write_job(tmp_path, stem, settings(draft if k else "none", k), s)
        written[stem] = s
    (tmp_path / "broken.json").write_text("{not json")  # a half-written file is ignored
    rep = build_report(tmp_path, make_figures=False)
    rows = {r["job"]: r for r in read_csv(tmp_path / "report.csv")}
    assert set(rows) == set(written)
    for stem, s in written.items():
        for key in ("tau", "acceptance_rate", "tokens_per_s", "speedup", "tokens_generated",
                    "target_forwards"):
            assert float(rows[stem][key]) == pytest.approx(s[key], rel=1e-12), (stem, key)
        assert [float(x) for x in rows[stem]["alpha"].split()] == pytest.approx(s["alpha"])
        plain_tps = written["job-kNone"]["tokens_per_s"]
        assert float(rows[stem]["speedup_vs_plain"]) == pytest.approx(s["tokens_per_s"] / plain_tps)
    spec = {st: s for st, s in written.items() if s["k"]}
    best = max(spec, key=lambda st: spec[st]["speedup"])
    assert [st for st, r in rows.items() if r["k_star"] == "True"] == [best]
    md = (tmp_path / "report.md").read_text()
    assert f"| {rows[best]['label']} |" in md
    assert len(rep.rows) == 5


def test_k_star_per_temperature_group(tmp_path):
    d = str(tmp_path / "runs" / "lm")
    for k, t, sp in [(1, 0.0, 1.1), (2, 0.0, 1.5), (4, 0.0, 1.3), (1, 1.0, 1.4), (2, 1.0, 1.2)]:
        write_job(tmp_path, f"k{k}-t{t}", settings(d, k, t), {"speedup": sp, "tokens_per_s": sp,
                                                             "alpha": [0.5] * k})
    rows = build_report(tmp_path, make_figures=False).rows
    best = sorted((r["temperature"], r["k"]) for r in rows if r["k_star"])
    assert best == [(0.0, 2), (1.0, 1)]


def test_category_tau_is_tokens_over_forwards(tmp_path):
    rng = random.Random(3)
    samples, truth = [], {}
    for i in range(12):
        cat = ["code", "math", "writing"][i % 3]
        n, f = rng.randint(10, 60), rng.randint(5, 10)
        samples.append({"id": i, "category": cat, "output_ids": list(range(n)), "tau": n / f})
        t = truth.setdefault(cat, [0, 0])
        t[0] += n
        t[1] += f
    write_job(tmp_path, "j", settings("none", None), {"tau": 1.0, "tokens_per_s": 10.0}, samples)
    rep = build_report(tmp_path)
    got = {c["category"]: c["tau"] for c in rep.categories}
    assert got == pytest.approx({c: n / f for c, (n, f) in truth.items()})
    assert (tmp_path / "tau_per_category.png").stat().st_size > 1000
    assert "## tau per category" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("threshold, flagged", [(0.1, True), (0.2, False)])
def test_trained_vs_served_gap_flag(tmp_path, threshold, flagged):
    d = str(make_draft(tmp_path / "runs" / "lm", [0.9, 0.7, 0.5], temperature=0.0))
    # position 2 is 0.15 below the training estimate; the others are within 0.05
    write_job(tmp_path, "t0", settings(d, 3, 0.0), {"alpha": [0.88, 0.55, 0.47], "speedup": 1.2})
    write_job(tmp_path, "t1", settings(d, 3, 1.0), {"alpha": [0.1, 0.1, 0.1], "speedup": 1.0})
    rep = build_report(tmp_path, gap_threshold=threshold, make_figures=False)
    rows = {r["job"]: r for r in rep.rows}
    assert rows["t0"]["gap_max"] == pytest.approx(0.15)
    assert rows["t0"]["gap_position"] == 2
    assert rows["t0"]["gap_flag"] is flagged
    # a different temperature is never compared with the T=0 validation estimate
    assert rows["t1"]["gap_max"] is None and rows["t1"]["gap_flag"] is False
    csv_rows = {r["job"]: r for r in read_csv(tmp_path / "report.csv")}
    assert csv_rows["t0"]["gap_flag"] == str(flagged)
    md = (tmp_path / "report.md").read_text()
    assert ("**GAP**" in md) is flagged


def test_expected_tokens_and_prediction():
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.5, 0.5], 1) == pytest.approx(1.5)
    # perfect draft, free drafting, verify as cheap as one AR step -> speedup K + 1
    sp = expected_speedups([1.0] * 4, Costs(0.05, 0.0, {k: 0.05 for k in range(1, 5)}),
                           [1, 2, 3, 4])
    assert list(sp) == [1, 2, 3, 4] and list(sp.values()) == pytest.approx([2, 3, 4, 5])
    spec = {"alpha": [1.0] * 4, "costs": {"t_ar": 0.05, "t_draft": 0.0,
                                          "t_verify": {str(k): 0.05 for k in range(1, 5)}}}
    assert predicted_speedup(spec, [1, 2, 3, 4]) == pytest.approx(sp)
    costs = parse_costs({"t_ar": 0.05, "t_draft": 0.01, "t_verify": [0.05, 0.051, 0.06]})
    assert costs == (0.05, 0.01, {0: 0.05, 1: 0.051, 2: 0.06})
    assert parse_costs({"t_ar": 0.05}) is None
    assert parse_costs({"t_AR": 0.05, "t_draft": 0.01, "t_verify": [0.05]}) is None  # one spelling


def test_plots_written(tmp_path):
    log = [{"step": s, "loss": 3.0 / (1 + s), "lr": 1e-3} for s in range(0, 100, 10)]
    log += [{"step": s, "loss": 3.0 / (1 + s), "alpha_hat": [0.3 + s / 300, 0.2 + s / 400]}
            for s in (50, 100)]
    d = str(make_draft(tmp_path / "runs" / "lm", [0.6, 0.5], 0.0, log,
                       costs={"t_ar": 0.047, "t_draft": 0.004,
                              "t_verify": {"1": 0.05, "2": 0.051, "4": 0.072, "8": 0.086}}))
    write_job(tmp_path, "plain", settings("none", None), {"tokens_per_s": 20.0, "tau": 1.0})
    for k, sp in [(1, 1.2), (2, 1.4), (4, 1.3), (8, 1.0)]:
        alpha = [0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3, 0.3][:k]
        samples = [{"id": 0, "category": "code", "output_ids": [1] * 20, "tau": 2.0},
                   {"id": 1, "category": "chat", "output_ids": [1] * 10, "tau": 1.5}]
        write_job(tmp_path, f"k{k}", settings(d, k), {"speedup": sp, "tokens_per_s": 20 * sp,
                                                      "alpha": alpha}, samples)
    rep = build_report(tmp_path)
    for name in ("acceptance", "speedup_vs_k", "tau_per_category", "training_curves"):
        png = rep.files[name]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000, name
    md = (tmp_path / "report.md").read_text()
    assert "![speedup_vs_k](speedup_vs_k.png)" in md


def test_errors_listed_and_bad_input(tmp_path):
    write_job(tmp_path, "ok", settings("none", None), {"tokens_per_s": 10.0})
    (tmp_path / "bad.error.json").write_text(json.dumps(
        {"job": {}, "error": {"type": "RuntimeError", "message": "out of memory",
                              "traceback": ""}}))
    rep = build_report(tmp_path, make_figures=False)
    assert len(rep.errors) == 1 and len(rep.rows) == 1
    assert "RuntimeError: out of memory" in (tmp_path / "report.md").read_text()
    with pytest.raises(FileNotFoundError, match="sweep directory"):
        build_report(tmp_path / "missing")
    with pytest.raises(ValueError, match="gap_threshold"):
        build_report(tmp_path, gap_threshold=-1)
    assert len(run(_cli(f"sweep_dir={tmp_path}", "gap_threshold=0.2", "plots=false")).rows) == 1
    with pytest.raises(ConfigCompositionException, match="bogus"):
        _cli(f"sweep_dir={tmp_path}", "bogus=1")
