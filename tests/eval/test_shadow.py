"""Shadow drafts (eval/decoding/shadow.py): a draft's acceptance measured beside plain steps, and
the switch to drafting once it predicts a gain; re-timing builds them (eval/retime.py)."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

from draftsmith.eval import decode
from draftsmith.eval.decoding.cost import expected_tokens
from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers import DraftLMProposer
from draftsmith.eval.decoding.proposers_suffix import SuffixProposer
from draftsmith.eval.decoding.shadow import Shadow
from draftsmith.eval.retime import MEASURED_MARGIN, predict, shadow_for, shadow_judge
from draftsmith.heads.package import update_package_json
from tests.conftest import draft_package, tiny_llama
from tests.eval.test_decoder import PROMPTS, VOCAB, AntiDraft, hf_greedy
from tests.eval.test_retime import _local, _record


def _judge(alpha: list[float]) -> tuple[int, float]:
    """A machine where a drafted token costs 10% of a plain step and verification is free."""
    k = len(alpha)
    return k, expected_tokens(alpha, k) / (1 + 0.1 * k)


# ----------------------------------------------------------------------------- scoring
class _OffByOne(Shadow):
    """A broken shadow: scores each chain against the tokens one step later."""

    def drafted(self, start: int, drafts: list[int]) -> None:
        super().drafted(start + 1, drafts)


def _scores_like_verification(cls: type[Shadow]) -> bool:
    """Three greedy chains against committed tokens 10..17: fully right, right then wrong, and
    cut short by the end of the request; the counts verification would give."""
    shadow = cls(depth=3, judge=_judge)
    generated = list(range(10, 18))
    shadow.drafted(0, [10, 11, 12])  # all three accepted
    shadow.drafted(3, [13, 99, 15])  # position 1 accepted, 2 rejected, 3 never reached
    shadow.drafted(7, [17, 18, 19])  # only position 1 is committed before the end
    shadow.score(generated[:5])  # the first chain's tokens are committed, the second's not yet
    first = (shadow.chains, shadow.reached[:], shadow.accepted[:])
    shadow.score(generated, final=True)
    return (first == (1, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
            and shadow.chains == 3 and shadow.reached == [3.0, 2.0, 1.0]
            and shadow.accepted == [3.0, 1.0, 1.0] and not shadow._pending)


def test_greedy_chains_are_scored_as_verification_would():
    assert _scores_like_verification(Shadow)


def test_the_twin_a_misaligned_shadow_is_caught():
    assert not _scores_like_verification(_OffByOne)


def test_a_sampled_first_draft_scores_the_acceptance_probability():
    shadow = Shadow(depth=1, judge=_judge)
    p = torch.tensor([0.5, 0.3, 0.2])
    shadow.sampled(p, torch.tensor([0.2, 0.3, 0.5]), draft=2)  # sum min(p, q) = 0.2 + 0.3 + 0.2
    shadow.sampled(p, None, draft=1)  # a point mass on token 1: accepted with p(1)
    assert shadow.reached == [2.0] and shadow.accepted[0] == pytest.approx(0.7 + 0.3)
    assert shadow.chains == 2


def test_the_verdict_waits_switches_or_gives_up():
    good = Shadow(depth=2, judge=_judge, min_chains=4)
    for i in range(3):
        good.drafted(2 * i, [1, 1])
    good.score([1] * 8)
    assert good.decide() == 0 and good.verdict is None  # 3 chains: too few to judge
    good.drafted(6, [1, 1])
    good.score([1] * 8)
    assert good.decide() == 2 and good.verdict["switched"] and not good.watching
    assert good.alpha() == [5 / 6, 5 / 6]
    bad = Shadow(depth=2, judge=_judge, min_chains=4)
    for i in range(12):
        bad.drafted(i, [0, 0])
    bad.score([1] * 14)  # alpha 1 / 14 after the prior: 0.97x predicted
    assert bad.decide() == 0 and not bad.watching and not bad.verdict["switched"]
    # between 1.0 and the margin: keeps watching until max_chains
    unsure = Shadow(depth=1, judge=lambda a: (1, 1.05), min_chains=2, max_chains=3)
    assert unsure.wants(5) == 0 and unsure.wants(5) == 1  # one chain every second plain step
    for i in range(2):
        unsure.drafted(i, [1])
    unsure.score([1, 1])
    assert unsure.decide() == 0 and unsure.watching
    unsure.drafted(2, [1])
    unsure.score([1, 1, 1])
    assert unsure.decide() == 0 and not unsure.watching and unsure.wants(5) == 0
    with pytest.raises(ValueError, match="min_chains"):
        Shadow(depth=1, judge=_judge, min_chains=9, max_chains=3)


# ----------------------------------------------------------------------------- in the decoder
@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0, vocab=VOCAB)


def _shadowed(model, proposer, min_chains: int = 6) -> SpeculativeDecoder:
    dec = SpeculativeDecoder(model, proposer, k=0, adaptive=False, fallback=False)
    dec.shadow = Shadow(depth=3, judge=_judge, min_chains=min_chains, every=1)
    return dec


def test_a_good_draft_starts_drafting_and_output_stays_the_targets(target_model):
    dec = _shadowed(target_model, DraftLMProposer(copy.deepcopy(target_model), VOCAB))
    res = dec.generate(PROMPTS[0], max_new_tokens=40, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[0], 40, eos=None)
    assert dec.shadow.verdict["switched"] and dec.k == 3
    assert res.stats.plain_steps >= 6 and res.stats.spec_steps > 0
    assert res.stats.alpha_cumulative[0] == 1.0  # the target drafting itself
    # the next request drafts from its first round
    res = dec.generate(PROMPTS[1], max_new_tokens=20, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[1], 20, eos=None)
    assert res.stats.plain_steps == 0


def test_the_twin_a_useless_draft_never_starts(target_model):
    dec = _shadowed(target_model, AntiDraft(copy.deepcopy(target_model), VOCAB))
    res = dec.generate(PROMPTS[0], max_new_tokens=40, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[0], 40, eos=None)
    assert res.stats.spec_steps == 0 and dec.k == 0
    assert dec.shadow.accepted == [0.0, 0.0, 0.0] and not dec.shadow.verdict["switched"]
    assert not dec.shadow.watching  # predicted below 1.0: the shadow stops drafting


def test_beside_the_suffix_proposer_the_trained_draft_is_judged(target_model):
    inner = DraftLMProposer(copy.deepcopy(target_model), VOCAB)
    hybrid = SuffixProposer(inner, VOCAB)
    dec = _shadowed(target_model, hybrid)
    res = dec.generate(PROMPTS[1], max_new_tokens=30, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[1], 30, eos=None)
    assert dec.shadow.verdict["switched"]
    # shadow chains are not rounds of the hybrid: its choice counts only verified rounds
    assert sum(hybrid.choices.values()) == res.stats.spec_steps


def test_sampled_decoding_scores_the_first_draft(target_model):
    dec = SpeculativeDecoder(target_model, DraftLMProposer(copy.deepcopy(target_model), VOCAB),
                             k=0, fallback=False)
    dec.shadow = Shadow(depth=1, judge=_judge, min_chains=100, max_chains=100, every=1)
    dec.generate(PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=0)
    # the draft is the target: q equals p, every first draft accepted with probability 1
    assert dec.shadow.reached[0] == 29 and dec.shadow.accepted[0] == pytest.approx(29, abs=1e-3)


# ----------------------------------------------------------------------------- while drafting
class _FirstOnly(Shadow):
    """A broken judge of verified rounds: counts position 1 alone, whatever was drafted."""

    def verified(self, drafts: int, accepted: float) -> bool:
        return super().verified(1, min(accepted, 1))


def test_verified_rounds_count_as_verification_would():
    def counts(cls: type[Shadow]) -> tuple[list[float], list[float]]:
        judge = cls(depth=1, judge=_judge, watching=False, min_rounds=99)
        for drafts, accepted in ((3, 3), (3, 1), (4, 0), (2, 2)):
            assert judge.verified(drafts, accepted)  # too few rounds for a verdict
        return judge.reached, judge.accepted

    # positions reached: every one after an accepted draft; a chain longer than the shadow's grows
    # the counts
    assert counts(Shadow) == ([4.0, 3.0, 1.0], [3.0, 2.0, 1.0])
    assert counts(_FirstOnly) != counts(Shadow)  # the twin loses positions 2 and 3


def _drafting(model, proposer, shadow_cls: type[Shadow] = Shadow) -> SpeculativeDecoder:
    dec = SpeculativeDecoder(model, proposer, k=3, adaptive=False, fallback=False)
    dec.shadow = shadow_cls(depth=3, judge=_judge, watching=False, min_rounds=8, recheck=4,
                            every=1, min_chains=4)
    return dec


class _NeverJudges(Shadow):
    """A broken judge: counts verified rounds, never gives a verdict on them."""

    def verified(self, drafts: int, accepted: float) -> bool:
        super().verified(drafts, accepted)
        return True


def _stops_a_useless_chain(model, shadow_cls: type[Shadow]) -> bool:
    dec = _drafting(model, AntiDraft(copy.deepcopy(model), VOCAB), shadow_cls)
    res = dec.generate(PROMPTS[0], max_new_tokens=40, temperature=0.0)
    assert res.output_ids == hf_greedy(model, PROMPTS[0], 40, eos=None)
    # judged every 4 rounds from the 8th: alpha 1 / 10 predicts 1.00x there (not below 1.0),
    # 1 / 14 predicts 0.97x at the 12th round
    return (dec.k == 0 and res.stats.spec_steps == 12 and dec.shadow.rounds == 12
            and [s["to"] for s in dec.shadow.switches] == ["plain"]
            and dec.shadow.chains > 0)  # watching again: shadow chains beside the plain steps


def test_a_drafted_chain_that_does_not_pay_stops_and_the_shadow_watches(target_model):
    assert _stops_a_useless_chain(target_model, Shadow)
    assert not _stops_a_useless_chain(target_model, _NeverJudges)  # the twin drafts on


def test_a_drafted_chain_that_pays_goes_on(target_model):
    dec = _drafting(target_model, DraftLMProposer(copy.deepcopy(target_model), VOCAB))
    res = dec.generate(PROMPTS[1], max_new_tokens=40, temperature=1.0, seed=0)
    assert dec.k == 3 and res.stats.plain_steps == 0 and not dec.shadow.switches
    assert dec.shadow.rounds == res.stats.spec_steps and dec.shadow.verdict["predicted"] > 1.0


def _paused_hybrid(model) -> tuple[SuffixProposer, SpeculativeDecoder]:
    hybrid = SuffixProposer(DraftLMProposer(copy.deepcopy(model), VOCAB), VOCAB)
    assert hybrid.pause(True) and hybrid.paused
    dec = SpeculativeDecoder(model, hybrid, k=3, adaptive=False, fallback=False)
    dec.shadow = Shadow(depth=1, judge=_judge, every=1, min_chains=6)
    return hybrid, dec


def test_a_paused_hybrid_drafts_suffix_chains_alone_then_resumes_its_draft(target_model):
    hybrid, dec = _paused_hybrid(target_model)
    res = dec.generate(PROMPTS[2], max_new_tokens=48, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[2], 48, eos=None)
    # greedy, the tiny target repeats itself: suffix chains every round, the draft never runs
    assert hybrid.choices["suffix"] == res.stats.spec_steps > 0 and hybrid.paused
    assert hybrid.choices["inner"] == hybrid.choices["both"] == 0
    # sampled, fewer matches: shadow drafts of the self-draft beside the plain steps resume it
    hybrid, dec = _paused_hybrid(target_model)
    dec.generate(PROMPTS[2], max_new_tokens=48, temperature=1.0, seed=0)
    assert [s["to"] for s in dec.shadow.switches] == ["draft"] and not hybrid.paused
    assert hybrid.choices["inner"] > 0 and dec.shadow.switches[0]["alpha"][0] > 0.8


def test_suffix_chains_alone_are_drafted_only_where_they_beat_a_plain_step():
    suffix = SuffixProposer(None, VOCAB)
    suffix.fit.rounds = [(1, 0.010), (2, 0.020), (3, 0.030), (5, 0.050)]  # a token: a plain step
    assert suffix._choose(m=2, available=4) == (False, 0)
    suffix.fit.rounds = [(1, 0.010), (2, 0.0101), (5, 0.0102)]  # verification nearly free
    assert suffix._choose(m=2, available=4)[1] > 0


# ----------------------------------------------------------------------------- re-timing
def test_retiming_builds_a_shadow_only_where_a_draft_could_pay():
    rec = _record(tree=None)
    cheap = _local(0.0001, t_draft=0.0002)
    shapes = predict(rec, cheap, trees=False)
    shadow = shadow_for(rec, cheap, shapes, temperature=0.0)
    assert shadow.depth == 3 and shadow.margin == MEASURED_MARGIN  # best chain 3, capped at 3
    # the judge re-times the measured alphas: the record's own alphas give the record's prediction
    assert shadow.judge([0.8, 0.7, 0.6]) == (shapes[0].k, pytest.approx(shapes[0].speedup))
    assert shadow.judge([0.05])[1] < MEASURED_MARGIN
    # sampled: one draft, later positions from the record scaled by the first
    assert shadow_for(rec, cheap, shapes, temperature=1.0).depth == 1
    filled = shadow_judge(rec, cheap, fill=True)([0.4])
    best = predict({**rec, "alpha": [0.4, 0.35, 0.3]}, cheap, trees=False)[0]
    assert filled == (best.k, pytest.approx(best.speedup))
    # the twin: where a verified token costs most of a plain step even a perfect draft loses
    assert shadow_for(rec, _local(0.008, t_draft=0.002), shapes, temperature=0.0) is None


def foreign_eagle(decode_setup, tmp_path, monkeypatch):
    """An EAGLE package whose record was measured elsewhere with low alphas, on a machine (its
    costs patched in) where a draft pays if accepted: re-timing predicts plain decoding from the
    record, and the shadow watches."""
    src, _ = draft_package(decode_setup, "eagle")
    pkg = tmp_path / "eagle"
    shutil.copytree(src, pkg)
    update_package_json(pkg, "speculation.json", {**_record(dtype="float32"), "tree": None,
                                                  "alpha": [0.05, 0.05, 0.05]})
    monkeypatch.setattr("draftsmith.eval.kstar.measure_costs",
                        lambda *a, **kw: _local(0.0001, t_draft=0.0002))
    return pkg


def test_decode_with_a_foreign_record_watches_then_stays_lossless(decode_setup, tmp_path,
                                                                   monkeypatch):
    pkg = foreign_eagle(decode_setup, tmp_path, monkeypatch)
    run = ["draft=" + str(pkg), f"target_path={decode_setup['target']}",
           f"prompts={decode_setup['questions']}", "max_new_tokens=12", "temperature=0",
           "limit=1"]
    summary = decode.run_overrides(run)["summary"]
    # plain decoding for the package (best chain 1, shadow chains of 1 + 1), the suffix proposer
    # drafting alone meanwhile where a match beats a plain step
    assert "shadow drafts of 2" in summary["k_source"] and summary["k"] == 2
    assert "suffix chains meanwhile" in summary["k_source"]
    assert summary["matches_baseline"] == 1.0 and summary["suffix_rounds"]["suffix"] > 0
    assert summary["suffix_rounds"]["inner"] == summary["suffix_rounds"]["both"] == 0
    # without the suffix proposer: plain steps, the package's shadow chains beside them
    alone = decode.run_overrides([*run, "suffix=false"])["summary"]
    assert alone["k"] == 0 and alone["suffix_rounds"] is None
    assert alone["shadow"]["chains"] > 0 and alone["matches_baseline"] == 1.0
    off = decode.run_overrides([*run, "shadow=false", "baseline=false"])["summary"]
    assert off["shadow"] is None and "shadow" not in off["k_source"]
    with pytest.raises(ValueError, match="shadow="):
        decode.run_overrides([*run, "shadow=sometimes"])
