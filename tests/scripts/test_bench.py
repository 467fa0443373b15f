"""scripts/bench.py on a tiny target: the decoding table, the measured tree, the fallback bound
and the useless-copy draft (fixtures and helpers in tests/conftest.py)."""
from __future__ import annotations

import json
import shutil

import torch
from conftest import draft_package
from omegaconf import OmegaConf

from draftsmith.heads.package import load_package, update_package_json
from draftsmith.heads.vocab import frequency_record
from draftsmith.scripts import bench, bench_fallback


def test_bench_decoding_section_on_a_tiny_target(decode_setup, tmp_path, capsys):
    cfg = OmegaConf.merge(OmegaConf.load(bench.CONF_FILE), {
        "questions": str(decode_setup["questions"]), "limit": 2, "max_new_tokens": 6,
        "temperatures": [0.0, 1.0], "lm": str(decode_setup["lm"]),
        "eagle": str(tmp_path / "missing"), "k": 2, "target_path": str(decode_setup["target"]),
        "out_dir": str(tmp_path / "bench"),
        "dtype": "float32", "forward_costs": {"widths": [1, 3], "repeats": 2}})
    res = bench.run(cfg)
    costs = {f["dtype"]: f["ms"] for f in res["forward_costs"]}
    assert set(costs) == {"float32", "bfloat16"} and all(
        set(ms) == {1, 3} and min(ms.values()) > 0 for ms in costs.values())
    assert "no medusa= package given" in capsys.readouterr().out
    methods = {(r["temperature"], r["method"]) for r in res["decoding"]}
    expected = {"plain (ours)", "plain (ours), again last", "hf_generate", "hf_assisted K=2",
                "hf_assisted K=2 native-gqa", "hf_prompt_lookup", "ours lm",
                "ours lm adaptive+fallback"}
    assert methods == {(t, m) for t in (0.0, 1.0) for m in expected}
    greedy = {r["method"]: r for r in res["decoding"] if r["temperature"] == 0.0}
    assert greedy["plain (ours)"]["speedup_vs_plain"] == 1.0
    assert greedy["ours lm"]["k"] == 2 and greedy["hf_assisted K=2"]["k"] == 2
    assert greedy["ours lm"]["speedup_vs_hf_assisted"] > 0
    assert greedy["ours lm"]["speedup_vs_hf_assisted_gqa"] > 0
    assert greedy["ours lm adaptive+fallback"]["k_source"] == "default"  # no speculation.json
    assert all(r["median_tokens_per_s"] > 0 for r in res["decoding"])
    assert all(r["same_as_plain"] == 1.0 for r in greedy.values())  # greedy is lossless
    on_disk = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert on_disk["n_prompts"] == 2 and on_disk["environment"]["hardware"]["cpu"]
    md = (tmp_path / "bench" / "results.md").read_text()
    assert "| 0 | ours lm | 2 (config) |" in md and "command:" in md
    assert "## Target forward cost per number of new tokens" in md and "| bfloat16 |" in md
    # the fallback bound section: the useless copy of the lm package, interleaved with plain
    fb = {(r["temperature"], r["draft"]): r for r in res["fallback_bound"]}
    assert set(fb) == {(0.0, "useless-lm"), (1.0, "useless-lm")}  # no eagle package: skipped
    for r in fb.values():
        assert r["k_fixed"] == 2 and r["repeats"] == 3
        assert len(r["per_prompt_defaults_vs_plain"]) == 2
        assert r["fixed_vs_plain"] > 0 and r["defaults_vs_plain"] >= r["defaults_vs_plain_min"] > 0
    assert "## Fallback bound" in md and "| 0 | useless-lm | 2 |" in md
    assert "| 0 | ours lm | 2 |" in md.split("same draft LM and K")[1]


def test_bench_runs_the_measured_lm_tree_against_assisted_at_its_depth(decode_setup, tmp_path):
    pkg = tmp_path / "lm"
    shutil.copytree(decode_setup["lm"], pkg)
    vocab = decode_setup["loaded"].model.config.vocab_size
    update_package_json(pkg, "token_frequency.json",
                        frequency_record(torch.arange(vocab, 0, -1), "test"))
    update_package_json(pkg, "speculation.json", {
        "k_star": 1, "dtype": "float32", "hardware": {"device": "cpu"},
        "measured_speedup": {"k": 1, "speedup": 1.0},
        "tree": {"depth": 2, "total_tokens": 4, "speedup": 1.1}, "draft_vocab": {"size": 40}})
    cfg = OmegaConf.merge(OmegaConf.load(bench.CONF_FILE), {
        "questions": str(decode_setup["questions"]), "limit": 1, "max_new_tokens": 6,
        "temperatures": [0.0], "lm": str(pkg), "tree_topk": 2, "prompt_lookup": False,
        "medusa": str(draft_package(decode_setup, "medusa")[0]),
        "auto_rows": False, "target_path": str(decode_setup["target"]),
        "out_dir": str(tmp_path / "b"),
        "eagle": None, "dtype": "float32", "forward_costs": {"enabled": False},
        "fallback_bound": {"enabled": False}})
    rows = {r["method"]: r for r in bench.run(cfg)["decoding"]}
    assert set(rows) == {"plain (ours)", "plain (ours), again last", "hf_generate",
                         "hf_assisted K=1", "hf_assisted K=2", "hf_assisted K=1 native-gqa",
                         "hf_assisted K=2 native-gqa", "ours lm", "ours lm-tree",
                         "ours lm-tree full-vocab", "ours medusa"}  # Medusa: no draft vocabulary
    assert (rows["ours lm"]["k"], rows["ours lm-tree"]["k"]) == (1, 2)
    assert rows["ours lm-tree"]["tree_size"] == 4 and rows["ours lm-tree"]["same_as_plain"] == 1.0
    # the measured draft vocabulary is the default; the tree also runs over the whole vocabulary
    assert (rows["ours lm"]["draft_vocab"], rows["ours lm-tree"]["draft_vocab"]) == (40, 40)
    assert rows["ours lm-tree full-vocab"]["draft_vocab"] is None
    assert rows["ours lm-tree full-vocab"]["same_as_plain"] == 1.0
    assert all(rows[m]["speedup_vs_hf_assisted"] > 0
               for m in ("ours lm", "ours lm-tree", "ours lm-tree full-vocab"))


def test_useless_copy_proposes_wrong_tokens_at_the_same_cost(decode_setup, tmp_path):
    path = bench_fallback.useless_copy("lm", str(decode_setup["lm"]), decode_setup["loaded"],
                                       tmp_path)
    good = load_package(decode_setup["lm"]).module
    bad = load_package(path, target=decode_setup["loaded"]).module
    ids = torch.randint(0, good.config.vocab_size, (1, 12),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        g, b = good(ids).logits.argmax(-1), bad(ids).logits.argmax(-1)
    assert torch.equal(b, (g + 1) % good.config.vocab_size)  # always the neighbour: never right
    # the same computation: same layers, same LM-head shape (only untied from the embeddings)
    assert bad.config.num_hidden_layers == good.config.num_hidden_layers
    assert bad.get_output_embeddings().weight.shape == good.get_output_embeddings().weight.shape
