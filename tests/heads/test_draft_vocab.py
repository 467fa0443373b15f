"""Frequent-token draft vocabularies (heads/vocab.py, ``vocab_ids`` of the draft LM and EAGLE
proposers): the subset logits are the full logits' rows, drafts stay inside the subset, greedy
output stays the target's own, and the package record round-trips with clear errors."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposal import DecodeContext, Sampling
from draftsmith.eval.decoding.proposers import DraftLMProposer, head_rows
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.heads.quantize import Int4Linear, Int8Linear
from draftsmith.heads.vocab import (
    TOKEN_FREQUENCY,
    counts_from_record,
    frequency_record,
    frequent_ids,
    package_token_counts,
)
from tests.conftest import tiny_llama

VOCAB = 64
SUBSET = torch.arange(0, VOCAB, 2)  # the even ids
PROMPTS = [[1, 5, 9, 13, 5, 9], [1, 40, 41, 42, 43, 40, 41, 42, 43, 40], [1, 7]]


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0, vocab=VOCAB)


def _eagle_head(model):
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig

    torch.manual_seed(4)
    return build_eagle(EagleConfig(), model).eval()


def _proposer(name: str, model, vocab_ids=None):
    if name.startswith("lm"):
        return DraftLMProposer(tiny_llama(seed=7, vocab=VOCAB, layers=1), VOCAB,
                               tree=name == "lm-tree", topk=3, total_tokens=10, vocab_ids=vocab_ids)
    return EagleProposer(_eagle_head(model), VOCAB, tree=name == "eagle-tree", topk=3,
                         total_tokens=10, vocab_ids=vocab_ids)


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def test_subset_logits_are_the_rows_of_the_full_logits(target_model):
    full = _proposer("lm", target_model)
    sub = _proposer("lm", target_model, SUBSET)  # same seed: the same weights
    for p in (full, sub):
        p.reset(PROMPTS[0], None)
    a, b = full._step(PROMPTS[0]), sub._step(PROMPTS[0])
    assert a.shape == (VOCAB,) and b.shape == (len(SUBSET),)
    torch.testing.assert_close(b, a[SUBSET], rtol=1e-5, atol=1e-5)
    eagle_full = _proposer("eagle", target_model)
    eagle_sub = EagleProposer(eagle_full.head, VOCAB, vocab_ids=SUBSET)
    h = torch.randn(1, 3, target_model.config.hidden_size)
    torch.testing.assert_close(eagle_sub._logits(h), eagle_full._logits(h)[..., SUBSET])


@pytest.mark.parametrize("name", ["lm", "lm-tree", "eagle", "eagle-tree"])
def test_drafts_stay_in_the_subset_and_greedy_equals_generate(target_model, name):
    proposer = _proposer(name, target_model, SUBSET)
    drafted: list[int] = []
    propose = proposer.propose

    def recording(ctx, k):
        prop = propose(ctx, k)
        drafted.extend(prop.tokens.tolist())
        return prop

    proposer.propose = recording
    dec = SpeculativeDecoder(target_model, proposer, k=3, adaptive=False, fallback=False)
    for prompt in PROMPTS:
        got = dec.generate(prompt, max_new_tokens=20, temperature=0.0)
        assert got.output_ids == _hf_greedy(target_model, prompt, 20), name
    assert drafted and set(drafted) <= set(SUBSET.tolist())
    assert any(t % 2 for p in PROMPTS for t in _hf_greedy(target_model, p, 20))  # odd ids matter


@pytest.mark.parametrize("name", ["lm", "eagle"])
def test_sampled_draft_q_is_zero_outside_the_subset(target_model, name):
    from draftsmith.eval.decoding.target_model import Target

    proposer = _proposer(name, target_model, SUBSET)
    prompt = PROMPTS[1]
    out = Target(target_model).prefill(torch.tensor(prompt))
    proposer.reset(prompt + [3], out)
    ctx = DecodeContext(tokens=prompt + [3], sampling=Sampling(temperature=1.0),
                        generator=torch.Generator().manual_seed(0))
    prop = proposer.propose(ctx, 3)
    assert prop.q is not None and prop.q.shape == (3, VOCAB)
    odd = torch.ones(VOCAB, dtype=torch.bool)
    odd[SUBSET] = False
    assert float(prop.q[:, odd].abs().sum()) == 0.0
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(3))
    for i, t in enumerate(prop.tokens.tolist()):  # each draft has positive q where it was drawn
        assert t % 2 == 0 and float(prop.q[i, t]) > 0


def test_head_rows_refuses_what_a_row_subset_would_change(target_model):
    head = target_model.get_output_embeddings()
    with pytest.raises(ValueError, match="sorted ascending"):
        head_rows(head, torch.tensor([4, 2]), VOCAB)
    with pytest.raises(ValueError, match="target ids in 0..63"):
        head_rows(head, torch.tensor([2, 64]), VOCAB)
    biased = torch.nn.Linear(head.in_features, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias-free linear map"):
        head_rows(biased, SUBSET, VOCAB)
    cfg = copy.deepcopy(target_model.config)
    cfg.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        head_rows(head, SUBSET, VOCAB, cfg)


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
def test_head_rows_of_an_int8_or_int4_lm_head_are_its_dequantized_rows(target_model, layer):
    head = layer(target_model.get_output_embeddings())
    rows = head_rows(head, SUBSET, VOCAB)
    assert torch.equal(rows, head.weight[SUBSET])  # the int8 / int4 values times their scales
    assert not torch.equal(rows, target_model.get_output_embeddings().weight[SUBSET])


def test_a_reduced_vocabulary_eagle_head_drafts_over_a_subset_of_its_own_ids(target_model):
    """draft_vocab on a head trained with a reduced vocabulary: the rows of its own ids that are
    in the subset, with the logits the whole head gives them (measure.py searches these sizes)."""
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig

    counts = torch.arange(VOCAB, 0, -1)  # ids 0..15 most frequent: the head's vocabulary
    head = build_eagle(EagleConfig(draft_vocab_size=16), target_model, token_counts=counts).eval()
    whole = EagleProposer(head, VOCAB)
    sub = EagleProposer(head, VOCAB, vocab_ids=SUBSET)  # the even ids; 0..14 are the head's
    assert sub.d2t.tolist() == [i for i in range(16) if i % 2 == 0]
    hidden = torch.randn(3, 1, head.hidden_size)
    full_logits = whole._logits(hidden)  # (3, 1, 16) over the head's own ids
    torch.testing.assert_close(sub._logits(hidden), full_logits[..., ::2])


def test_frequency_record_round_trip_and_choice(tmp_path):
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[[5, 9, 30]] = torch.tensor([3, 10, 3])
    rec = frequency_record(counts, "test")
    assert rec["ids"] == [9, 5, 30] and rec["counts"] == [10, 3, 3] and rec["total"] == 16
    assert torch.equal(counts_from_record(json.loads(json.dumps(rec)), VOCAB), counts)
    with pytest.raises(ValueError, match="another target"):
        counts_from_record(rec, VOCAB + 1)
    with pytest.raises(ValueError, match="malformed"):
        counts_from_record({**rec, "counts": [1]}, VOCAB)
    # the most frequent ids, EOS forced in, sorted; unseen ids by smaller id
    assert frequent_ids(counts, 3, [2]).tolist() == [2, 5, 9]
    assert frequent_ids(counts, 5).tolist() == [0, 1, 5, 9, 30]
    with pytest.raises(FileNotFoundError, match="scripts/token_frequency.py draft="):
        package_token_counts(tmp_path, VOCAB)
    (tmp_path / TOKEN_FREQUENCY).write_text(json.dumps(rec))
    assert torch.equal(package_token_counts(tmp_path, VOCAB), counts)
