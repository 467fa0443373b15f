"""Greedy exactness check (eval/exactness.py): tie/gap logic on tiny models, the whole check on a
tiny target (and its failure on a broken verifier), and the check on the real target."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_char_tokenizer, tiny_llama

from draftsmith.data.target import load_target
from draftsmith.eval import exactness

REPO = Path(__file__).resolve().parents[2]
PREFIX = [1, 5, 9, 13, 5, 9, 20]
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a short poem."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 plus 30?"]},
]
FAMILY_NAMES = ["lm-chain", "lm-tree", "medusa-tree", "eagle-chain", "eagle-tree"]
STANDIN_NAMES = {"plain", "lookup", "suffix", *(f"{n}@untrained" for n in FAMILY_NAMES)}
HYBRID_NAMES = {f"{n}+suffix@untrained" for n in FAMILY_NAMES}  # each beside the suffix proposer


def _last_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1]  # (H,)


def _boost(model, ids: list[int], tokens: list[int], margin: float) -> None:
    """Give ``tokens`` the same logit, ``margin`` above the current maximum, after ``ids``
    (tied embeddings: the rows are also input embeddings, so ``tokens`` must not occur in
    ``ids``)."""
    h = _last_hidden(model, ids)
    with torch.no_grad():
        top = model(torch.tensor([ids])).logits[0, -1].max()
        row = h * (top + margin) / h.dot(h)  # row . h = top + margin
        for t in tokens:
            model.lm_head.weight[t] = row


# ----------------------------------------------------------------------------- tie logic
def test_first_divergence():
    assert exactness.first_divergence([3, 4, 5], [3, 4, 5]) is None
    assert exactness.first_divergence([3, 4, 5], [3, 7, 5]) == 1
    assert exactness.first_divergence([3, 4, 5], [9]) == 0
    assert exactness.first_divergence([3, 4], [3, 4, 2]) == 2  # prefix: the shorter's length
    assert exactness.first_divergence([], [2]) == 0


def test_top2_gap_is_the_full_forward_gap():
    model = tiny_llama(seed=1)
    gap, t1, t2 = exactness.top2_gap(model, PREFIX)
    with torch.no_grad():
        logits = model(torch.tensor([PREFIX])).logits[0, -1]
    order = logits.argsort(descending=True)
    assert (t1, t2) == (int(order[0]), int(order[1]))
    assert gap == pytest.approx(float(logits[order[0]] - logits[order[1]]), abs=1e-6)
    with pytest.raises(ValueError, match="at least one token"):
        exactness.top2_gap(model, [])


def test_divergence_at_an_exact_tie_is_a_tie():
    model = tiny_llama(seed=2)
    a, b, c = 60, 61, 62  # not in PREFIX
    _boost(model, PREFIX, [a, b], margin=4.0)
    gap, t1, t2 = exactness.top2_gap(model, PREFIX)
    assert {t1, t2} == {a, b} and gap < 1e-5
    info = exactness.diagnose(model, PREFIX, [a, 7, 8], [b, 9], tie_gap=1e-3)
    assert info["index"] == 0 and info["tie"] is True
    assert (info["reference_token"], info["output_token"]) == (a, b)
    # picking a token outside the tied pair is never a tie, whatever the gap
    third = exactness.diagnose(model, PREFIX, [a, 7, 8], [c, 9], tie_gap=1e-3)
    assert third["tie"] is False and third["top2_gap"] == pytest.approx(info["top2_gap"])
    # a threshold of zero accepts no tie at all
    assert exactness.diagnose(model, PREFIX, [a], [b], tie_gap=0.0)["tie"] is False


def test_divergence_with_a_clear_winner_is_not_a_tie():
    model = tiny_llama(seed=3)
    a = 60
    _boost(model, PREFIX, [a], margin=3.0)
    gap, t1, t2 = exactness.top2_gap(model, PREFIX)
    assert t1 == a and gap == pytest.approx(3.0, rel=1e-3)
    info = exactness.diagnose(model, PREFIX, [a, 4], [t2, 4], tie_gap=1e-3)
    assert info["tie"] is False and info["top2"] == [a, t2]


def test_later_divergence_uses_the_reference_prefix():
    model = tiny_llama(seed=4)
    ref = [30, 31, 32]
    a, b = 60, 61
    _boost(model, PREFIX + ref[:2], [a, b], margin=4.0)  # tie only after the first two tokens
    info = exactness.diagnose(model, PREFIX, ref[:2] + [a], ref[:2] + [b], tie_gap=1e-3)
    assert info["index"] == 2 and info["tie"] is True
    memo: dict = {}
    exactness.diagnose(model, PREFIX, ref[:2] + [a], ref[:2] + [b], 1e-3, memo)
    assert list(memo) == [tuple(PREFIX + ref[:2])]
    assert exactness.diagnose(model, PREFIX, ref, ref, 1e-3) is None


def test_output_running_past_the_reference_is_not_a_tie():
    model = tiny_llama(seed=5)
    info = exactness.diagnose(model, PREFIX, [4, 2], [4, 2, 7], tie_gap=1e-3)
    assert info["index"] == 2 and info["top2_gap"] is None and info["tie"] is False


# ----------------------------------------------------------------------------- whole check, tiny
@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("exactness")
    target_dir = root / "target"
    # a wide init: a default tiny random model repeats one token, which would hide divergences
    tiny_llama(seed=0, initializer_range=0.3).save_pretrained(target_dir)
    make_char_tokenizer().save_pretrained(target_dir)
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return {"root": root, "target": target_dir, "questions": questions,
            "loaded": load_target(target_dir)}


def _tiny_overrides(setup, *extra: str) -> list[str]:
    return [f"target_path={setup['target']}", f"prompts=[{setup['questions']}]", "per_set=2",
            "max_new_tokens=12", "k=3", "tree_topk=3", "tree_size=10",
            "standins.medusa.num_heads=3", *extra]


def test_tiny_check_passes_for_every_standin_proposer(tiny_setup):
    out = tiny_setup["root"] / "tiny.json"
    threads_before = torch.get_num_threads()
    res = exactness.run_overrides(_tiny_overrides(tiny_setup, f"out={out}", "threads=1"),
                                  tiny_setup["loaded"])
    assert set(res["proposers"]) == STANDIN_NAMES | HYBRID_NAMES
    for name, r in res["proposers"].items():
        assert (r["identical"], r["total"], r["non_ties"]) == (2, 2, 0), name
    assert res["passed"] and res["failures"] == []
    assert torch.get_num_threads() == threads_before  # run() restores the thread count
    saved = json.loads(out.read_text())
    assert saved["passed"] and set(saved["proposers"]) == STANDIN_NAMES | HYBRID_NAMES
    assert {"settings", "hardware", "date", "references"} <= set(saved)
    assert all(0 < len(v) <= 12 for v in saved["references"].values())
    assert any(len(set(v)) > 3 for v in saved["references"].values())  # not one repeated token
    # the stand-in draft LM copies both tiny layers: full acceptance paths are exercised too
    assert res["proposers"]["lm-chain@untrained"]["acceptance_rate"] > 0.5


def test_tiny_check_covers_a_frequent_token_draft_vocabulary(tiny_setup):
    from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm
    from draftsmith.heads.package import save_package, update_package_json
    from draftsmith.heads.vocab import frequency_record

    loaded = tiny_setup["loaded"]
    cfg = DraftLMConfig.matching(loaded.model.config, 1, init="target")
    pkg = save_package(tiny_setup["root"] / "lm", "lm", build_draft_lm(cfg, loaded.model).eval(),
                       cfg, loaded.identity, tokenizer=loaded.tokenizer)
    vocab = loaded.model.config.vocab_size
    update_package_json(pkg, "token_frequency.json",
                        frequency_record(torch.arange(vocab, 0, -1), "t"))
    res = exactness.run_overrides(_tiny_overrides(tiny_setup, f"drafts=[{pkg}]", "draft_vocab=40"),
                                  loaded)
    assert set(res["proposers"]) == {"plain", "lookup", "suffix", "lm-chain@lm", "lm-tree@lm",
                                     "lm-chain+suffix@lm", "lm-tree+suffix@lm",
                                     "lm-chain/40ids@lm", "lm-tree/40ids@lm"}
    assert res["passed"]
    assert all(r["identical"] == r["total"] == 2 for r in res["proposers"].values())


def test_tiny_check_fails_on_a_verifier_that_accepts_everything(tiny_setup, monkeypatch):
    from draftsmith.eval.decoding import decoder

    def accept_all(p, q, draft, generator):  # broken: accepts every draft, bonus = argmax
        return int(draft.shape[0]), int(p[-1].argmax())

    real_greedy = decoder.verify_greedy

    def accept_all_greedy(target_argmax, tokens, parents=None):  # the T = 0 chain path, broken
        if parents is not None:
            return real_greedy(target_argmax, tokens, parents)
        return list(range(int(tokens.shape[0]))), int(target_argmax[-1])

    monkeypatch.setattr(decoder, "verify_chain", accept_all)
    monkeypatch.setattr(decoder, "verify_greedy", accept_all_greedy)
    res = exactness.run_overrides(_tiny_overrides(tiny_setup), tiny_setup["loaded"])
    for name in ("lookup", "eagle-chain@untrained"):  # chains whose drafts are often wrong
        broken = res["proposers"][name]
        assert broken["non_ties"] >= 1 and broken["fraction"] < 1.0, name
        assert any(f.startswith(f"{name}:") for f in res["failures"]), name
    assert not res["passed"]
    assert res["proposers"]["plain"]["identical"] == 2  # plain drafts nothing: unaffected


def test_only_and_the_per_round_hybrid(tiny_setup):
    """``only`` keeps the named proposers; ``suffix_modes`` adds decode.py's per-round hybrid."""
    names = ["suffix", "eagle-tree+suffix", "eagle-tree+suffix-auto"]
    res = exactness.run_overrides(_tiny_overrides(tiny_setup, f"only=[{','.join(names)}]",
                                                  "suffix_modes=[merge,auto]"),
                                  tiny_setup["loaded"])
    assert set(res["proposers"]) == {"suffix", "eagle-tree+suffix@untrained",
                                     "eagle-tree+suffix-auto@untrained"}
    assert res["passed"] and all(r["identical"] == 2 for r in res["proposers"].values())
    with pytest.raises(ValueError, match="suffix_modes="):
        exactness.run_overrides(_tiny_overrides(tiny_setup, "suffix_modes=[both]"),
                                tiny_setup["loaded"])


def test_only_takes_full_names_and_refuses_names_that_match_nothing(tiny_setup):
    """A name with its draft (``eagle-chain@untrained``) selects that one; a name that matches
    no proposer is refused with the names there are, not silently skipped (a run that then
    checked plain decoding alone would look like a pass)."""
    res = exactness.run_overrides(_tiny_overrides(tiny_setup, "only=[eagle-chain@untrained]",
                                                  "suffix=false"), tiny_setup["loaded"])
    assert set(res["proposers"]) == {"eagle-chain@untrained"}
    with pytest.raises(ValueError, match=r"\['eagle-chain@other'\] name no proposer.*"
                                         "eagle-chain@untrained"):
        exactness.run_overrides(_tiny_overrides(tiny_setup, "only=[plain,eagle-chain@other]"),
                                tiny_setup["loaded"])


def test_bad_settings_are_rejected(tiny_setup):
    with pytest.raises(ValueError, match="min_fraction"):
        exactness.run_overrides(_tiny_overrides(tiny_setup, "min_fraction=1.5"),
                                tiny_setup["loaded"])
    with pytest.raises(ValueError, match="prompts is empty"):
        exactness.run_overrides(_tiny_overrides(tiny_setup, "prompts=[]"), tiny_setup["loaded"])


def test_cli_exit_code_and_report(tiny_setup):
    out = tiny_setup["root"] / "cli.json"
    cmd = [sys.executable, str(REPO / "eval" / "exactness.py"), *_tiny_overrides(tiny_setup),
           "per_set=1", "max_new_tokens=6", f"out={out}"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "greedy exactness" in proc.stdout
    assert json.loads(out.read_text())["passed"] is True


# ----------------------------------------------------------------------------- real target
@pytest.mark.real
def test_real_target_every_standin_proposer_is_exact(real_target, tmp_path):
    # one thread: on two shared cores a second thread mostly waits for the busy core; one prompt
    # per set and smaller trees than the defaults keep the test quick and still branch at every
    # depth (bench/exactness*.json hold the wider runs); the hybrids run on the tiny target
    res = exactness.run_overrides(["prompts=[humaneval,sharegpt]", "per_set=1", "suffix=false",
                                   "max_new_tokens=24", "drafts=[]", "threads=1", "k=3",
                                   "standins.lm.num_layers=1", "tree_topk=3", "tree_size=12",
                                   "medusa_branching=[3,2,1]",
                                   f"out={tmp_path / 'exactness.json'}"], real_target)
    assert set(res["proposers"]) == STANDIN_NAMES
    assert len(res["references"]) == 2
    assert all(0 < len(v) <= 24 for v in res["references"].values())
    for name, r in res["proposers"].items():
        assert r["total"] == 2, name
        assert r["non_ties"] == 0, (name, r["divergences"])
        # in fp32 no output needs the tie rule
        assert (r["identical"], r["ties"]) == (2, 0), (name, r["divergences"])
    # untrained drafts are rarely right; prompt lookup makes sure accepted drafts were rolled in
    assert res["proposers"]["lookup"]["acceptance_rate"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_gqa_verify_forward_is_bitwise_equal_on_the_real_target(real_target, dtype,
                                                                       monkeypatch):
    """README: our masked multi-token forwards use torch's native grouped-query attention
    instead of transformers' copy of the KV cache; on the real target the logits are the same
    bits in fp32 and bf16 (a tree forward over 6 tokens after a chat prompt)."""
    import contextlib
    import copy

    import transformers.integrations.sdpa_attention as sdpa

    import draftsmith.eval.decoding.target_model as tm

    model = copy.deepcopy(real_target.model).to(dtype).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA target
    prompt = real_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours and say why the sky is blue."}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    tokens = torch.tensor([504, 3359, 314, 1345, 28, 260])
    parents = torch.tensor([-1, 0, 1, 0, 3, 2])
    copies: list[int] = []
    repeat_kv = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: copies.append(n) or repeat_kv(h, n))
    logits = {}
    for native in (True, False):
        if not native:  # transformers' default: the cache copied to repeat the KV heads
            monkeypatch.setattr(tm, "native_gqa", lambda enabled=True: contextlib.nullcontext())
        tgt = tm.Target(model)
        tgt.prefill(torch.tensor(prompt))
        n_before = len(copies)
        logits[native] = tgt.forward_tree(tokens, parents).logits
        assert (len(copies) > n_before) == (not native)  # the two paths really differ
    assert model.dtype == dtype
    assert torch.equal(logits[True], logits[False])
