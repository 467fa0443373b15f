"""eval/decode.py and eval/measure.py end to end on a tiny target saved with a chat tokenizer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import QUESTIONS, draft_package

from draftsmith.eval import decode, measure
from draftsmith.eval.decoding.cost import parse_costs
from draftsmith.eval.draft import settle
from draftsmith.heads.manifest import PackageIntegrityError
from draftsmith.heads.package import load_package, update_package_json
from draftsmith.scripts.export import export_package

REPO = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"tokens_generated", "target_forwards", "tau", "acceptance_rate", "alpha",
                "alpha_cumulative", "draft_time_s", "verify_time_s", "wall_time_s", "tokens_per_s",
                "speedup", "k", "k_source", "draft_kind", "lossless", "device", "dtype"}
PLAN = {"k": None, "tree": "auto", "tree_size": None, "tree_topk": 8, "medusa_branching": None,
        "draft_vocab": None, "device": "cpu"}  # decode.py's defaults: everything measured
SAMPLE_KEYS = {"id", "category", "prompt_ids", "output_ids", "output_text", "tau"}


def _decode(decode_setup, draft, *extra: str) -> dict:
    return decode.run_overrides([f"draft={draft}", f"target_path={decode_setup['target']}",
                                 f"prompts={decode_setup['questions']}", "max_new_tokens=12",
                                 "temperature=0", *extra])


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_cli_writes_the_json_contract_and_greedy_equals_plain_decoding(decode_setup):
    out = decode_setup["root"] / "run.json"
    proc = subprocess.run([sys.executable, str(REPO / "eval" / "decode.py"),
                           f"draft={decode_setup['lm']}", f"target_path={decode_setup['target']}",
                           f"prompts={decode_setup['questions']}", "limit=2", "max_new_tokens=12",
                           "temperature=0", "k=3", f"out={out}"],
                          check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary, samples = result["summary"], result["samples"]
    assert SUMMARY_KEYS <= set(summary), SUMMARY_KEYS - set(summary)
    assert summary["draft_kind"] == "lm" and summary["k"] == 3 and summary["k_source"] == "config"
    assert summary["lossless"] is True and summary["dtype"] == "float32"
    assert summary["device"] == "cpu" and summary["speedup"] > 0
    assert summary["tokens_generated"] == sum(len(s["output_ids"]) for s in samples)
    assert summary["target_forwards"] >= len(samples)
    assert len(samples) == 2 and all(SAMPLE_KEYS <= set(s) for s in samples)
    tok, model = decode_setup["loaded"].tokenizer, decode_setup["loaded"].model
    for s, q in zip(samples, QUESTIONS):
        assert s["id"] == str(q["question_id"]) and s["category"] == q["category"]
        chat = [{"role": "user", "content": q["turns"][0]}]
        assert s["prompt_ids"] == list(tok.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True)["input_ids"])
        assert tok.decode(s["prompt_ids"]).endswith("<|im_start|>assistant\n")
        assert s["output_ids"] == _hf_greedy(model, s["prompt_ids"], 12)
        assert s["output_text"] == tok.decode(s["output_ids"], skip_special_tokens=True)
    assert "k (source)" in proc.stdout  # the printed summary table


def test_default_k_without_speculation_json_is_four(decode_setup):
    summary = _decode(decode_setup, decode_setup["lm"], "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (4, "default")


def test_measure_writes_a_verified_speculation_json_that_decode_uses(decode_setup, tmp_path):
    pkg = tmp_path / "lm"
    import shutil
    shutil.copytree(decode_setup["lm"], pkg)
    # tree_sizes=[]: the chain's K* only (trees: tests below)
    rec = measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                                 f"prompts={decode_setup['questions']}", "limit=2",
                                 "max_new_tokens=10", "temperature=0", "k_measure=3", "repeats=2",
                                 "min_reached=1", "tree_sizes=[]"])
    on_disk = json.loads((pkg / "speculation.json").read_text())
    assert on_disk == json.loads(json.dumps(rec))
    loaded = load_package(pkg)  # manifest still verifies
    assert loaded.speculation["k_star"] == rec["k_star"] in range(4)
    assert len(rec["alpha"]) == 3 and all(0 <= a <= 1 for a in rec["alpha"])
    assert set(rec["expected_speedup"]) == {"0", "1", "2", "3"}
    costs = rec["costs"]
    assert set(costs["t_verify"]) == {"0", "1", "2", "3"} and costs["t_ar"] > 0
    assert costs["t_draft"] > 0 and costs["t_ar"] == costs["t_verify"]["0"]
    t_ar, t_draft, t_verify = parse_costs(costs)  # the report reads this shape
    assert (t_ar, t_draft, t_verify[3]) == (costs["t_ar"], costs["t_draft"], costs["t_verify"]["3"])
    assert rec["hardware"]["cpu"] and rec["dtype"] == "float32" and rec["date"]
    assert {"torch", "transformers"} <= set(rec["versions"])
    m = rec["measured_speedup"]
    assert m["k"] == rec["k_star"]
    if rec["k_star"]:
        assert m["speedup"] > 0 and m["tokens"] > 0
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (rec["k_star"], "speculation.json")
    update_package_json(pkg, "speculation.json", {**on_disk, "k_star": 2})  # whatever K* says
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (2, "speculation.json")
    # a K* measured in another dtype is the nearest record, and said so (retime=false), or its
    # costs are timed again in this dtype before it is trusted (the default)
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false", "dtype=bfloat16",
                      "retime=false")["summary"]
    assert summary["k"] == 2
    assert summary["k_source"] == "speculation.json (float32's record: nearest measured)"
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false", "dtype=bfloat16")["summary"]
    assert summary["k_source"].startswith("re-timed here: ")
    (pkg / "speculation.json").write_text(json.dumps({**on_disk, "k_star": 5}))  # not via update
    with pytest.raises(PackageIntegrityError, match="speculation.json"):
        _decode(decode_setup, pkg, "limit=1")


@pytest.mark.parametrize("kind", ["lm", "medusa", "eagle"])
def test_an_export_decodes_like_its_package(decode_setup, kind):
    pkg, fmt = draft_package(decode_setup, kind)
    out = export_package(pkg, fmt, decode_setup["root"] / f"export-{kind}",
                         target=decode_setup["loaded"])
    # suffix=false: the hybrid's per-round choice follows measured times, as adaptive K does
    runs = [_decode(decode_setup, d, "k=3", "adaptive_k=false", "fallback=false", "baseline=false",
                    "tree_topk=3", "tree_size=10", "suffix=false") for d in (pkg, out)]
    a, b = runs
    assert a["summary"]["drafted"] > 0  # the draft really proposed
    assert a["summary"]["draft_kind"] == b["summary"]["draft_kind"]
    assert [s["output_ids"] for s in a["samples"]] == [s["output_ids"] for s in b["samples"]]
    assert [s["tau"] for s in a["samples"]] == [s["tau"] for s in b["samples"]]
    assert a["summary"]["alpha"] == b["summary"]["alpha"]
    assert a["summary"]["target_forwards"] == b["summary"]["target_forwards"]


def test_bad_draft_and_prompts_are_clear_errors(decode_setup, tmp_path):
    with pytest.raises(ValueError, match="not a draft package"):
        _decode(decode_setup, tmp_path)
    with pytest.raises(ValueError, match="unknown prompt set"):
        decode.run_overrides([f"target_path={decode_setup['target']}", "prompts=nosuchset"])
    with pytest.raises(ValueError, match="needs draft=DIR"):
        measure.run_overrides([f"target_path={decode_setup['target']}", "draft=none"])


def _measure_copy(decode_setup, tmp_path, kind: str, *overrides: str) -> tuple[Path, dict]:
    """Copy the ``kind`` package and measure it on 2 prompts x 8 tokens (plus ``overrides``)."""
    import shutil

    src, _ = draft_package(decode_setup, kind)
    pkg = tmp_path / kind
    shutil.copytree(src, pkg)
    rec = measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                                 f"prompts={decode_setup['questions']}", "limit=2",
                                 "max_new_tokens=8", "temperature=0", "k_measure=2", "repeats=2",
                                 "min_reached=1", *overrides])
    return pkg, rec


def test_measure_picks_an_eagle_tree_shape_that_decode_uses(decode_setup, tmp_path):
    pkg, rec = _measure_copy(decode_setup, tmp_path, "eagle", "tree_topk=3", "tree_depths=[1,2]",
                             "tree_sizes=[3,6]")
    tree = rec["tree"]
    # depth 1 holds at most topk = 3 nodes: size 6 there is the size-3 tree, run once
    assert {(g["depth"], g["total_tokens"]) for g in tree["grid"]} == {(1, 3), (2, 3), (2, 6)}
    best = max(tree["grid"], key=lambda g: g["tokens_per_s"])
    assert (tree["depth"], tree["total_tokens"]) == (best["depth"], best["total_tokens"])
    assert set(rec["costs"]["t_verify_tree"]) == {"3", "6"}
    # (random tiny models: whether the tree paid is chance; say it did)
    update_package_json(pkg, "speculation.json", {**rec, "tree": {**tree, "speedup": 1.1}})
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false", "tree_topk=3")["summary"]
    assert summary["draft_kind"] == "eagle-tree"
    assert (summary["k"], summary["k_source"], summary["tree_size"]) == (
        tree["depth"], "speculation.json (tree)", tree["total_tokens"])
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false", "tree_topk=3", "k=3",
                      "tree_size=5")["summary"]
    assert (summary["k"], summary["k_source"], summary["tree_size"]) == (3, "config", 5)
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false", "tree=chain")["summary"]
    assert (summary["k"], summary["k_source"], summary["tree_size"]) == (
        rec["k_star"] or 0, "speculation.json", None)
    no_search = measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                                       f"prompts={decode_setup['questions']}", "limit=1",
                                       "max_new_tokens=4", "k_measure=1", "repeats=1",
                                       "min_reached=1", "rerun=false", "write=false",
                                       "tree_sizes=[]"])
    assert "tree" not in no_search and no_search["costs"]["t_verify_tree"] == {}
    with pytest.raises(ValueError, match="tree_depths and tree_sizes take values >= 1"):
        measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                               "tree_depths=[0,2]"])


def test_measure_and_decode_draft_lm_tree(decode_setup, tmp_path):
    pkg, rec = _measure_copy(decode_setup, tmp_path, "lm", "tree_topk=2", "tree_depths=[2]",
                             "tree_sizes=[4]")
    assert [(g["depth"], g["total_tokens"]) for g in rec["tree"]["grid"]] == [(2, 4)]
    want_tree = settle({**PLAN, "dtype": "float32"}, load_package(pkg)).tree
    summary = _decode(decode_setup, pkg, "limit=1", "tree_topk=2", "k_max=2")["summary"]
    assert summary["draft_kind"] == ("lm-tree" if want_tree else "lm")
    assert summary["matches_baseline"] == 1.0  # greedy: token-identical to plain decoding
    summary = _decode(decode_setup, pkg, "limit=1", "tree=tree", "tree_topk=2", "k=2",
                      "tree_size=5", "baseline=false")["summary"]
    assert (summary["draft_kind"], summary["k"], summary["tree_size"]) == ("lm-tree", 2, 5)
    assert _decode(decode_setup, pkg, "limit=1", "tree=chain", "baseline=false")["summary"][
        "draft_kind"] == "lm"


def test_measure_picks_a_medusa_tree_that_decode_uses(decode_setup, tmp_path):
    pkg, rec = _measure_copy(decode_setup, tmp_path, "medusa",
                             "medusa_branchings=[[2],[2,1],[1,1,1,1,1]]")
    tree = rec["tree"]
    # the package has 3 heads: a 5-level tree cannot be served and is not tried
    assert [g["branching"] for g in tree["grid"]] == [[2], [2, 1]]
    best = max(tree["grid"], key=lambda g: g["tokens_per_s"])
    assert (tree["branching"], tree["depth"]) == (best["branching"], len(best["branching"]))
    assert set(rec["costs"]["t_verify_tree"]) == {str(g["total_tokens"]) for g in tree["grid"]}
    # (random tiny models: whether the tree paid is chance; say it did, the K* = 0 case is below)
    update_package_json(pkg, "speculation.json", {**rec, "tree": {**tree, "speedup": 1.1}})
    summary = _decode(decode_setup, pkg, "limit=1")["summary"]
    assert (summary["k"], summary["k_source"]) == (tree["depth"], "speculation.json (tree)")
    assert summary["matches_baseline"] == 1.0
    assert _decode(decode_setup, pkg, "limit=1", "baseline=false", "medusa_branching=[3,1]")[
        "summary"]["k_source"] != "speculation.json (tree)"
    medusa = load_package(pkg)
    plan = settle({**PLAN, "dtype": "float32"}, medusa)
    assert (list(plan.options["medusa_branching"]), plan.k_source) == (tree["branching"],
                                                            "speculation.json (tree)")
    plan = settle({**PLAN, "dtype": "bfloat16"}, medusa)  # measured in another dtype: the nearest
    assert list(plan.options["medusa_branching"]) == tree["branching"]  # record, said so
    assert plan.k_source.startswith("speculation.json (float32's record: nearest measured")
    plan = settle({**PLAN, "dtype": "bfloat16", "device": "cuda"}, medusa)  # no record there
    assert (plan.options["medusa_branching"], plan.k_source[:7]) == ((4, 2, 2, 1), "default")
    # K* = 0 and the best tree a loss too: the default is plain decoding
    update_package_json(pkg, "speculation.json", {**rec, "k_star": 0,
                                                  "tree": {**tree, "speedup": 0.9}})
    summary = _decode(decode_setup, pkg, "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (0, "speculation.json (K* = 0, best tree 0.90x)")
    with pytest.raises(ValueError, match="medusa_branchings takes non-empty lists"):
        measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                               "medusa_branchings=[[2,0]]"])


def test_measure_and_decode_a_dflash_chain_and_its_export(decode_setup, tmp_path):
    """A DFlash drafter measures chains only (K up to its block's B-1 = 3, no tree) and decodes
    them, from the package and from its speculators export, greedily as plain decoding does."""
    pkg, rec = _measure_copy(decode_setup, tmp_path, "dflash", "k_measure=5")
    assert "tree" not in rec and rec["costs"]["t_verify_tree"] == {}
    assert 0 <= rec["k_star"] <= 3 and len(rec["alpha"]) <= 3
    summary = _decode(decode_setup, pkg, "limit=1", "k=3")["summary"]
    assert (summary["draft_kind"], summary["k"], summary["matches_baseline"]) == ("dflash", 3, 1.0)
    with pytest.raises(ValueError, match="tree=tree: a dflash draft drafts one chain"):
        _decode(decode_setup, pkg, "limit=1", "tree=tree")
    out = export_package(pkg, "dflash", tmp_path / "dflash-export")
    summary = _decode(decode_setup, out, "limit=1", "k=3")["summary"]
    assert (summary["draft_kind"], summary["matches_baseline"]) == ("dflash", 1.0)


@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_draft_vocab_is_measured_and_decoded_losslessly(decode_setup, tmp_path, kind):
    import shutil

    from draftsmith.heads.vocab import TOKEN_FREQUENCY, frequency_record

    src, _ = draft_package(decode_setup, kind)
    pkg = tmp_path / kind
    shutil.copytree(src, pkg)
    vocab = decode_setup["loaded"].model.config.vocab_size
    with pytest.raises(FileNotFoundError, match="scripts/token_frequency.py draft="):
        _decode(decode_setup, pkg, "limit=1", "draft_vocab=40")
    counts = torch.arange(vocab, 0, -1)  # smaller ids more frequent
    update_package_json(pkg, TOKEN_FREQUENCY, frequency_record(counts, "test"))
    summary = _decode(decode_setup, pkg, "limit=2", "k=2", "draft_vocab=40",
                      "tree_topk=3")["summary"]
    assert summary["draft_vocab"] == 40 and summary["matches_baseline"] == 1.0
    assert summary["drafted"] > 0
    # nothing measured yet: the whole vocabulary
    summary = _decode(decode_setup, pkg, "limit=1", "k=2", "baseline=false")["summary"]
    assert summary["draft_vocab"] is None
    rec = measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                                 f"prompts={decode_setup['questions']}", "limit=2",
                                 "max_new_tokens=8", "temperature=0", "k_measure=2", "repeats=2",
                                 "min_reached=1", "tree_topk=3", "tree_depths=[2]",
                                 "tree_sizes=[6]", "draft_vocab_sizes=[20,40,500]"])
    dv = rec["draft_vocab"]
    assert [g["size"] for g in dv["grid"]] == [None, 20, 40]  # 500 >= the vocabulary: skipped
    best = max(dv["grid"], key=lambda g: g["tokens_per_s"])
    assert dv["size"] == best["size"] and all(g["draft_ms_per_step"] > 0 for g in dv["grid"])
    # decode's default is the measured size (say 20 won: random tiny models decide by chance)
    update_package_json(pkg, "speculation.json", {**rec, "draft_vocab": {**dv, "size": 20}})
    summary = _decode(decode_setup, pkg, "limit=1", "tree_topk=3")["summary"]
    assert summary["draft_vocab"] == 20 and summary["matches_baseline"] == 1.0
    assert _decode(decode_setup, pkg, "limit=1", "baseline=false", "draft_vocab=full")["summary"][
        "draft_vocab"] is None
    # another dtype takes the nearest record (float32's); another device type has none
    assert settle({**PLAN, "dtype": "bfloat16"}, load_package(pkg)).draft_vocab == 20
    assert settle({**PLAN, "dtype": "bfloat16", "device": "cuda"},
                  load_package(pkg)).draft_vocab is None
    # an export carries the counts with speculation.json and decodes the same way
    exp = export_package(pkg, "hf" if kind == "lm" else "eagle", tmp_path / "export",
                         target=decode_setup["loaded"])
    assert _decode(decode_setup, exp, "limit=1", "baseline=false")["summary"]["draft_vocab"] == 20
    # a folder with the measurement but without the counts decodes over the whole vocabulary
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    update_package_json(bare, "speculation.json", {**rec, "draft_vocab": {**dv, "size": 20}})
    summary = _decode(decode_setup, bare, "limit=1", "baseline=false")["summary"]
    assert summary["draft_vocab"] is None
    with pytest.raises(ValueError, match="draft_vocab_sizes takes"):
        measure.run_overrides([f"draft={pkg}", f"target_path={decode_setup['target']}",
                               "draft_vocab_sizes=[0]"])


def test_bad_draft_vocab_values_are_refused(decode_setup):
    with pytest.raises(ValueError, match="allowed null .measured., full, or a number"):
        _decode(decode_setup, decode_setup["lm"], "limit=1", "draft_vocab=-3")
    with pytest.raises(ValueError, match="allowed null .measured., full, or a number"):
        _decode(decode_setup, decode_setup["lm"], "limit=1", "draft_vocab=some")
    pkg, _ = draft_package(decode_setup, "medusa")
    with pytest.raises(ValueError, match=r"applies to \('lm', 'eagle'\) drafts, not medusa"):
        _decode(decode_setup, pkg, "limit=1", "draft_vocab=40")


def test_compile_draft_compiles_the_eagle_step_and_stays_lossless(decode_setup, monkeypatch):
    """compile_draft=true hands the head's forward and the LM-head call to torch.compile
    (recorded here, not compiled: inductor's first build takes about a minute on two cores; the
    measured rows are in bench/rounds) and the decode still equals plain decoding."""
    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((getattr(fn, "__name__", ""), kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    pkg, _ = draft_package(decode_setup, "eagle")
    summary = _decode(decode_setup, pkg, "limit=2", "compile_draft=true", "suffix=false")["summary"]
    assert [name for name, _ in compiled] == ["forward", "_logits"]
    assert all(kw == {"dynamic": True} for _, kw in compiled)
    assert summary["matches_baseline"] == 1.0
    compiled.clear()
    _decode(decode_setup, pkg, "limit=1", "baseline=false")  # off by default
    assert compiled == []
    with pytest.raises(ValueError, match="compile_draft=true applies to EAGLE heads, not to a lm"):
        _decode(decode_setup, decode_setup["lm"], "limit=1", "compile_draft=true")
    with pytest.raises(ValueError, match="compile_draft='yes': allowed false or true"):
        _decode(decode_setup, pkg, "limit=1", "compile_draft=yes")


def test_fused_draft_is_the_default_and_can_be_turned_off(decode_setup, monkeypatch):
    """The EAGLE head drafts through its fused step by default (eval/decoding/eagle_step.py),
    through its transformers modules with fused_draft=false: the same outputs either way."""
    from draftsmith.eval.decoding.eagle_step import EagleStep

    calls = []
    step_call = EagleStep.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return step_call(self, *args, **kwargs)

    monkeypatch.setattr(EagleStep, "__call__", counted)
    pkg, _ = draft_package(decode_setup, "eagle")
    fused = _decode(decode_setup, pkg, "limit=2", "suffix=false")
    assert calls and fused["summary"]["matches_baseline"] == 1.0
    calls.clear()
    modules = _decode(decode_setup, pkg, "limit=2", "suffix=false", "fused_draft=false")
    assert calls == []
    assert [s["output_ids"] for s in modules["samples"]] == [
        s["output_ids"] for s in fused["samples"]]
    with pytest.raises(ValueError, match="fused_draft='no': allowed true"):
        _decode(decode_setup, pkg, "limit=1", "fused_draft=no")


@pytest.mark.parametrize("kind", ["lm", "eagle", "medusa"])
def test_batch_size_decodes_like_batch_one_and_reads_the_batch_k(decode_setup, tmp_path, kind):
    import shutil

    path, _ = draft_package(decode_setup, kind)
    alone = _decode(decode_setup, path, "k=3", "limit=3", "adaptive_k=false", "fallback=false",
                    "tree=chain", "suffix=false")
    # batched: the hybrid (each row the package's chain or its suffix chain), the same tokens
    batched = _decode(decode_setup, path, "k=3", "limit=3", "batch_size=2", "fallback=false")
    packed = _decode(decode_setup, path, "k=3", "limit=3", "batch_size=2", "fallback=false",
                     "batch_layout=packed")
    assert batched["summary"]["batch_size"] == 2 and batched["summary"]["speedup"] > 0
    assert [s["output_ids"] for s in batched["samples"]] == [
        s["output_ids"] for s in alone["samples"]] == [s["output_ids"] for s in packed["samples"]]
    assert [s["batch"] for s in batched["samples"]] == [0, 0, 1]
    assert batched["summary"]["tree"] is False and batched["summary"]["matches_baseline"] == 1.0
    assert sum(batched["summary"]["suffix_rounds"].values()) > 0
    # a measured batch record gives K per batch size (the largest measured size up to B)
    pkg = tmp_path / kind
    shutil.copytree(path, pkg)
    update_package_json(pkg, "speculation.json", {
        "k_star": 3, "dtype": "float32", "hardware": {"device": "cpu"},
        "batch": {"k_star": {"1": 3, "2": 2, "4": 1}}})
    got = _decode(decode_setup, pkg, "limit=3", "batch_size=3")["summary"]
    assert (got["k"], got["k_source"]) == (2, "speculation.json (batch 2)")
    assert got["tree"] is False
    if kind != "eagle":
        return
    # a batched tree measured to beat the chains at B = 2 is what tree=auto drafts there, at its
    # shape; one that did not win leaves the chain; a packed batch keeps chains
    tree = {"1": {"depth": 4, "nodes": 16, "speedup": 1.2, "wins": False},
            "2": {"depth": 2, "nodes": 4, "speedup": 1.3, "wins": True}}
    update_package_json(pkg, "speculation.json", {
        "k_star": 3, "dtype": "float32", "hardware": {"device": "cpu"},
        "batch": {"k_star": {"1": 3, "2": 2, "4": 1}, "tree": tree}})
    got = _decode(decode_setup, pkg, "limit=3", "batch_size=3", "baseline=false")["summary"]
    assert (got["tree"], got["k"], got["tree_size"]) == (True, 2, 4)
    assert got["k_source"] == "speculation.json (batch 2, tree)"
    got = _decode(decode_setup, pkg, "limit=3", "batch_size=3", "baseline=false",
                  "batch_layout=packed")["summary"]
    assert (got["tree"], got["k"]) == (False, 2)
    tree["2"]["wins"] = False
    update_package_json(pkg, "speculation.json", {
        "k_star": 3, "dtype": "float32", "hardware": {"device": "cpu"},
        "batch": {"k_star": {"1": 3, "2": 2, "4": 1}, "tree": tree}})
    got = _decode(decode_setup, pkg, "limit=3", "batch_size=3", "baseline=false")["summary"]
    assert (got["tree"], got["k"]) == (False, 2)


def test_batched_eagle_trees_decode_like_batch_one(decode_setup):
    path, _ = draft_package(decode_setup, "eagle")
    opts = ("k=3", "limit=3", "fallback=false", "tree=tree", "tree_size=8", "tree_topk=3")
    alone = _decode(decode_setup, path, *opts, "adaptive_k=false", "suffix=false")
    batched = _decode(decode_setup, path, *opts, "batch_size=2")
    assert batched["summary"]["tree"] is True and batched["summary"]["tree_size"] == 8
    assert [s["output_ids"] for s in batched["samples"]] == [
        s["output_ids"] for s in alone["samples"]]
    assert [(s["tau"], s["target_forwards"]) for s in batched["samples"]] == [
        (s["tau"], s["target_forwards"]) for s in alone["samples"]]


def test_bad_batch_settings_are_refused(decode_setup):
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        _decode(decode_setup, decode_setup["lm"], "batch_size=0")
    with pytest.raises(ValueError, match="tree=chain for the 'lm-tree' draft"):
        _decode(decode_setup, decode_setup["lm"], "batch_size=2", "tree=tree")
    with pytest.raises(ValueError, match="batched trees use batch_layout=padded"):
        _decode(decode_setup, decode_setup["lm"], "batch_size=2", "tree=tree",
                "batch_layout=packed")
    with pytest.raises(ValueError, match="time_budget_s is per request"):
        _decode(decode_setup, decode_setup["lm"], "batch_size=2", "time_budget_s=5")
    with pytest.raises(ValueError, match="prompt lookup's batched alternative"):
        _decode(decode_setup, "lookup", "batch_size=2")
    with pytest.raises(ValueError, match="batch_layout=ragged: use one of padded, packed"):
        _decode(decode_setup, decode_setup["lm"], "batch_size=2", "batch_layout=ragged")
