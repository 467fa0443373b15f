"""Batched speculative decoding (eval/decoding/batch.py): every row of a batch decodes exactly as it
would alone. Greedy rows equal batch-one decoding (and the target's own ``generate``) for plain
decoding, the draft LM and the EAGLE head (fused layers and a draft vocabulary included);
sampled rows of different prompts in one batch follow the target's distribution (chi-square),
with a twin that applies one row's accepted count to another and fails."""
from __future__ import annotations

import copy
import statistics

import pytest
import torch

from draftsmith.eval.decoding.batch import BatchDecoder
from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers import DraftLMProposer, PlainProposer
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.slots import PackedSlotCache, SlotCache
from tests.conftest import randomize, tiny_llama
from tests.eval.test_decoder import PROMPTS, VOCAB, hf_greedy
from tests.eval.test_sampling_exact import (
    DEEP_NEW,
    DEEP_SETTINGS,
    DEEP_V,
    _binary_llama,
    _deep_exact,
    _deep_proposer,
    chi_square_p,
)

BATCH_PROMPTS = [*PROMPTS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 2, 3]]


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0, vocab=VOCAB)


def make(name: str, model):
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig

    if name == "plain":
        return PlainProposer()
    if name == "lm":  # the target plus noise: long accepted prefixes and rejections
        return DraftLMProposer(randomize(copy.deepcopy(model), seed=2), VOCAB)
    if name == "lm-vocab":  # drafts over 40 of the 64 ids only
        return DraftLMProposer(tiny_llama(seed=7, vocab=VOCAB, layers=1), VOCAB,
                               vocab_ids=torch.arange(0, 64, 64 // 40)[:40])
    if name == "medusa":  # three heads with their own LM heads, a chain of their top tokens
        from draftsmith.eval.decoding.proposers_medusa import MedusaProposer, medusa_choices
        from draftsmith.heads.medusa import MedusaConfig, build_medusa

        heads = randomize(build_medusa(MedusaConfig(num_heads=3, num_layers=1), model), seed=6)
        return MedusaProposer(heads, VOCAB, medusa_choices([1, 1, 1]))
    torch.manual_seed(4)
    fuse = [1, 2] if name.startswith("eagle3") else None
    layout = "eagle3" if name == "eagle3-layout" else "eagle1"
    head = build_eagle(EagleConfig(fuse_layers=fuse, layout=layout), model).eval()
    return EagleProposer(head, VOCAB)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", ["plain", "lm", "lm-vocab", "eagle", "eagle3", "eagle3-layout",
                                  "medusa"])
def test_greedy_rows_equal_batch_one_decoding(target_model, name, layout):
    proposer = make(name, target_model)
    single = SpeculativeDecoder(target_model, proposer, k=3, adaptive=False, fallback=False)
    batch = BatchDecoder(target_model, proposer, k=3, fallback=False, layout=layout)
    got = batch.generate(BATCH_PROMPTS, max_new_tokens=20)
    for prompt, res in zip(BATCH_PROMPTS, got):
        alone = single.generate(prompt, max_new_tokens=20)
        assert res.output_ids == alone.output_ids == hf_greedy(target_model, prompt, 20, None)
        assert res.stats.tokens_generated == 20 and res.stats.stop_reason == "max_new_tokens"
        if name != "plain":  # the same drafts were accepted as alone, step by step
            assert res.stats.accepted_at == alone.stats.accepted_at
            assert res.stats.spec_steps == alone.stats.spec_steps


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_rows_finish_apart_and_leave_the_batch(target_model, layout):
    proposer = make("lm", target_model)
    want = [hf_greedy(target_model, p, 30, None) for p in BATCH_PROMPTS]
    eos = want[1][4]  # ends row 1 early; other rows may meet it later or never
    got = BatchDecoder(target_model, proposer, k=4, fallback=False, layout=layout).generate(
        BATCH_PROMPTS, max_new_tokens=30, eos_token_id=eos)
    for res, full in zip(got, want):
        cut = full[:full.index(eos) + 1] if eos in full else full
        assert res.output_ids == cut
        assert res.stats.stop_reason == ("eos" if eos in full else "max_new_tokens")
    assert len(got[1].output_ids) <= 5 < max(len(r.output_ids) for r in got)


def test_slot_cache_masks_positions_and_compaction():
    slots = SlotCache(tiny_llama(seed=0, vocab=VOCAB).config, 2, torch.device("cpu"))
    mask, pos = slots.open(torch.tensor([[True, True, True], [True, False, False]]))
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert mask[1, 0].tolist() == [[True, False, False], [True, True, False],
                                   [True, False, True]]  # padding queries see themselves only
    slots.keep(0, torch.tensor([2, 1]))  # row 0 keeps 2 of its 3 new slots
    assert slots.lengths().tolist() == [2, 1]
    mask, pos = slots.open(torch.tensor([[True], [True]]))
    assert pos.tolist() == [[2], [1]]
    assert mask[:, 0, 0].tolist() == [[True, True, False, True], [True, False, False, True]]


def test_packed_cache_masks_positions_keep_and_select():
    slots = PackedSlotCache(tiny_llama(seed=0, vocab=VOCAB).config, 2, torch.device("cpu"))
    valid = torch.tensor([[True, True, True], [True, False, False]])
    mask, pos = slots.open(valid)
    assert slots.pack(torch.tensor([[5, 6, 7], [8, 0, 0]]), valid).tolist() == [[5, 6, 7, 8]]
    assert pos.tolist() == [[0, 1, 2, 0]]  # four real tokens, no padding fed
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [True, True, True, False], [False, False, False, True]]
    y = torch.arange(4.0).view(1, 4, 1)
    assert slots.unpack(y, valid)[..., 0].tolist() == [[0, 1, 2], [3, 0, 0]]
    slots.keep(0, torch.tensor([2, 1]))  # row 0 keeps 2 of its 3 new slots
    assert slots.owner.tolist() == [0, 0, -1, 1] and slots.lengths().tolist() == [2, 1]
    mask, pos = slots.open(torch.tensor([[True], [True]]))
    assert pos.tolist() == [[2, 1]]
    assert mask[0, 0].tolist() == [[True, True, False, False, True, False],
                                   [False, False, False, True, False, True]]
    slots.select(torch.tensor([1]))  # row 0 finished: row 1 becomes row 0, its 2 slots kept
    assert slots.lengths().tolist() == [2] and (slots.owner >= 0).sum() == 2


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fallen_back_rows_feed_one_token_when_packed(target_model, layout, monkeypatch):
    # row 1's drafts are always wrong: it falls back while row 0 goes on speculating at K = 3;
    # packed, its verification slot is one token (the block has 4 + 1), padded it is 4 (4 + 4)
    from draftsmith.eval.decoding.k_controller import KController
    from draftsmith.scripts.bench_mixed import Hostile

    class Untimed(KController):  # the fallback test on tokens per step alone, not timings
        def is_loss(self) -> bool:
            return statistics.fmean(s.tokens for s in self.history) < 1.5

    monkeypatch.setattr("draftsmith.eval.decoding.batch.KController", Untimed)
    # the rows' fallback alone: the batch's own judges timings (tests/eval/test_batch_judge.py)
    monkeypatch.setattr("draftsmith.eval.decoding.batch.BatchJudge", lambda k: None)
    proposer = make("lm", target_model)
    dec = BatchDecoder(target_model, proposer, k=3, fallback=True, layout=layout)
    dec.drafter = Hostile(dec.drafter, [1], VOCAB)
    fed: list[int] = []
    feed = dec.target.feed
    dec.target.feed = lambda ids, valid, **kw: fed.append(
        dec.target.slots.pack(ids, valid).numel()) or feed(ids, valid, **kw)
    got = dec.generate(BATCH_PROMPTS[:2], max_new_tokens=30)
    for prompt, res in zip(BATCH_PROMPTS[:2], got):
        assert res.output_ids == hf_greedy(target_model, prompt, 30, None)
    assert got[1].stats.plain_steps > got[1].stats.spec_steps > 0  # fell back, probed
    # both rows speculate for the first steps (8 tokens either way), then row 1 falls back
    assert (5 in fed) == (layout == "packed") and (fed.count(8) > 4) == (layout == "padded")


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batched_decoding_compacts_without_changing_outputs(target_model, layout):
    # a draft that is always wrong at K = 6 leaves 6 invalid slots per step and row: the cache
    # is compacted along the way, and the outputs stay the target's
    proposer = DraftLMProposer(tiny_llama(seed=9, vocab=VOCAB, layers=1), VOCAB)
    dec = BatchDecoder(target_model, proposer, k=6, fallback=False, layout=layout)
    got = dec.generate(BATCH_PROMPTS, max_new_tokens=40)
    for prompt, res in zip(BATCH_PROMPTS, got):
        assert res.output_ids == hf_greedy(target_model, prompt, 40, None)
    longest = max(len(p) for p in BATCH_PROMPTS) + 40
    if layout == "padded":
        assert dec.target.slots.width <= 2 * longest + 16 + 7  # compacted (else ~40 * 7 slots)
    else:  # one row holds every row's slots
        assert dec.target.slots.width <= 2 * len(BATCH_PROMPTS) * longest + 16 + 7 * 4


def test_draft_lm_trees_and_packed_trees_are_refused(target_model):
    tree = DraftLMProposer(copy.deepcopy(target_model), VOCAB, tree=True)
    with pytest.raises(ValueError, match="tree=chain for the 'lm-tree' draft"):
        BatchDecoder(target_model, tree)
    with pytest.raises(ValueError, match="batched trees use the padded layout"):
        BatchDecoder(target_model, EagleProposer(make("eagle", target_model).head, VOCAB,
                                                 tree=True), layout="packed")


def test_medusa_batches_chains_of_one_token_per_head_alone_and_beside_suffix_chains(target_model):
    from draftsmith.eval.decoding.proposers_medusa import MedusaProposer
    from draftsmith.eval.decoding.proposers_suffix import SuffixProposer

    medusa = make("medusa", target_model)  # three heads
    dec = BatchDecoder(target_model, medusa, k=5, fallback=False)
    assert dec.k == 3  # a chain is one token per head
    hybrid = BatchDecoder(target_model, SuffixProposer(medusa, VOCAB), k=5, fallback=False)
    assert hybrid.k == 3
    for d in (dec, hybrid):
        got = d.generate(BATCH_PROMPTS, max_new_tokens=24)
        for prompt, res in zip(BATCH_PROMPTS, got):
            assert res.output_ids == hf_greedy(target_model, prompt, 24, None)
        assert sum(r.stats.accepted for r in got) > 0  # some drafts accepted, on the same path
    tree = MedusaProposer(medusa.heads, VOCAB)  # its default static tree
    with pytest.raises(ValueError, match="tree=chain for the 'medusa' draft"):
        BatchDecoder(target_model, tree)


def test_slot_cache_tree_masks_positions_and_path_keep():
    slots = SlotCache(tiny_llama(seed=0, vocab=VOCAB).config, 2, torch.device("cpu"))
    slots.open(torch.tensor([[True, True], [True, False]]))  # committed: 2 and 1 tokens
    # a root and two children of it; row 1 has the root only (its other slots are padding)
    anc = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]], [[1, 0, 0], [0, 1, 0], [0, 0, 1]]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    mask, pos = slots.open_tree(valid, anc.bool(), torch.tensor([[0, 1, 1], [0, 0, 0]]), 2)
    assert pos.tolist() == [[2, 3, 3], [1, 1, 1]]  # siblings share a position
    assert mask[0, 0].tolist() == [[True, True, True, False, False],
                                   [True, True, True, True, False],
                                   [True, True, True, False, True]]
    assert mask[1, 0, 0].tolist() == [True, False, True, False, False]
    slots.keep_mask(2, torch.tensor([[True, False, True], [True, False, False]]))
    assert slots.lengths().tolist() == [4, 2]  # row 0 kept the root and its second child
    mask, pos = slots.open(torch.tensor([[True], [True]]))
    assert pos.tolist() == [[4], [2]]
    assert mask[0, 0, 0].tolist() == [True, True, True, False, True, True]


TREE_PROMPTS = [[1, 0, 1], [0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1, 0, 1, 1], [0]]


def test_greedy_tree_rows_equal_batch_one_decoding():
    # EAGLE-2 dynamic trees per row (depth 3, 10 nodes), prompts of four lengths: each row is
    # its batch-one decoding, token for token and path for path, and the trees are accepted deep
    model = _binary_llama(seed=1)
    proposer = _deep_proposer("eagle-tree", model)
    single = SpeculativeDecoder(model, proposer, k=3, adaptive=False, fallback=False)
    got = BatchDecoder(model, proposer, k=3, fallback=False).generate(TREE_PROMPTS, 20)
    for prompt, res in zip(TREE_PROMPTS, got):
        alone = single.generate(prompt, max_new_tokens=20)
        assert res.output_ids == alone.output_ids == hf_greedy(model, prompt, 20, None)
        assert res.stats.accepted_at == alone.stats.accepted_at
        assert res.stats.spec_steps == alone.stats.spec_steps
    assert min(r.stats.accepted_at[2] for r in got) >= 3  # depth 3 accepted, every row
    # with per-row fallback on (each row's controller told it drafts trees), still the target's
    for prompt, res in zip(TREE_PROMPTS, BatchDecoder(model, proposer, k=3).generate(
            TREE_PROMPTS, 20)):
        assert res.output_ids == hf_greedy(model, prompt, 20, None)


# ----- sampling: rows of different prompts in one batch, each from the target's distribution
PROMPT_A, PROMPT_B = [1, 0, 1], [0, 0, 1, 1, 0]
ROWS = 300  # per prompt, in batches of 2 * 50 rows (the prompts interleaved)


def _batch_p_values(kind: str, setting: dict, swap_counts: bool = False,
                    layout: str = "padded") -> list[float]:
    model = _binary_llama(seed=1)
    dec = BatchDecoder(model, _deep_proposer(kind, model), k=3, fallback=False, layout=layout)
    if swap_counts and dec.tree:  # the twin: each row is given its neighbour's accepted path
        verify_trees = dec._verify_trees

        def swapped_paths(logits, props, sizes, *args):
            got = verify_trees(logits, props, sizes, *args)
            return [([j for j in got[i - 1].path if j < sizes[i]], nxt)
                    for i, (_, nxt) in enumerate(got)]
        dec._verify_trees = swapped_paths
    elif swap_counts:  # the twin: each row is given its neighbour's accepted count
        verify = dec._verify

        def swapped(*args, **kw):
            n, nxt = verify(*args, **kw)
            return n.roll(1), nxt
        dec._verify = swapped
    p_values, reached_3 = sampled_p_values(model, dec, setting)
    assert reached_3 > ROWS // 4  # the third position was decided often
    return p_values


def sampled_p_values(model, dec: BatchDecoder, setting: dict) -> tuple[list[float], int]:
    """``ROWS`` rows of each prompt sampled by ``dec`` (the prompts interleaved in batches of
    100, seed 0): each prompt's chi-square p-value against the target's distribution of its
    ``DEEP_NEW`` tokens, and how often a third draft position was decided."""
    g = torch.Generator().manual_seed(0)
    outs: dict[int, list[int]] = {0: [], 1: []}
    reached_3 = 0
    for _ in range(ROWS // 50):
        prompts = [PROMPT_A, PROMPT_B] * 50
        for i, res in enumerate(dec.generate(prompts, max_new_tokens=DEEP_NEW, generator=g,
                                             **setting)):
            outs[i % 2].append(int("".join(map(str, res.output_ids[:DEEP_NEW])), DEEP_V))
            reached_3 += res.stats.reached[2] if len(res.stats.reached) > 2 else 0
    return [chi_square_p(torch.tensor(outs[j]), _deep_exact_for(model, prompt, setting))
            for j, prompt in enumerate((PROMPT_A, PROMPT_B))], reached_3


def _deep_exact_for(model, prompt: list[int], setting: dict) -> torch.Tensor:
    import tests.eval.test_sampling_exact as exact

    old = exact.DEEP_PROMPT
    exact.DEEP_PROMPT = prompt
    try:
        return _deep_exact(model, setting)
    finally:
        exact.DEEP_PROMPT = old


# (kind, layout): chains in both layouts; EAGLE-2 trees (children drawn without replacement,
# and the top-k's point masses) in the padded one, the layout batched trees use
BATCH_KINDS = [("lm-chain", "padded"), ("lm-chain", "packed"), ("eagle-chain", "padded"),
               ("eagle-chain", "packed"), ("eagle-tree", "padded"), ("eagle-tree-topk", "padded")]


@pytest.mark.parametrize("setting", DEEP_SETTINGS, ids=["T0.7", "T1.0"])
@pytest.mark.parametrize(("kind", "layout"), BATCH_KINDS)
def test_batched_rows_sample_exactly(kind, setting, layout):
    assert min(_batch_p_values(kind, setting, layout=layout)) > 0.01


@pytest.mark.parametrize(("kind", "layout"), BATCH_KINDS)
def test_twin_another_rows_accepted_count_fails(kind, layout):
    # the test above (every prompt p > 0.01) fails: some prompt is far off
    assert min(_batch_p_values(kind, DEEP_SETTINGS[1], swap_counts=True, layout=layout)) < 1e-3


def test_batched_trees_of_different_sizes_sample_exactly():
    # top-p 0.8 leaves prompt B's nodes one child each and prompt A's two: the rows of a batch
    # verify trees of different sizes (8 and 6 nodes); prompt A still samples the target's
    # distribution (B's is a single sequence, nothing to test), and fails when paths are swapped
    top_p = {"temperature": 1.0, "top_k": 0, "top_p": 0.8}
    model = _binary_llama(seed=1)
    dec = BatchDecoder(model, _deep_proposer("eagle-tree", model), k=3, fallback=False)
    sizes: list[tuple[int, ...]] = []
    verify_trees = dec._verify_trees
    dec._verify_trees = lambda lg, props, n, *a: sizes.append(tuple(n)) or verify_trees(
        lg, props, n, *a)
    dec.generate([PROMPT_A, PROMPT_B], DEEP_NEW, seed=0, **top_p)
    assert len(set(sizes[0])) == 2
    assert _batch_p_values("eagle-tree", top_p)[0] > 0.01
    assert _batch_p_values("eagle-tree", top_p, swap_counts=True)[0] < 1e-3


@pytest.mark.real
@pytest.mark.parametrize(("layout", "tree"), [("padded", "chain"), ("packed", "chain"),
                                              ("padded", "tree")])
def test_batched_rows_equal_batch_one_on_the_real_target(real_target, layout, tree):
    # the released EAGLE-3 head (fused layers, 8,192-id draft vocabulary) on the real target,
    # fp32, chains and EAGLE-2 trees (16 nodes): each row of a batch of prompts of different
    # lengths is, token for token and acceptance for acceptance, its batch-one decoding
    from pathlib import Path

    from draftsmith.eval.draft import build_proposer, load_draft, settle
    from draftsmith.eval.session import encode_prompt

    model = copy.deepcopy(real_target.model).float().eval()
    pkg = load_draft(Path(__file__).resolve().parents[2] / "releases/eagle3-smollm2-135m",
                     real_target)
    plan = settle({"k": 3, "tree": tree, "tree_topk": 8, "tree_size": 16,
                   "medusa_branching": None, "draft_vocab": None, "device": "cpu",
                   "dtype": "float32"}, pkg, measured=False)
    eagle = build_proposer(pkg, plan, real_target, int(model.config.vocab_size))
    texts = ["Write a haiku about rain.", "What is 17 times 23? Explain each step briefly.",
             "List three uses of a paperclip."]
    prompts = [encode_prompt(real_target.tokenizer, t) for t in texts]
    single = SpeculativeDecoder(model, eagle, k=3, adaptive=False, fallback=False)
    got = BatchDecoder(model, eagle, k=3, fallback=False, layout=layout).generate(
        prompts, max_new_tokens=24)
    for prompt, res in zip(prompts, got):
        alone = single.generate(prompt, max_new_tokens=24)
        assert res.output_ids == alone.output_ids
        assert res.stats.accepted_at == alone.stats.accepted_at
    assert sum(r.stats.accepted for r in got) > 0  # the head's drafts were accepted, not just run
