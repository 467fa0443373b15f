"""The speculative decoder on tiny random models: greedy output equals the target's own greedy
``generate`` for every proposer; caches roll back correctly; stop rules; fallback; statistics."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.proposers import (
    DraftLMProposer,
    PlainProposer,
    PromptLookupProposer,
    Proposer,
)
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.proposers_medusa import MedusaProposer, medusa_choices
from draftsmith.eval.decoding.proposers_suffix import SuffixIndex, SuffixProposer
from draftsmith.eval.decoding.target_model import Target
from tests.conftest import tiny_llama

VOCAB = 64
PROMPTS = [[1, 5, 9, 13, 5, 9], [1, 40, 41, 42, 43, 40, 41, 42, 43, 40], [1, 7]]


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0, vocab=VOCAB)


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


class OracleTree(Proposer):
    """Test proposer: a copy of the target drafts its greedy path (depth ``k``) and a random
    wrong sibling is put *before* the right token at each depth, so accepted paths are long and
    skip nodes (exercises ``forward_tree`` + ``keep_path``). Deterministic nodes (point masses)."""

    kind = "oracle-tree"

    def __init__(self, model, seed: int = 0, corrupt_depth: int | None = None) -> None:
        self.model = copy.deepcopy(model)
        self.rng = torch.Generator().manual_seed(seed)
        self.corrupt_depth = corrupt_depth

    @torch.inference_mode()
    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        seq = list(ctx.tokens)
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for d in range(1, k + 1):
            nxt = int(self.model(torch.tensor([seq])).logits[0, -1].argmax())
            if d == self.corrupt_depth:
                nxt = (nxt + 1) % VOCAB
            wrong = (nxt + 1 + int(torch.randint(VOCAB - 1, (1,), generator=self.rng))) % VOCAB
            tokens += [wrong, nxt]
            parents += [parent, parent]
            parent = len(tokens) - 1
            seq.append(nxt)
        return Proposal(torch.tensor(tokens), torch.tensor(parents))


def make_proposer(name: str, model):
    if name == "plain":
        return PlainProposer()
    if name == "lookup":
        return PromptLookupProposer(max_ngram=3)
    if name == "lm-self":
        return DraftLMProposer(copy.deepcopy(model), VOCAB)
    if name == "lm-other":
        return DraftLMProposer(tiny_llama(seed=7, vocab=VOCAB, layers=1), VOCAB)
    if name == "lm-tree":
        return DraftLMProposer(tiny_llama(seed=7, vocab=VOCAB, layers=1), VOCAB, tree=True,
                               topk=3, total_tokens=10)
    if name == "medusa":
        from draftsmith.heads.medusa import MedusaConfig, build_medusa
        torch.manual_seed(3)
        return MedusaProposer(build_medusa(MedusaConfig(num_heads=3), model).eval(), VOCAB,
                              medusa_choices((3, 2, 1)))
    if name in ("eagle", "eagle-tree"):
        from draftsmith.heads.eagle import build_eagle
        from draftsmith.heads.eagle_config import EagleConfig
        torch.manual_seed(4)
        head = build_eagle(EagleConfig(), model).eval()
        return EagleProposer(head, VOCAB, tree=name == "eagle-tree", topk=3, total_tokens=10)
    if name == "oracle-tree":
        return OracleTree(model)
    if name == "suffix":
        return SuffixProposer()
    if name.endswith(("+suffix", "+suffix-auto")):  # the hybrids
        inner, _, mode = name.partition("+")
        return SuffixProposer(make_proposer(inner, model), VOCAB,
                              mode="auto" if mode.endswith("auto") else "merge")
    raise ValueError(name)


ALL = ["plain", "lookup", "lm-self", "lm-other", "lm-tree", "medusa", "eagle", "eagle-tree",
       "oracle-tree", "suffix", "lm-other+suffix", "eagle+suffix", "eagle-tree+suffix",
       "lm-tree+suffix", "medusa+suffix", "eagle-tree+suffix-auto"]


@pytest.mark.parametrize("name", ALL)
def test_greedy_equals_target_generate(target_model, name):
    proposer = make_proposer(name, target_model)
    dec = SpeculativeDecoder(target_model, proposer, k=3, adaptive=False, fallback=False)
    for prompt in PROMPTS:
        want = hf_greedy(target_model, prompt, 24, eos=None)
        got = dec.generate(prompt, max_new_tokens=24, temperature=0.0)
        assert got.output_ids == want, f"{name} diverged on prompt {prompt}"
        assert got.stats.tokens_generated == 24
        assert got.stats.stop_reason == "max_new_tokens"


def test_oracle_tree_accepts_deep_paths(target_model):
    dec = SpeculativeDecoder(target_model, OracleTree(target_model), k=4, adaptive=False,
                             fallback=False)
    res = dec.generate(PROMPTS[0], max_new_tokens=21, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[0], 21, eos=None)
    # 1 prefill token, then steps of 5 tokens (4 accepted + bonus): 1 + 5 * 4 = 21
    assert res.stats.target_forwards == 5
    assert res.stats.alpha == [1.0] * 4
    assert res.stats.tau == pytest.approx(21 / 5)


def test_partial_tree_acceptance_stats(target_model):
    # depth 3 always wrong -> exactly 2 drafts accepted per step
    dec = SpeculativeDecoder(target_model, OracleTree(target_model, corrupt_depth=3), k=4,
                             adaptive=False, fallback=False)
    res = dec.generate(PROMPTS[1], max_new_tokens=13, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[1], 13, eos=None)
    assert res.stats.alpha[:3] == [1.0, 1.0, 0.0]
    assert res.stats.accepted == 2 * res.stats.spec_steps
    # the last step drafts only 2 deep (the token budget leaves room for 2 drafts + 1)
    assert res.stats.drafted == 4 * (res.stats.spec_steps - 1) + 2
    assert res.stats.acceptance_rate == pytest.approx(res.stats.accepted / res.stats.drafted)


def test_self_draft_accepts_everything(target_model):
    dec = SpeculativeDecoder(target_model, make_proposer("lm-self", target_model), k=4,
                             adaptive=False, fallback=False)
    res = dec.generate(PROMPTS[0], max_new_tokens=16, temperature=0.0)
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.target_forwards == 1 + 3  # prefill + 3 steps of 5 tokens
    assert res.stats.alpha_cumulative == [1.0] * 4


@pytest.mark.parametrize("topk", [1, 2])
def test_self_draft_tree_accepts_full_depth(topk):
    # the target as its own draft LM: the top-1 path of its dynamic tree is the target's greedy
    # continuation only if the draft's tree mask, positions and cache rollback are right (a
    # larger init than the default makes the predictions depend on context and position)
    target_model = tiny_llama(seed=0, vocab=VOCAB, initializer_range=0.3)
    proposer = DraftLMProposer(copy.deepcopy(target_model), VOCAB, tree=True, topk=topk,
                               total_tokens=30)  # keeps every node: the rerank drops none
    dec = SpeculativeDecoder(target_model, proposer, k=4, adaptive=False, fallback=False)
    res = dec.generate(PROMPTS[0], max_new_tokens=16, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[0], 16, eos=None)
    assert res.stats.alpha_cumulative == [1.0] * 4
    assert res.stats.target_forwards == 1 + 3  # prefill + 3 steps of 5 tokens
    assert proposer._cached() == 1 + len(PROMPTS[0]) + 15 - 5  # committed prefix, no tree nodes


def test_eos_and_stop_sequences_match_generate(target_model):
    prompt = PROMPTS[1]
    ref = hf_greedy(target_model, prompt, 20, eos=None)
    eos = ref[6]  # a token the target emits: output must end at its first occurrence
    want = hf_greedy(target_model, prompt, 20, eos=eos)
    assert want[-1] == eos and len(want) <= 7
    for name in ("plain", "lm-self", "oracle-tree"):
        dec = SpeculativeDecoder(target_model, make_proposer(name, target_model), k=4,
                                 adaptive=False, fallback=False)
        res = dec.generate(prompt, max_new_tokens=20, eos_token_id=eos)
        assert res.output_ids == want and res.stats.stop_reason == "eos"
        stop = ref[3:5]
        res = dec.generate(prompt, max_new_tokens=20, stop_sequences=[stop])
        first = next(i for i in range(len(ref) - 1) if ref[i:i + 2] == stop)
        assert res.output_ids == ref[: first + 2] and res.stats.stop_reason == "stop_sequence"


def test_time_budget_ends_request(target_model):
    dec = SpeculativeDecoder(target_model, PlainProposer(), k=0)
    res = dec.generate(PROMPTS[0], max_new_tokens=400, time_budget_s=0.0)
    assert res.stats.stop_reason == "time_budget"
    assert res.stats.tokens_generated == 2  # prefill token + the step during which it ran out
    assert res.output_ids == hf_greedy(target_model, PROMPTS[0], 2, eos=None)


class AntiDraft(DraftLMProposer):
    """A useless draft as costly as the target: always proposes a token the target rejects."""

    def propose(self, ctx, k):
        prop = super().propose(ctx, k)
        return Proposal.chain([(int(t) + 1) % VOCAB for t in prop.tokens])


@pytest.mark.serial  # the fallback is decided from measured step times
def test_useless_draft_falls_back_to_plain(target_model):
    dec = SpeculativeDecoder(target_model, AntiDraft(copy.deepcopy(target_model), VOCAB), k=4,
                             probe_every=16)
    res = dec.generate(PROMPTS[0], max_new_tokens=64, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[0], 64, eos=None)
    assert res.stats.accepted == 0
    # 3 steps before the first decision (the draft costs as much as the target: a step costs
    # about 5 plain steps), then one probe per 16 plain steps
    assert res.stats.spec_steps <= 3 + 64 // 16
    assert res.stats.plain_steps >= 64 - 1 - res.stats.spec_steps - 1


def test_adaptive_k_stays_lossless_and_bounded(target_model):
    # Whether K grows depends on measured timings (see test_kstar for the controller's logic on
    # synthetic costs); here: adapting K never changes the output and never exceeds k_max.
    dec = SpeculativeDecoder(target_model, make_proposer("lm-self", target_model), k=1, k_max=6,
                             fallback=False)
    res = dec.generate(PROMPTS[2], max_new_tokens=40, temperature=0.0)
    assert res.output_ids == hf_greedy(target_model, PROMPTS[2], 40, eos=None)
    assert 1 <= len(res.stats.alpha) <= 6


def test_target_cache_never_recomputes(target_model):
    tgt = Target(target_model)
    dec = SpeculativeDecoder(tgt, make_proposer("lm-other", target_model), k=3, adaptive=False,
                             fallback=False)
    res = dec.generate(PROMPTS[0], max_new_tokens=12)
    # the cache holds prompt + all generated tokens but the last (pending) one
    assert tgt.seq_len == len(PROMPTS[0]) + len(res.output_ids) - 1
    full = target_model(torch.tensor([PROMPTS[0] + res.output_ids[:-1]]), use_cache=True,
                        past_key_values=DynamicCache(config=target_model.config))
    for got, ref in zip(tgt.cache.layers, full.past_key_values.layers):
        torch.testing.assert_close(got.keys, ref.keys, atol=1e-5, rtol=1e-4)


def test_tree_forward_matches_chain_forward(target_model):
    tgt = Target(target_model)
    prompt = torch.tensor(PROMPTS[1])
    tgt.prefill(prompt)
    # tree: two branches [10, 11] and [20, 21, 22]; branch 2 must equal a plain chain forward
    out = tgt.forward_tree(torch.tensor([10, 20, 11, 21, 22]), torch.tensor([-1, -1, 0, 1, 3]))
    ref = target_model(torch.tensor([PROMPTS[1] + [20, 21, 22]])).logits[0, -3:]
    torch.testing.assert_close(out.logits[[1, 3, 4]], ref, atol=1e-4, rtol=1e-4)
    tgt.keep_path(len(PROMPTS[1]), [1, 3, 4])
    nxt = tgt.extend(torch.tensor([5]))
    ref = target_model(torch.tensor([PROMPTS[1] + [20, 21, 22, 5]])).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0], ref, atol=1e-4, rtol=1e-4)


def test_native_gqa_skips_the_kv_copy_and_leaves_the_environment_alone(target_model, monkeypatch):
    import os

    import transformers.integrations.sdpa_attention as sdpa

    from draftsmith.data.attention import FORCE_GQA_ENV, native_gqa

    assert target_model.config.num_key_value_heads < target_model.config.num_attention_heads
    copies = []
    repeat_kv = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: copies.append(n) or repeat_kv(h, n))
    monkeypatch.delenv(FORCE_GQA_ENV, raising=False)
    tgt = Target(target_model)
    tgt.prefill(torch.tensor(PROMPTS[1]))
    out = tgt.forward_tree(torch.tensor([10, 20, 11, 21]), torch.tensor([-1, -1, 0, 1]))
    assert copies == []  # masked multi-token forward: no repeat_kv copy of the cache
    assert FORCE_GQA_ENV not in os.environ
    # the same forward through transformers' default path copies the cache and agrees
    past = DynamicCache(config=target_model.config)
    target_model(torch.tensor([PROMPTS[1]]), past_key_values=past, use_cache=True)
    mask = torch.ones(1, 1, 2, len(PROMPTS[1]) + 2, dtype=torch.bool)
    mask[0, 0, 0, -1] = False  # chain 20 -> 21 (rows 1 and 3 of the tree)
    ref = target_model(torch.tensor([[20, 21]]), past_key_values=past, attention_mask=mask,
                       position_ids=torch.tensor([[len(PROMPTS[1])] * 2]) + torch.tensor([[0, 1]]))
    assert copies  # the default path did copy
    torch.testing.assert_close(out.logits[[1, 3]], ref.logits[0], atol=1e-5, rtol=1e-5)
    # scoped: restored after the block, also on errors, and a value set before is kept
    monkeypatch.setenv(FORCE_GQA_ENV, "0")
    with pytest.raises(RuntimeError), native_gqa():
        assert os.environ[FORCE_GQA_ENV] == "1"
        raise RuntimeError
    assert os.environ[FORCE_GQA_ENV] == "0"


def test_bad_settings_raise(target_model):
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeDecoder(target_model, PlainProposer(), acceptance="fast")
    dec = SpeculativeDecoder(target_model, PlainProposer())
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        dec.generate([1, 2], max_new_tokens=2, temperature=1.0, top_p=0.0)


def test_eagle_chain_feeds_the_lm_head_a_canonical_row(target_model):
    # The LM head must see a (1, 1, H) tensor with strides (H, H, 1): a slice of a longer output
    # keeps the batch stride T * H, which sends torch's CPU bf16 linear down a path ~40x slower.
    prop = make_proposer("eagle", target_model)
    seen = []
    compute = prop.head.compute_logits

    def spy(hidden):
        seen.append(hidden.stride())
        return compute(hidden)

    prop.head.compute_logits = spy
    SpeculativeDecoder(target_model, prop, k=2, adaptive=False, fallback=False).generate(
        PROMPTS[1], max_new_tokens=6)
    h = target_model.config.hidden_size
    assert seen and all(s == (h, h, 1) for s in seen), seen


class RecordingDraft(DraftLMProposer):
    """A sampling draft LM that records the device of the generator it drafts with."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generator_devices: list[torch.device] = []

    def propose(self, ctx, k):
        self.generator_devices.append(ctx.generator.device)
        return super().propose(ctx, k)


def test_the_generator_is_made_on_the_target_device(target_model, monkeypatch):
    """CUDA refuses a CPU generator for ``torch.rand`` / ``torch.multinomial`` on its tensors: the
    decoder must ask for one on the target's device (tests/eval/test_gpu.py runs it at T = 1)."""
    made = []
    real = torch.Generator

    def generator(device=None):
        made.append(device)
        return real() if device is None else real(device=device)

    draft = RecordingDraft(tiny_llama(seed=7, vocab=VOCAB, layers=1), VOCAB)
    dec = SpeculativeDecoder(target_model, draft, k=3, adaptive=False, fallback=False)
    monkeypatch.setattr(torch, "Generator", generator)
    res = dec.generate(PROMPTS[0], 12, temperature=1.0, seed=5)
    monkeypatch.undo()
    assert made == [dec.target.device]  # asked for explicitly, not torch's default device
    assert draft.generator_devices and set(draft.generator_devices) == {dec.target.device}
    # on the CPU the draws are bit-identical to those of a default generator with the same seed
    ref = dec.generate(PROMPTS[0], 12, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert res.output_ids == ref.output_ids and res.stats.drafted > 0


def test_a_generator_on_another_device_is_refused(target_model):
    class CudaGenerator:  # what torch.Generator(device="cuda") reports, without needing CUDA
        device = torch.device("cuda", 0)

    dec = SpeculativeDecoder(target_model, PlainProposer(), k=0)
    with pytest.raises(ValueError, match=r"generator is on cuda:0 but the target on cpu"):
        dec.generate(PROMPTS[0], 4, temperature=1.0, generator=CudaGenerator())


def _latest_earlier_match(seq: list[int]) -> tuple[int, int]:
    """The longest suffix of ``seq`` that also ends earlier, and its latest earlier end: by a
    scan (what :class:`SuffixIndex` answers without one)."""
    n = len(seq)
    for m in range(n - 1, 0, -1):
        ends = [e for e in range(m - 1, n - 1) if seq[e - m + 1:e + 1] == seq[n - m:]]
        if ends:
            return m, max(ends)
    return 0, -1


def test_suffix_index_answers_as_a_scan_does():
    gen = torch.Generator().manual_seed(0)
    for vocab, n in ((2, 60), (3, 80), (40, 120)):
        seq = torch.randint(vocab, (n,), generator=gen).tolist()
        index = SuffixIndex()
        for i, tok in enumerate(seq):
            index.append(tok)
            assert index.match() == _latest_earlier_match(seq[:i + 1]), (vocab, i)
    index = SuffixIndex([5, 6, 7, 8, 1, 5, 6, 7])
    assert index.continuation(3) == (3, [8, 1, 5])  # what followed "5 6 7" the first time


def test_suffix_drafts_copy_prompt_spans(target_model):
    """A prompt that holds the target's own greedy continuation: the suffix proposer drafts it
    back in long chains (few target forwards), the output still equal to generate's."""
    base = PROMPTS[1]
    out = hf_greedy(target_model, base, 30, eos=None)
    prompt = base + out + [3] + base  # the continuation is in the prompt, after the same text
    dec = SpeculativeDecoder(target_model, SuffixProposer(), k=4, adaptive=False, fallback=False)
    res = dec.generate(prompt, max_new_tokens=24)
    assert res.output_ids == hf_greedy(target_model, prompt, 24, eos=None)
    assert res.stats.tau > 3 and max(len(res.stats.reached), 0) > 4  # chains beyond k = 4


def test_hybrid_maps_the_inner_path_and_counts_its_choices(target_model):
    hybrid = SuffixProposer(make_proposer("lm-other", target_model), VOCAB, mode="merge")
    dec = SpeculativeDecoder(target_model, hybrid, k=3, adaptive=False, fallback=False)
    prompt = PROMPTS[1] * 3
    res = dec.generate(prompt, max_new_tokens=24)
    assert res.output_ids == hf_greedy(target_model, prompt, 24, eos=None)
    assert hybrid.choices["both"] > 0  # merged trees were verified
    assert hybrid.inner._cached() <= len(prompt) + 24  # the draft LM's cache stayed a prefix
