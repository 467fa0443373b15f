"""eval/session.py: prompt records through the chat template, paired plain / speculative
decoding in one process, and the sampling keys of a decode config."""
from __future__ import annotations

import pytest
from conftest import QUESTIONS, make_char_tokenizer, randomize, tiny_llama
from omegaconf import OmegaConf

from data.prompts import PromptSetError
from eval.proposers import DraftLMProposer, PlainProposer, PromptLookupProposer
from eval.session import Sampling, decoder, eos_ids, paired, prompt_records
from heads.draft_lm import DraftLMConfig, build_draft_lm


def _chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ----- prompts -----------------------------------------------------------------------------------
def test_prompt_records_apply_the_chat_template_to_the_first_turn(decode_setup):
    tok = decode_setup["loaded"].tokenizer
    records = prompt_records(decode_setup["questions"], tok)
    assert [(r["id"], r["category"]) for r in records] == [
        (str(q["question_id"]), q["category"]) for q in QUESTIONS]
    for r, q in zip(records, QUESTIONS):
        assert set(r) == {"id", "category", "prompt_ids"}
        assert r["prompt_ids"] == _chat_ids(tok, q["turns"][0])
        text = tok.decode(r["prompt_ids"])
        assert text.startswith("<|im_start|>system\n") and q["turns"][0] in text
        assert text.endswith("<|im_start|>user\n" + q["turns"][0] + "<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert "Again." not in tok.decode(records[0]["prompt_ids"])  # later turns are not prompts


def test_prompt_records_limit_and_empty_sets(decode_setup, tmp_path):
    tok, questions = decode_setup["loaded"].tokenizer, decode_setup["questions"]
    assert [r["id"] for r in prompt_records(questions, tok, limit=2)] == ["81", "82"]
    assert len(prompt_records(questions, tok, limit="1")) == 1  # a config value as text
    assert len(prompt_records(questions, tok, limit=10)) == len(QUESTIONS)
    with pytest.raises(ValueError, match=r"no prompts loaded from prompts=.* \(limit=0\)"):
        prompt_records(questions, tok, limit=0)
    empty = tmp_path / "question.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptSetError, match="holds no questions"):
        prompt_records(empty, tok)


def test_prompt_records_need_a_tokenizer_with_a_chat_template(decode_setup):
    with pytest.raises(ValueError, match="the target has no tokenizer"):
        prompt_records(decode_setup["questions"], None)
    tok = make_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        prompt_records(decode_setup["questions"], tok)


# ----- paired decoding ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def records(decode_setup):
    return prompt_records(decode_setup["questions"], decode_setup["loaded"].tokenizer, limit=2)


@pytest.fixture(scope="module")
def lively():
    """A tiny target whose greedy outputs vary (the default tiny Llama repeats its last input
    token) and a draft LM that agrees with it now and then: drafts are accepted and rejected."""
    model = tiny_llama(seed=3, initializer_range=0.5)
    cfg = DraftLMConfig.matching(model.config, 2, init="target")
    return model, randomize(build_draft_lm(cfg, model), seed=2)


def _lm_proposer(lively):
    model, draft = lively
    return DraftLMProposer(draft, model.config.vocab_size)


@pytest.mark.parametrize("drafter", ["lookup", "lm"])
def test_greedy_paired_decoding_matches_plain_decoding(lively, records, drafter):
    model = lively[0]
    proposer = PromptLookupProposer() if drafter == "lookup" else _lm_proposer(lively)
    dec = decoder(model, proposer, records, k=3, adaptive=False, fallback=False)
    res = paired(dec, model, records, Sampling(max_new_tokens=8), eos_ids(model))
    assert res.matches_baseline == 1.0
    assert res.baseline_tokens_per_s > 0 and res.speedup > 0
    assert res.speedup == pytest.approx(res.stats.tokens_per_s / res.baseline_tokens_per_s)
    assert len(res.samples) == len(records)
    for s, r in zip(res.samples, records):
        assert {k: s[k] for k in r} == r and 1 <= len(s["output_ids"]) <= 8
    assert res.stats.tokens_generated == sum(len(s["output_ids"]) for s in res.samples)
    assert len({tuple(s["output_ids"]) for s in res.samples}) == len(records)
    if drafter == "lm":  # the draft really proposed, and the target refused some drafts
        assert 0 < res.stats.accepted < res.stats.drafted


def test_matches_baseline_compares_with_the_plain_outputs(lively, records):
    """Twin: decoding another model is not the plain decoding of this one."""
    model = lively[0]
    other = tiny_llama(seed=7, initializer_range=0.5)
    dec = decoder(other, PlainProposer(), records, k=0)
    res = paired(dec, model, records, Sampling(max_new_tokens=8), eos_ids(model))
    assert res.matches_baseline < 1.0


def test_without_baseline_there_is_no_speedup(lively, records):
    model = lively[0]
    dec = decoder(model, PromptLookupProposer(), records, k=3)
    res = paired(dec, model, records, Sampling(max_new_tokens=6), eos_ids(model), baseline=False)
    assert (res.baseline_tokens_per_s, res.matches_baseline, res.speedup) == (None, None, None)
    assert len(res.samples) == len(records) and res.stats.tokens_generated > 0


def test_sampled_paired_decoding_has_a_speedup_but_no_match_fraction(lively, records):
    model = lively[0]
    dec = decoder(model, _lm_proposer(lively), records, k=2)
    res = paired(dec, model, records, Sampling(max_new_tokens=6, temperature=1.0, seed=3),
                 eos_ids(model))
    assert res.matches_baseline is None  # only greedy outputs must be token-identical
    assert res.speedup > 0


# ----- the sampling keys ------------------------------------------------------------------------
def test_sampling_from_config_defaults_and_conversions():
    assert Sampling.from_config({"max_new_tokens": 12}) == Sampling(12, 0.0, 0, 1.0, 0, None)
    cfg = OmegaConf.create({"max_new_tokens": "32", "temperature": 1, "top_k": "5",
                            "top_p": 0.9, "seed": 4, "time_budget_s": 2.5, "other": "x"})
    s = Sampling.from_config(cfg)
    assert s == Sampling(32, 1.0, 5, 0.9, 4, 2.5)
    assert isinstance(s.max_new_tokens, int) and isinstance(s.temperature, float)
    with pytest.raises(KeyError):
        Sampling.from_config({"temperature": 0.0})
    with pytest.raises(ValueError):
        Sampling.from_config({"max_new_tokens": "many"})


def test_decoder_is_warmed_up_on_the_first_record(decode_setup, records, monkeypatch):
    from eval.decoder import SpeculativeDecoder

    calls = []
    real = SpeculativeDecoder.generate

    def counting(self, prompt_ids, max_new_tokens, *a, **kw):
        calls.append((list(prompt_ids), max_new_tokens))
        return real(self, prompt_ids, max_new_tokens, *a, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "generate", counting)
    model = decode_setup["loaded"].model
    decoder(model, PlainProposer(), records, k=0)
    assert calls == [(records[0]["prompt_ids"], 2)]
    decoder(model, PlainProposer(), (), k=0)
    assert len(calls) == 1  # no records: no warm-up
