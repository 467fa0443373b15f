"""Batched suffix chains (eval/decoding/batch_suffix.py), alone and beside a trained draft (the
hybrid). Greedy rows equal plain decoding on a target whose text repeats spans, with suffix
chains drafted and accepted, hybrid rows drafting both ways, and the inner drafter's state equal,
row by row, to one started afresh on what the row committed (twins: the draft LM keeping its own
drafted slots on suffix rows, the EAGLE head fed its own drafts instead of the verified suffix
tokens). Sampled rows follow the target's distribution (chi-square), with twins that verify the
suffix tokens with a wrong ``q``; refused combinations name the fix."""
from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoding import batch_suffix
from draftsmith.eval.decoding.batch import BatchDecoder, BatchTarget
from draftsmith.eval.decoding.batch_drafters import batch_drafter_for
from draftsmith.eval.decoding.batch_suffix import PROBE_EVERY, BatchSuffix
from draftsmith.eval.decoding.proposers import PromptLookupProposer
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.proposers_suffix import AcceptRates, SuffixProposer
from draftsmith.eval.decoding.slots import pad_rows
from tests.conftest import tiny_llama
from tests.eval.test_batch import BATCH_PROMPTS, ROWS, make, sampled_p_values
from tests.eval.test_decoder import VOCAB, hf_greedy
from tests.eval.test_sampling_exact import DEEP_SETTINGS, DEEP_V, _binary_llama, _deep_proposer

NEW = 40


def cycling_llama():
    """A tiny target whose greedy text runs around cycles of five ids (``x`` -> the next id of
    its block of five: an untied head whose row ``next(x)`` holds ``x``'s embedding), leaving a
    cycle for another where the context pulls it: spans repeat, as in a reply that copies."""
    model = tiny_llama(seed=1, vocab=VOCAB, initializer_range=0.06)
    emb = model.model.embed_tokens.weight.detach()
    ids = torch.arange(VOCAB)
    nxt = torch.where(ids < VOCAB // 5 * 5, ids // 5 * 5 + (ids % 5 + 1) % 5, ids)
    cycle = torch.zeros_like(emb)
    cycle[nxt] = torch.nn.functional.normalize(emb, dim=-1)
    model.lm_head.weight = torch.nn.Parameter(emb + 4.0 * cycle)
    model.config.tie_word_embeddings = False
    return model


@pytest.fixture(scope="module")
def cycling():
    return cycling_llama()


def watch(dec: BatchDecoder) -> list[tuple[list[list[int]], torch.Tensor | None, list[int]]]:
    """Per round: each row's committed tokens, the inner drafter's first logits ``(B, Vd)``
    (None: it did not run) and the drafts each row had."""
    drafter, rounds = dec.drafter, []
    propose = drafter.propose_chains

    def spy(ks, sampling, generator, budgets=None):
        rounds.append([[list(ix.tokens) for ix in drafter.index], None, []])
        drafts, q, lengths = propose(ks, sampling, generator, budgets)
        rounds[-1][2] = lengths.tolist()
        return drafts, q, lengths
    drafter.propose_chains = spy
    if drafter.inner is not None:
        first = drafter.inner._first
        drafter.inner._first = lambda: rounds[-1].__setitem__(1, first()) or rounds[-1][1]
    return rounds


def unmeasured(self, fed: int, seconds: float) -> None:
    """Verifications left unmeasured, so each row chooses by its rates alone: on a tiny target a
    head step costs as much as a verification, and the measured costs would soon leave the
    suffix chains alone (``test_rows_take_the_inner_chain_only_where_the_batch_gains_per_second``
    checks that choice); the state checks need both kinds of round."""


def state_errors(model, proposer, rounds) -> int:
    """Rows (of rounds the inner drafter ran) whose first logits differ from those of a drafter
    started afresh on the row's committed tokens."""
    errors = 0
    for context, logits, _ in rounds:
        for b, tokens in enumerate(context if logits is not None else ()):
            target = BatchTarget(model, proposer.layer_ids)
            target.start(1)
            ids, valid = pad_rows([tokens[:-1]], torch.device("cpu"))
            _, feats = target.feed(ids, valid)
            fresh = batch_drafter_for(proposer)
            fresh.start([tokens], feats, valid)
            errors += not torch.allclose(fresh._first()[0], logits[b], atol=1e-4)
    return errors


@pytest.mark.parametrize(("inner", "layout"), [(None, "padded"), (None, "packed"),
                                               ("lm", "padded"), ("eagle", "packed")])
def test_greedy_rows_equal_plain_decoding(cycling, inner, layout, monkeypatch):
    monkeypatch.setattr(batch_suffix.VerifyCost, "add", unmeasured)
    # prompts of four lengths, eos ending rows 0 and 1 early (rows 2 and 3 run to NEW)
    proposer = SuffixProposer(None if inner is None else make(inner, cycling), VOCAB)
    want = [hf_greedy(cycling, p, NEW, None) for p in BATCH_PROMPTS]
    eos = want[1][4]
    dec = BatchDecoder(cycling, proposer, k=3, fallback=False, layout=layout)
    rounds = watch(dec)
    got = dec.generate(BATCH_PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
    for res, full in zip(got, want):
        assert res.output_ids == (full[:full.index(eos) + 1] if eos in full else full)
    assert len(got[1].output_ids) == 5 < len(got[0].output_ids) < NEW == len(got[2].output_ids)
    assert proposer.accepted["suffix"] > 20  # suffix chains were drafted and accepted
    # the rows' stats count what they really drafted (suffix chains up to max_length, not k)
    assert sum(r.stats.drafted for r in got) == sum(sum(lengths) for _, _, lengths in rounds)
    if inner is None:  # rows of one block drafted different lengths, some none (no match)
        assert any(len(set(lengths)) > 2 for _, _, lengths in rounds)
        assert any(max(lengths) > 3 for _, _, lengths in rounds)  # longer than k, as batch one
        assert sum(r.stats.plain_steps for r in got) > 0
        return
    assert proposer.choices["suffix"] > 10 and proposer.choices["inner"] > 10
    assert any(logits is None for _, logits, _ in rounds)  # rounds of suffix chains alone
    assert state_errors(cycling, proposer.inner, rounds) == 0


@pytest.mark.parametrize("inner", ["lm", "eagle"])
def test_twin_inner_state_after_suffix_rounds_fails(cycling, inner, monkeypatch):
    monkeypatch.setattr(batch_suffix.VerifyCost, "add", unmeasured)
    # the draft LM keeps its own drafted slots on rows whose verified drafts were suffix tokens;
    # the EAGLE head is given its own drafts, not the verified tokens: the state check fails
    proposer = SuffixProposer(make(inner, cycling), VOCAB)
    dec = BatchDecoder(cycling, proposer, k=3, fallback=False)
    rounds = watch(dec)
    drafter = dec.drafter.inner
    propose, commit, own_drafts = drafter.propose, drafter.commit, []
    drafter.propose = lambda *a: own_drafts.append(propose(*a)[0]) or (own_drafts[-1], None)
    if inner == "lm":
        drafter.commit = lambda k, n, drafts, nxt, feats, own=None: commit(k, n, drafts, nxt,
                                                                           feats)
    else:
        def commit_own(k, n, drafts, nxt, feats, own=None):
            if k:
                drafts = drafts.clone()
                drafts[:, :k] = own_drafts[-1]
            commit(k, n, drafts, nxt, feats)
        drafter.commit = commit_own
    dec.generate(BATCH_PROMPTS, max_new_tokens=NEW)
    assert state_errors(cycling, proposer.inner, rounds) > 5


def test_rows_take_the_inner_chain_only_where_the_batch_gains_per_second(cycling):
    # row 0 has no match, row 1 a long one whose chains were accepted whole five times (2.6
    # drafts expected of three); the head has accepted 2.5 drafts a round on both
    drafter = batch_drafter_for(SuffixProposer(make("eagle", cycling), VOCAB))
    drafter.rates = [AcceptRates(), AcceptRates()]
    for rates in drafter.rates:
        for accepted in (2, 2, 3, 3, 3, 3, 3):
            rates.add_inner(accepted)
    for _ in range(5):
        drafter.rates[1].add_suffix(8, 3, 3)
    want, matches, chains = [3, 3], [0, 8], [[], [5, 6, 7]]
    # costs not measured yet: each row what its rates favour
    assert drafter._choose(want, matches, chains) == ([True, False], 3)
    drafter.fit.rounds = [(1, 0.050), (4, 0.051)]  # a wider block costs next to nothing more
    drafter.steps.append(0.002)  # a head step 4% of a verification: row 0 takes the head's chain
    assert drafter._choose(want, matches, chains) == ([True, False], 3)
    assert drafter._choose([0, 3], matches, chains) == ([False, False], 3)  # row 0 fallen back
    drafter.steps.extend([0.040, 0.040])  # three head steps cost more than row 0's drafts bring
    assert drafter._choose(want, matches, chains) == ([False, False], 3)
    drafter.without_inner = PROBE_EVERY  # so many rounds without the head: the rows' rates choose
    assert drafter._choose(want, matches, chains) == ([True, False], 3)
    drafter.without_inner = 0
    drafter.fit.rounds = [(1, 0.050), (4, 0.200)]  # every fed token costs a plain step
    drafter.steps.clear()
    drafter.steps.append(0.002)
    assert drafter._choose(want, matches, chains) == ([False, False], 0)  # plain steps
    alone = batch_drafter_for(SuffixProposer(None, VOCAB))  # suffix chains alone: the same caps
    alone.rates, alone.fit.rounds = [AcceptRates(), AcceptRates()], drafter.fit.rounds
    assert alone._choose(want, matches, chains) == ([False, False], 0)
    alone.fit.rounds = [(1, 0.050), (4, 0.051)]
    assert alone._choose(want, matches, chains) == ([False, False], 3)


# ----- sampling: suffix rows verify point masses; beside the EAGLE head's chains (rows alternate
# per round between the two, forced: the binary outputs are too short for the measured rates to
# leave the inner's prior), the same rows keep the head's q. At 300 rows per prompt (seed 0,
# T = 1) the exact runs give p = 0.87 / 0.11 (alone, prompts A / B) and 0.71 / 0.94 (hybrid),
# the twins 2e-22 / 4e-4 and 7e-17 / 0.0 (at T = 0.7: 0.54 / 0.18 and 0.46 / 0.94; beside the
# draft LM 0.27 / 0.008, which 3,000 rows put at 0.26 / 0.87: chance, not a bias).
def suffix_p_values(inner: str | None, setting: dict) -> tuple[list[float], SuffixProposer]:
    model = _binary_llama(seed=1)
    proposer = SuffixProposer(None if inner is None else _deep_proposer(inner, model), DEEP_V,
                              max_length=3)
    dec = BatchDecoder(model, proposer, k=3, fallback=False)
    p_values, _ = sampled_p_values(model, dec, setting)
    return p_values, proposer


def alternate(self, want: list[int], matches: list[int], chains: list[list[int]]
              ) -> tuple[list[bool], int]:
    """A row takes the inner chain on rounds of one parity (its place and committed length);
    suffix chains uncapped."""
    return [self.inner is not None and k > 0
            and (not chain or (b + len(self.index[b].tokens)) % 2 == 0)
            for b, (k, chain) in enumerate(zip(want, chains))], max(map(len, chains))


@pytest.mark.parametrize("inner", [None, "eagle-chain"], ids=["alone", "hybrid"])
def test_batched_suffix_chains_sample_exactly(inner, monkeypatch):
    monkeypatch.setattr(BatchSuffix, "_choose", alternate)
    p_values, proposer = suffix_p_values(inner, DEEP_SETTINGS[1])
    assert min(p_values) > 0.01
    assert proposer.accepted["suffix"] > ROWS // 2  # accepted suffix drafts, 2 * ROWS rows
    assert inner is None or proposer.accepted["inner"] > ROWS // 2


@pytest.mark.parametrize("inner", [None, "eagle-chain"], ids=["alone", "hybrid"])
def test_twin_suffix_tokens_verified_with_a_wrong_q_fail(inner, monkeypatch):
    # alone: a uniform q on the suffix rows; hybrid: the point mass of the other id (as batch
    # one's twin), on the suffix rows of rounds the head drafted
    monkeypatch.setattr(BatchSuffix, "_choose", alternate)
    if inner is None:
        propose = BatchSuffix.propose_chains

        def uniform(self, ks, sampling, generator, budgets=None):
            drafts, _, lengths = propose(self, ks, sampling, generator, budgets)
            return drafts, torch.full((*drafts.shape, DEEP_V), 1 / DEEP_V), lengths
        monkeypatch.setattr(BatchSuffix, "propose_chains", uniform)
    else:
        monkeypatch.setattr(SuffixProposer, "_suffix_q", lambda self, chain, q: torch.nn
                            .functional.one_hot(torch.tensor(chain), q.shape[-1]).roll(1, -1))
    p_values, _ = suffix_p_values(inner, DEEP_SETTINGS[1])
    assert min(p_values) < 1e-3


def test_refused_batched_combinations_name_the_fix(cycling):
    with pytest.raises(ValueError, match="prompt lookup's batched alternative"):
        BatchDecoder(cycling, PromptLookupProposer())
    tree = EagleProposer(make("eagle", cycling).head, VOCAB, tree=True)
    with pytest.raises(ValueError, match="use tree=chain, or suffix=false"):
        BatchDecoder(cycling, SuffixProposer(tree, VOCAB))
