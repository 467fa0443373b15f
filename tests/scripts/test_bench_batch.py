"""scripts/bench_batch.py on a tiny target: every method at every batch size in one run, K* per
batch size from the measured speedups, the heterogeneous-rows row, the PNG, and the batch
record that eval/decode.py batch_size=B reads."""
from __future__ import annotations

import json
import shutil

import matplotlib.image
import pytest
from conftest import draft_package
from omegaconf import OmegaConf

from draftsmith.eval import decode
from draftsmith.scripts import bench_batch


def test_bench_batch_on_a_tiny_target(decode_setup, tmp_path):
    lm = tmp_path / "lm"
    shutil.copytree(decode_setup["lm"], lm)
    eagle, _ = draft_package(decode_setup, "eagle")
    cfg = OmegaConf.merge(OmegaConf.load(bench_batch.CONF_FILE), {
        "questions": str(decode_setup["questions"]), "batch_sizes": [1, 2], "ks": [1, 2],
        "max_new_tokens": 6, "repeats": 1, "lm": str(lm), "eagle": str(eagle),
        "mixed": {"good_rows": 1, "k": "auto"}, "write": True, "tree_shapes": [[2, 4]],
        "target_path": str(decode_setup["target"]), "dtype": "float32",
        "out_dir": str(tmp_path / "out")})
    res = bench_batch.run(cfg)
    methods = {"plain", "transformers generate", "lm K=1", "lm K=2", "eagle K=1", "eagle K=2",
               "eagle tree (2 deep, 4 nodes)"}  # tree=true at the shapes given
    for r in res["rows"]:
        assert set(r["tokens_per_s"]) == methods and min(r["tokens_per_s"].values()) > 0
        assert set(r["speedup"]) == methods - {"plain"}
    for fam in ("lm", "eagle"):
        rec = res["batch"][fam]
        for r in res["rows"]:  # K* is the best K when it beats plain decoding, else 0
            sp = {k: r["speedup"][f"{fam} K={k}"] for k in (1, 2)}
            best = max(sp, key=sp.get)
            assert rec["k_star"][str(r["batch_size"])] == (best if sp[best] > 1 else 0)
        zero = [int(b) for b, k in rec["k_star"].items() if k == 0]
        assert rec["crossover"] == (min(zero) if zero else None)
    for r in res["rows"]:  # the tree record: the one tree run, and whether it beat the chains
        tree = res["batch"]["eagle"]["tree"][str(r["batch_size"])]
        sp = r["speedup"]["eagle tree (2 deep, 4 nodes)"]
        best_chain = max(r["speedup"][f"eagle K={k}"] for k in (1, 2))
        assert (tree["depth"], tree["nodes"], tree["speedup"]) == (2, 4, sp)
        assert tree["wins"] == (sp > max(best_chain, 1.0))
    assert "tree" not in res["batch"]["lm"]
    assert sorted((m["draft"], m["layout"]) for m in res["mixed"]) == [
        ("eagle", "packed"), ("eagle", "padded"), ("lm", "packed"), ("lm", "padded")]
    assert all(len(m["good_rows_vs_alone"]) == len(m["good_rows_vs_clean_batch"]) == 1
               and m["worst"] > 0 and m["worst_vs_clean"] > 0 for m in res["mixed"])
    for m in res["mixed"]:  # mixed.k=auto: each side at the best K of the table at its B
        best = {r["batch_size"]: max((1, 2), key=lambda k: r["speedup"][f"{m['draft']} K={k}"])
                for r in res["rows"]}
        assert (m["k_alone"], m["k"]) == (best[1], best[2])
    png = matplotlib.image.imread(tmp_path / "out" / "throughput.png")
    assert png.shape[0] > 200 and png.shape[1] > 500
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| 2 |" in md and "K* per batch size" in md and "Heterogeneous rows" in md
    # write=true: the record is in the package (re-signed) and decode.py takes K from it
    spec = json.loads((lm / "speculation.json").read_text())
    assert spec["batch"]["k_star"] == res["batch"]["lm"]["k_star"]
    got = decode.run_overrides([f"draft={lm}", f"target_path={decode_setup['target']}",
                                f"prompts={decode_setup['questions']}", "max_new_tokens=4",
                                "batch_size=2", "baseline=false"])["summary"]
    k2 = res["batch"]["lm"]["k_star"]["2"]
    assert (got["k"], got["k_source"]) == (k2, "speculation.json (batch 2)")


@pytest.mark.parametrize("change, message", [
    ({"mixed": {"good_rows": 3, "k": 2}}, "need 4"),  # 3 good rows + the hostile row > 3
    ({"mixed": {"good_rows": 2}}, r"B = mixed.good_rows \+ 1 = 3: add them to batch_sizes"),
    ({"mixed": {"k": 0}}, "mixed.k must be auto or an integer >= 1"),
    ({"batch_sizes": [1, 4]}, "need 4"),
    ({"mixed": {"good_rows": 0}}, "at least one good row"),
    ({"tree_shapes": [[4, 16], [2]]}, r"tree_shapes entry \[2\]: each is \[depth, nodes\]"),
])
def test_bench_batch_refuses_more_rows_than_questions(decode_setup, tmp_path, change, message):
    cfg = OmegaConf.merge(OmegaConf.load(bench_batch.CONF_FILE), {
        "questions": str(decode_setup["questions"]), "batch_sizes": [1, 2], "eagle": None,
        "target_path": str(decode_setup["target"]), "dtype": "float32",
        "out_dir": str(tmp_path / "out")}, change)
    with pytest.raises(ValueError, match=message):
        bench_batch.run(cfg)
