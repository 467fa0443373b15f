"""eval/decode.py and eval/measure.py end to end on a tiny target saved with a chat tokenizer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_char_tokenizer, tiny_llama

from data.target import load_target
from eval import decode, measure
from eval.draft import settle
from eval.report import parse_costs
from heads.draft_lm import DraftLMConfig, build_draft_lm
from heads.eagle import EagleConfig, build_eagle
from heads.medusa import MedusaConfig, build_medusa
from heads.package import PackageIntegrityError, load_package, save_package, update_package_json
from scripts.export import export_package

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem.", "Again."]},
    {"question_id": 82, "category": "math", "turns": ["What is 12 plus 30?"]},
    {"question_id": 83, "category": "coding", "turns": ["Print hello in code."]},
]
SUMMARY_KEYS = {"tokens_generated", "target_forwards", "tau", "acceptance_rate", "alpha",
                "alpha_cumulative", "draft_time_s", "verify_time_s", "wall_time_s", "tokens_per_s",
                "speedup", "k", "k_source", "draft_kind", "lossless", "device", "dtype"}
PLAN = {"k": None, "tree": "auto", "tree_size": None, "tree_topk": 8, "medusa_branching": None,
        "draft_vocab": None, "device": "cpu"}  # decode.py's defaults: everything measured
SAMPLE_KEYS = {"id", "category", "prompt_ids", "output_ids", "output_text", "tau"}


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target dir (weights + chat tokenizer), a question file and a draft LM package."""
    root = tmp_path_factory.mktemp("decode_cli")
    target_dir = root / "target"
    tiny_llama(seed=0).save_pretrained(target_dir)
    make_char_tokenizer().save_pretrained(target_dir)
    loaded = load_target(target_dir)
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    cfg = DraftLMConfig.matching(loaded.model.config, 1, init="target")
    draft = _randomize(build_draft_lm(cfg, loaded.model), seed=1)  # partly agrees with the target
    pkg = save_package(root / "lm", "lm", draft, cfg, loaded.identity, tokenizer=loaded.tokenizer)
    return {"root": root, "target": target_dir, "loaded": loaded, "questions": questions, "lm": pkg}


def _decode(setup, draft, *extra: str) -> dict:
    return decode.run_overrides([f"draft={draft}", f"target_path={setup['target']}",
                                 f"prompts={setup['questions']}", "max_new_tokens=12",
                                 "temperature=0", *extra])


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_cli_writes_the_json_contract_and_greedy_equals_plain_decoding(setup):
    out = setup["root"] / "run.json"
    proc = subprocess.run([sys.executable, str(REPO / "eval" / "decode.py"), f"draft={setup['lm']}",
                           f"target_path={setup['target']}", f"prompts={setup['questions']}",
                           "limit=2", "max_new_tokens=12", "temperature=0", "k=3", f"out={out}"],
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
    tok, model = setup["loaded"].tokenizer, setup["loaded"].model
    for s, q in zip(samples, QUESTIONS):
        assert s["id"] == str(q["question_id"]) and s["category"] == q["category"]
        chat = [{"role": "user", "content": q["turns"][0]}]
        assert s["prompt_ids"] == list(tok.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True)["input_ids"])
        assert tok.decode(s["prompt_ids"]).endswith("<|im_start|>assistant\n")
        assert s["output_ids"] == _hf_greedy(model, s["prompt_ids"], 12)
        assert s["output_text"] == tok.decode(s["output_ids"], skip_special_tokens=True)
    assert "k (source)" in proc.stdout  # the printed summary table


def test_default_k_without_speculation_json_is_four(setup):
    summary = _decode(setup, setup["lm"], "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (4, "default")


def test_measure_writes_a_verified_speculation_json_that_decode_uses(setup, tmp_path):
    pkg = tmp_path / "lm"
    import shutil
    shutil.copytree(setup["lm"], pkg)
    rec = measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                                 f"prompts={setup['questions']}", "limit=2", "max_new_tokens=10",
                                 "temperature=0", "k_measure=3", "repeats=2", "min_reached=1",
                                 "tree_sizes=[]"])  # the chain's K* only (trees: tests below)
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
    summary = _decode(setup, pkg, "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (rec["k_star"], "speculation.json")
    update_package_json(pkg, "speculation.json", {**on_disk, "k_star": 2})  # whatever K* says
    summary = _decode(setup, pkg, "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (2, "speculation.json")
    # a K* measured in another dtype is not this run's K*
    summary = _decode(setup, pkg, "limit=1", "baseline=false", "dtype=bfloat16")["summary"]
    assert summary["k"] == 4 and summary["k_source"] == "default (K* in speculation.json is for float32)"
    (pkg / "speculation.json").write_text(json.dumps({**on_disk, "k_star": 5}))  # not via update
    with pytest.raises(PackageIntegrityError, match="speculation.json"):
        _decode(setup, pkg, "limit=1")


def _draft_package(setup, kind: str) -> tuple[Path, str]:
    model, ident = setup["loaded"].model, setup["loaded"].identity
    if kind == "lm":
        return setup["lm"], "hf"
    if kind == "medusa":
        cfg = MedusaConfig(num_heads=3, num_layers=1)
        module, fmt = _randomize(build_medusa(cfg, model), seed=2), "medusa"
    else:
        cfg = EagleConfig()
        module, fmt = _randomize(build_eagle(cfg, model), seed=3), "eagle"
    return save_package(setup["root"] / kind, kind, module, cfg, ident), fmt


@pytest.mark.parametrize("kind", ["lm", "medusa", "eagle"])
def test_an_export_decodes_like_its_package(setup, kind):
    pkg, fmt = _draft_package(setup, kind)
    out = export_package(pkg, fmt, setup["root"] / f"export-{kind}", target=setup["loaded"])
    runs = [_decode(setup, d, "k=3", "adaptive_k=false", "fallback=false", "baseline=false",
                    "tree_topk=3", "tree_size=10") for d in (pkg, out)]
    a, b = runs
    assert a["summary"]["drafted"] > 0  # the draft really proposed
    assert a["summary"]["draft_kind"] == b["summary"]["draft_kind"]
    assert [s["output_ids"] for s in a["samples"]] == [s["output_ids"] for s in b["samples"]]
    assert [s["tau"] for s in a["samples"]] == [s["tau"] for s in b["samples"]]
    assert a["summary"]["alpha"] == b["summary"]["alpha"]
    assert a["summary"]["target_forwards"] == b["summary"]["target_forwards"]


def test_bad_draft_and_prompts_are_clear_errors(setup, tmp_path):
    with pytest.raises(ValueError, match="not a draft package"):
        _decode(setup, tmp_path)
    with pytest.raises(ValueError, match="unknown prompt set"):
        decode.run_overrides([f"target_path={setup['target']}", "prompts=nosuchset"])
    with pytest.raises(ValueError, match="needs draft=DIR"):
        measure.run_overrides([f"target_path={setup['target']}", "draft=none"])


def test_bench_decoding_section_on_a_tiny_target(setup, tmp_path, capsys):
    from omegaconf import OmegaConf

    from scripts import bench

    cfg = OmegaConf.merge(OmegaConf.load(bench.CONF_FILE), {
        "questions": str(setup["questions"]), "limit": 2, "max_new_tokens": 6,
        "temperatures": [0.0, 1.0], "lm": str(setup["lm"]), "eagle": str(tmp_path / "missing"),
        "k": 2, "target_path": str(setup["target"]), "out_dir": str(tmp_path / "bench"),
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
        assert r["k_fixed"] == 2 and r["repeats"] == 3 and len(r["per_prompt_defaults_vs_plain"]) == 2
        assert r["fixed_vs_plain"] > 0 and r["defaults_vs_plain"] >= r["defaults_vs_plain_min"] > 0
    assert "## Fallback bound" in md and "| 0 | useless-lm | 2 |" in md
    assert "| 0 | ours lm | 2 |" in md.split("same draft LM and K")[1]


def test_bench_runs_the_measured_lm_tree_against_assisted_at_its_depth(setup, tmp_path):
    import shutil

    from omegaconf import OmegaConf

    from heads.package import update_package_json
    from scripts import bench

    pkg = tmp_path / "lm"
    shutil.copytree(setup["lm"], pkg)
    from heads.vocab import frequency_record

    vocab = setup["loaded"].model.config.vocab_size
    update_package_json(pkg, "token_frequency.json",
                        frequency_record(torch.arange(vocab, 0, -1), "test"))
    update_package_json(pkg, "speculation.json", {
        "k_star": 1, "dtype": "float32", "hardware": {"device": "cpu"},
        "measured_speedup": {"k": 1, "speedup": 1.0},
        "tree": {"depth": 2, "total_tokens": 4, "speedup": 1.1}, "draft_vocab": {"size": 40}})
    cfg = OmegaConf.merge(OmegaConf.load(bench.CONF_FILE), {
        "questions": str(setup["questions"]), "limit": 1, "max_new_tokens": 6,
        "temperatures": [0.0], "lm": str(pkg), "tree_topk": 2, "prompt_lookup": False,
        "medusa": str(_draft_package(setup, "medusa")[0]),
        "auto_rows": False, "target_path": str(setup["target"]), "out_dir": str(tmp_path / "b"),
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


def test_useless_copy_proposes_wrong_tokens_at_the_same_cost(setup, tmp_path):
    from scripts import bench

    path = bench.useless_copy("lm", str(setup["lm"]), setup["loaded"], tmp_path)
    good = load_package(setup["lm"]).module
    bad = load_package(path, target=setup["loaded"]).module
    ids = torch.randint(0, good.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        g, b = good(ids).logits.argmax(-1), bad(ids).logits.argmax(-1)
    assert torch.equal(b, (g + 1) % good.config.vocab_size)  # always the neighbour: never right
    # the same computation: same layers, same LM-head shape (only untied from the embeddings)
    assert bad.config.num_hidden_layers == good.config.num_hidden_layers
    assert bad.get_output_embeddings().weight.shape == good.get_output_embeddings().weight.shape


def _measure_copy(setup, tmp_path, kind: str, *overrides: str) -> tuple[Path, dict]:
    """Copy the ``kind`` package and measure it on 2 prompts x 8 tokens (plus ``overrides``)."""
    import shutil

    src, _ = _draft_package(setup, kind)
    pkg = tmp_path / kind
    shutil.copytree(src, pkg)
    rec = measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                                 f"prompts={setup['questions']}", "limit=2", "max_new_tokens=8",
                                 "temperature=0", "k_measure=2", "repeats=2", "min_reached=1",
                                 *overrides])
    return pkg, rec


def test_measure_picks_an_eagle_tree_shape_that_decode_uses(setup, tmp_path):
    pkg, rec = _measure_copy(setup, tmp_path, "eagle", "tree_topk=3", "tree_depths=[1,2]",
                             "tree_sizes=[3,6]")
    tree = rec["tree"]
    # depth 1 holds at most topk = 3 nodes: size 6 there is the size-3 tree, run once
    assert {(g["depth"], g["total_tokens"]) for g in tree["grid"]} == {(1, 3), (2, 3), (2, 6)}
    best = max(tree["grid"], key=lambda g: g["tokens_per_s"])
    assert (tree["depth"], tree["total_tokens"]) == (best["depth"], best["total_tokens"])
    assert set(rec["costs"]["t_verify_tree"]) == {"3", "6"}
    # (random tiny models: whether the tree paid is chance; say it did)
    update_package_json(pkg, "speculation.json", {**rec, "tree": {**tree, "speedup": 1.1}})
    summary = _decode(setup, pkg, "limit=1", "baseline=false", "tree_topk=3")["summary"]
    assert summary["draft_kind"] == "eagle-tree"
    assert (summary["k"], summary["k_source"], summary["tree_size"]) == (
        tree["depth"], "speculation.json (tree)", tree["total_tokens"])
    summary = _decode(setup, pkg, "limit=1", "baseline=false", "tree_topk=3", "k=3",
                      "tree_size=5")["summary"]
    assert (summary["k"], summary["k_source"], summary["tree_size"]) == (3, "config", 5)
    summary = _decode(setup, pkg, "limit=1", "baseline=false", "tree=chain")["summary"]
    assert (summary["k"], summary["k_source"], summary["tree_size"]) == (
        rec["k_star"] or 0, "speculation.json", None)
    no_search = measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                                       f"prompts={setup['questions']}", "limit=1",
                                       "max_new_tokens=4", "k_measure=1", "repeats=1",
                                       "min_reached=1", "rerun=false", "write=false",
                                       "tree_sizes=[]"])
    assert "tree" not in no_search and no_search["costs"]["t_verify_tree"] == {}
    with pytest.raises(ValueError, match="tree_depths and tree_sizes take values >= 1"):
        measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}", "tree_depths=[0,2]"])


def test_measure_and_decode_draft_lm_tree(setup, tmp_path):
    pkg, rec = _measure_copy(setup, tmp_path, "lm", "tree_topk=2", "tree_depths=[2]",
                             "tree_sizes=[4]")
    assert [(g["depth"], g["total_tokens"]) for g in rec["tree"]["grid"]] == [(2, 4)]
    want_tree = settle({**PLAN, "dtype": "float32"}, load_package(pkg)).tree
    summary = _decode(setup, pkg, "limit=1", "tree_topk=2", "k_max=2")["summary"]
    assert summary["draft_kind"] == ("lm-tree" if want_tree else "lm")
    assert summary["matches_baseline"] == 1.0  # greedy: token-identical to plain decoding
    summary = _decode(setup, pkg, "limit=1", "tree=tree", "tree_topk=2", "k=2", "tree_size=5",
                      "baseline=false")["summary"]
    assert (summary["draft_kind"], summary["k"], summary["tree_size"]) == ("lm-tree", 2, 5)
    assert _decode(setup, pkg, "limit=1", "tree=chain", "baseline=false")["summary"][
        "draft_kind"] == "lm"


def test_measure_picks_a_medusa_tree_that_decode_uses(setup, tmp_path):
    pkg, rec = _measure_copy(setup, tmp_path, "medusa", "medusa_branchings=[[2],[2,1],[1,1,1,1,1]]")
    tree = rec["tree"]
    # the package has 3 heads: a 5-level tree cannot be served and is not tried
    assert [g["branching"] for g in tree["grid"]] == [[2], [2, 1]]
    best = max(tree["grid"], key=lambda g: g["tokens_per_s"])
    assert (tree["branching"], tree["depth"]) == (best["branching"], len(best["branching"]))
    assert set(rec["costs"]["t_verify_tree"]) == {str(g["total_tokens"]) for g in tree["grid"]}
    # (random tiny models: whether the tree paid is chance; say it did, the K* = 0 case is below)
    update_package_json(pkg, "speculation.json", {**rec, "tree": {**tree, "speedup": 1.1}})
    summary = _decode(setup, pkg, "limit=1")["summary"]
    assert (summary["k"], summary["k_source"]) == (tree["depth"], "speculation.json (tree)")
    assert summary["matches_baseline"] == 1.0
    assert _decode(setup, pkg, "limit=1", "baseline=false", "medusa_branching=[3,1]")[
        "summary"]["k_source"] != "speculation.json (tree)"
    medusa = load_package(pkg)
    plan = settle({**PLAN, "dtype": "float32"}, medusa)
    assert (list(plan.medusa_branching), plan.k_source) == (tree["branching"],
                                                            "speculation.json (tree)")
    plan = settle({**PLAN, "dtype": "bfloat16"}, medusa)  # measured in another dtype
    assert (plan.medusa_branching, plan.k_source[:7]) == ((4, 2, 2, 1), "default")
    # K* = 0 and the best tree a loss too: the default is plain decoding
    update_package_json(pkg, "speculation.json", {**rec, "k_star": 0,
                                                  "tree": {**tree, "speedup": 0.9}})
    summary = _decode(setup, pkg, "limit=1", "baseline=false")["summary"]
    assert (summary["k"], summary["k_source"]) == (0, "speculation.json (K* = 0, best tree 0.90x)")
    with pytest.raises(ValueError, match="medusa_branchings takes non-empty lists"):
        measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                               "medusa_branchings=[[2,0]]"])


@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_draft_vocab_is_measured_and_decoded_losslessly(setup, tmp_path, kind):
    import shutil

    from heads.vocab import TOKEN_FREQUENCY, frequency_record

    src, _ = _draft_package(setup, kind)
    pkg = tmp_path / kind
    shutil.copytree(src, pkg)
    vocab = setup["loaded"].model.config.vocab_size
    with pytest.raises(FileNotFoundError, match="scripts/token_frequency.py draft="):
        _decode(setup, pkg, "limit=1", "draft_vocab=40")
    counts = torch.arange(vocab, 0, -1)  # smaller ids more frequent
    update_package_json(pkg, TOKEN_FREQUENCY, frequency_record(counts, "test"))
    summary = _decode(setup, pkg, "limit=2", "k=2", "draft_vocab=40", "tree_topk=3")["summary"]
    assert summary["draft_vocab"] == 40 and summary["matches_baseline"] == 1.0
    assert summary["drafted"] > 0
    # nothing measured yet: the whole vocabulary
    assert _decode(setup, pkg, "limit=1", "k=2", "baseline=false")["summary"]["draft_vocab"] is None
    rec = measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                                 f"prompts={setup['questions']}", "limit=2", "max_new_tokens=8",
                                 "temperature=0", "k_measure=2", "repeats=2", "min_reached=1",
                                 "tree_topk=3", "tree_depths=[2]", "tree_sizes=[6]",
                                 "draft_vocab_sizes=[20,40,500]"])
    dv = rec["draft_vocab"]
    assert [g["size"] for g in dv["grid"]] == [None, 20, 40]  # 500 >= the vocabulary: skipped
    best = max(dv["grid"], key=lambda g: g["tokens_per_s"])
    assert dv["size"] == best["size"] and all(g["draft_ms_per_step"] > 0 for g in dv["grid"])
    # decode's default is the measured size (say 20 won: random tiny models decide by chance)
    update_package_json(pkg, "speculation.json", {**rec, "draft_vocab": {**dv, "size": 20}})
    summary = _decode(setup, pkg, "limit=1", "tree_topk=3")["summary"]
    assert summary["draft_vocab"] == 20 and summary["matches_baseline"] == 1.0
    assert _decode(setup, pkg, "limit=1", "baseline=false", "draft_vocab=full")["summary"][
        "draft_vocab"] is None
    assert settle({**PLAN, "dtype": "bfloat16"}, load_package(pkg)).draft_vocab is None
    # an export carries the counts with speculation.json and decodes the same way
    exp = export_package(pkg, "hf" if kind == "lm" else "eagle", tmp_path / "export",
                         target=setup["loaded"])
    assert _decode(setup, exp, "limit=1", "baseline=false")["summary"]["draft_vocab"] == 20
    # a folder with the measurement but without the counts decodes over the whole vocabulary
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    update_package_json(bare, "speculation.json", {**rec, "draft_vocab": {**dv, "size": 20}})
    assert _decode(setup, bare, "limit=1", "baseline=false")["summary"]["draft_vocab"] is None
    with pytest.raises(ValueError, match="draft_vocab_sizes takes"):
        measure.run_overrides([f"draft={pkg}", f"target_path={setup['target']}",
                               "draft_vocab_sizes=[0]"])


def test_bad_draft_vocab_values_are_refused(setup):
    with pytest.raises(ValueError, match="allowed null .measured., full, or a number"):
        _decode(setup, setup["lm"], "limit=1", "draft_vocab=-3")
    with pytest.raises(ValueError, match="allowed null .measured., full, or a number"):
        _decode(setup, setup["lm"], "limit=1", "draft_vocab=some")
    pkg, _ = _draft_package(setup, "medusa")
    with pytest.raises(ValueError, match=r"applies to \('lm', 'eagle'\) drafts, not medusa"):
        _decode(setup, pkg, "limit=1", "draft_vocab=40")


