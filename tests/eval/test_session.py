"""eval/session.py: prompt records through the chat template, paired plain / speculative
decoding in one process, and the sampling keys of a decode config."""
from __future__ import annotations

import statistics

import pytest
from conftest import QUESTIONS, make_char_tokenizer, randomize, tiny_llama
from omegaconf import OmegaConf

from draftsmith.data.prompts import PromptSetError
from draftsmith.eval.decoding.proposers import DraftLMProposer, PlainProposer, PromptLookupProposer
from draftsmith.eval.session import Sampling, decode_set, decoder, eos_ids, paired, prompt_records
from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm


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
    assert res.speedup == pytest.approx(statistics.median(s["speedup"] for s in res.samples))
    assert res.speedup_spread == (min(res.ratios), max(res.ratios))
    assert len(res.ratios) == len(res.plain_drift) == len(res.samples) == len(records)
    assert isinstance(res.noisy, bool) and res.noise_tolerance == 0.1
    for s in res.samples:  # each prompt: its own ratio against its two plain runs
        a, b = s["plain_wall_time_s"]
        plain_tps = (len(s["output_ids"]) / a + len(s["output_ids"]) / b) / 2
        assert s["speedup"] == pytest.approx(len(s["output_ids"]) / s["wall_time_s"] / plain_tps)
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
    assert (res.speedup_spread, res.noisy) == (None, None)
    assert len(res.samples) == len(records) and res.stats.tokens_generated > 0


def test_sampled_paired_decoding_has_a_speedup_but_no_match_fraction(lively, records):
    model = lively[0]
    dec = decoder(model, _lm_proposer(lively), records, k=2)
    res = paired(dec, model, records, Sampling(max_new_tokens=6, temperature=1.0, seed=3),
                 eos_ids(model))
    assert res.matches_baseline is None  # only greedy outputs must be token-identical
    assert res.speedup > 0


# ----- paired timing on fake decoders -------------------------------------------------------------
class Machine:
    """A fake machine: every decode costs ``seconds_per_token`` per token, twice as much from
    the ``slow_after``-th decode on (it got busier), times ``jitter[i % len(jitter)]`` for the
    ``i``-th decode of a decoder with jitter."""

    def __init__(self, slow_after: int | None = None) -> None:
        self.slow_after, self.calls = slow_after, 0

    def wall(self, tokens: int, seconds_per_token: float) -> float:
        slow = self.slow_after is not None and self.calls >= self.slow_after
        self.calls += 1
        return tokens * seconds_per_token * (2.0 if slow else 1.0)


class FakeDecoder:
    """``generate`` as :class:`~eval.decoding.decoder.SpeculativeDecoder` has it, with wall times
    from ``machine``; the output is the same for every run, as plain greedy decoding's is."""

    def __init__(self, machine: Machine, seconds_per_token: float = 0.01,
                 jitter: tuple[float, ...] = (1.0,)) -> None:
        self.machine, self.spt, self.jitter, self.calls = machine, seconds_per_token, jitter, 0

    def generate(self, prompt_ids, max_new_tokens, *args, seed=None, **kwargs):
        from draftsmith.eval.decoding.decoder import DecodeResult
        from draftsmith.eval.decoding.stats import DecodeStats

        factor = self.jitter[self.calls % len(self.jitter)]
        self.calls += 1
        wall = self.machine.wall(max_new_tokens, self.spt) * factor
        stats = DecodeStats(tokens_generated=max_new_tokens, target_forwards=max_new_tokens,
                            wall_time_s=wall, stop_reason="max_new_tokens")
        return DecodeResult([len(prompt_ids) % 7] * max_new_tokens, stats.finalize())


FAKE_RECORDS = [{"id": str(i), "category": "x", "prompt_ids": [1] * (i + 1)} for i in range(8)]
FAKE = Sampling(max_new_tokens=10)


def _assert_fair(speedup: float) -> None:
    assert 0.9 <= speedup <= 1.1, f"plain against plain measured {speedup:.2f}x, not ~1.0x"


def _fake_paired(machine: Machine, spec_spt: float = 0.01, **kwargs):
    return paired(FakeDecoder(machine, spec_spt), None, FAKE_RECORDS, FAKE, None,
                  plain=FakeDecoder(machine, 0.01, kwargs.pop("jitter", (1.0,))), **kwargs)


@pytest.mark.parametrize("slow_after", [None, 1, 12, 13, 23])
def test_plain_against_plain_is_one_even_when_the_machine_slows_down(slow_after):
    """24 decodes (plain, plain, plain per prompt); the machine halves its speed after
    ``slow_after`` of them: per-prompt ratios keep the median at 1.0x."""
    res = _fake_paired(Machine(slow_after))
    _assert_fair(res.speedup)
    assert res.speedup == pytest.approx(1.0)
    assert res.baseline_tokens_per_s > 0 and res.matches_baseline == 1.0
    # a slowdown inside one prompt's triple makes that one prompt noisy, not the measurement
    assert res.noisy_prompts == (0 if slow_after in (None, 12) else 1) and res.noisy is False
    # ... and shows in the spread: 1 / 1.5 when the slowdown hit before its speculative run,
    # 1 / 0.75 when only its second plain run was slow
    spread = {None: (1.0, 1.0), 12: (1.0, 1.0), 1: (2 / 3, 1.0), 13: (2 / 3, 1.0),
              23: (1.0, 4 / 3)}[slow_after]
    assert res.speedup_spread == pytest.approx(spread)


def test_twin_the_sequential_scheme_skews_plain_against_plain():
    """Twin: the old order (every prompt speculatively, then every prompt plainly) on the same
    fake machine, slowing down halfway (after the first pass): the fairness check catches it."""
    machine = Machine(slow_after=len(FAKE_RECORDS))
    first, second = FakeDecoder(machine), FakeDecoder(machine)
    spec = decode_set(first, FAKE_RECORDS, FAKE, None)[1]
    base = decode_set(second, FAKE_RECORDS, FAKE, None)[1]
    sequential = spec.tokens_per_s / base.tokens_per_s
    assert sequential == pytest.approx(2.0)
    with pytest.raises(AssertionError, match=r"plain against plain measured 2.00x, not ~1.0x"):
        _assert_fair(sequential)
    # the interleaved scheme, halving its speed halfway too (after 12 of its 24 decodes)
    _assert_fair(_fake_paired(Machine(slow_after=3 * len(FAKE_RECORDS) // 2)).speedup)


def test_a_real_speedup_is_measured_through_the_slowdown():
    res = _fake_paired(Machine(slow_after=12), spec_spt=0.005)  # speculative: twice as fast
    assert res.speedup == pytest.approx(2.0) and res.noisy is False


@pytest.mark.parametrize(("jitter", "tolerance", "noisy"), [
    ((1.0, 1.3), 0.1, True),  # the second plain run of every prompt 30% slower
    ((1.0, 1.3), 0.3, False),  # ... within a 30% tolerance
    ((1.0, 1.05), 0.1, False),  # 5% apart: quiet
])
def test_noisy_when_the_plain_repeats_differ_by_more_than_the_tolerance(jitter, tolerance, noisy):
    res = _fake_paired(Machine(), jitter=jitter, noise_tolerance=tolerance)
    assert res.noisy is noisy and res.noise_tolerance == tolerance
    assert res.noisy_prompts == (len(FAKE_RECORDS) if noisy else 0)
    assert res.plain_drift == pytest.approx([0.3 / 1.15 if jitter[1] == 1.3 else 0.05 / 1.025]
                                            * len(FAKE_RECORDS))


@pytest.mark.parametrize(("noisy_prompts", "noisy"), [(1, False), (2, False), (3, True)])
def test_noisy_needs_more_than_a_quarter_of_the_prompts(noisy_prompts, noisy):
    """8 prompts: 2 noisy ones (a quarter) are tolerated, 3 are not."""
    # plain runs 2i and 2i + 1 belong to prompt i: slow the second run of the first prompts
    jitter = tuple(x for i in range(len(FAKE_RECORDS))
                   for x in (1.0, 1.5 if i < noisy_prompts else 1.0))
    res = _fake_paired(Machine(), jitter=jitter)
    assert res.noisy_prompts == noisy_prompts and res.noisy is noisy
    assert res.speedup == pytest.approx(1.0)  # the median ignores the few noisy prompts


def test_a_negative_noise_tolerance_is_refused():
    with pytest.raises(ValueError, match="noise_tolerance must be >= 0"):
        _fake_paired(Machine(), noise_tolerance=-0.1)


def test_the_plain_decoder_is_warmed_up_too(lively, records, monkeypatch):
    from draftsmith.eval import session

    warmed = []
    real = session.decoder
    monkeypatch.setattr(session, "decoder", lambda model, proposer, recs=(), **kw: (
        warmed.append((proposer.name, len(recs))) or real(model, proposer, recs, **kw)))
    model = lively[0]
    paired(real(model, PlainProposer(), records, k=0), model, records,
           Sampling(max_new_tokens=3), eos_ids(model))
    assert warmed == [("plain", len(records))]


@pytest.mark.serial  # its bound is on measured time: alone, after the two-worker part
def test_decode_measures_plain_against_plain(decode_setup, capsys):
    """``draft=none baseline=true``: the measurement checked against itself (~1.0x; the bound is
    loose, this is a real, shared machine) and the summary's speedup keys."""
    from draftsmith.eval import decode

    summary = decode.run_overrides([
        "draft=none", f"target_path={decode_setup['target']}",
        f"prompts={decode_setup['questions']}", "limit=3", "max_new_tokens=8",
        "noise_tolerance=0.2"])["summary"]
    assert summary["draft_kind"] == "plain" and summary["matches_baseline"] == 1.0
    assert 0.25 < summary["speedup"] < 4.0 and summary["baseline_tokens_per_s"] > 0
    lo, hi = summary["speedup_spread"]
    assert lo <= summary["speedup"] <= hi
    assert isinstance(summary["noisy"], bool) and summary["noise_tolerance"] == 0.2
    decode.print_summary({**summary, "noisy": True, "noisy_prompts": 2})
    out = capsys.readouterr().out
    assert "noisy: the plain runs of 2 prompts differ by more than 20%" in out
    decode.print_summary({**summary, "noisy": False})
    assert "noisy" not in capsys.readouterr().out
    bare = decode.run_overrides([
        "draft=none", f"target_path={decode_setup['target']}",
        f"prompts={decode_setup['questions']}", "limit=1", "max_new_tokens=4",
        "baseline=false"])["summary"]
    assert (bare["speedup"], bare["speedup_spread"], bare["noisy"]) == (1.0, None, None)


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
    from draftsmith.eval.decoding.decoder import SpeculativeDecoder

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


def test_a_grid_of_decoders_is_interleaved_per_prompt_and_survives_a_slowdown():
    """eval/measure.py's grids: per prompt plain, every decoder, plain; the machine halves its
    speed halfway through (after 16 of 32 decodes): each decoder keeps its own ratio."""
    from draftsmith.eval.session import paired_many

    machine = Machine(slow_after=16)
    decs = [FakeDecoder(machine, 0.01), FakeDecoder(machine, 0.005)]  # 1x and 2x plain's speed
    plain = FakeDecoder(machine, 0.01)
    res = paired_many(decs, None, FAKE_RECORDS, FAKE, None, plain=plain)
    assert [r.speedup for r in res] == pytest.approx([1.0, 2.0])
    assert plain.calls == 2 * len(FAKE_RECORDS) and all(d.calls == len(FAKE_RECORDS) for d in decs)
    assert res[0].plain_drift == res[1].plain_drift  # one plain pair per prompt, shared
    assert res[1].samples[0]["plain_tokens"] == [FAKE.max_new_tokens] * 2
    # twin: decoding the grid one decoder at a time, every prompt, after one plain pass, on the
    # same slowing machine, measures the twice-as-fast second decoder at 1x
    machine = Machine(slow_after=16)
    base = decode_set(FakeDecoder(machine, 0.01), FAKE_RECORDS, FAKE, None)[1].tokens_per_s
    first = decode_set(FakeDecoder(machine, 0.01), FAKE_RECORDS, FAKE, None)[1].tokens_per_s
    second = decode_set(FakeDecoder(machine, 0.005), FAKE_RECORDS, FAKE, None)[1].tokens_per_s
    assert (first / base, second / base) == pytest.approx((1.0, 1.0))  # 2x measured as 1x


def test_rounds_bracket_every_round_with_plain_runs_and_take_medians():
    """The fallback benchmark's interleaving: per prompt, rounds of (plain, every decoder) and
    plain once more; a slow round of a decoder does not move its ratio (medians on both sides),
    and its stats count every round."""
    from draftsmith.eval.session import paired_many

    machine = Machine()
    slow_first = FakeDecoder(machine, 0.005, jitter=(4.0, 1.0, 1.0))  # 2x plain, but one slow run
    plain = FakeDecoder(machine, 0.01)
    (res,) = paired_many([slow_first], None, FAKE_RECORDS, FAKE, None, plain=plain, rounds=3)
    assert plain.calls == 4 * len(FAKE_RECORDS) and slow_first.calls == 3 * len(FAKE_RECORDS)
    assert res.speedup == pytest.approx(2.0) and res.plain_drift == [0.0] * len(FAKE_RECORDS)
    assert res.samples[0]["plain_wall_time_s"] == pytest.approx([0.1] * 4)
    assert res.stats.tokens_generated == 3 * len(FAKE_RECORDS) * FAKE.max_new_tokens
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        paired_many([slow_first], None, FAKE_RECORDS, FAKE, None, plain=plain, rounds=0)
