"""Exactness: speculative sampling must reproduce the target's distribution over whole outputs.

A toy target and draft are tables of logits over a vocabulary of 8 for every context of up to 2
generated tokens, so the exact distribution of 3 new tokens (512 outcomes) is enumerable. 20,000
speculative samples (batched through the pure verifiers) must pass a chi-square test (p > 0.01)
for chains and trees (point-mass and sampled nodes), at two warping settings. Twins run the same
test with the residual step removed and must fail it. One end-to-end test runs the real decoder
on tiny transformers models with fewer samples.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from draftsmith.eval.decoding import verify
from draftsmith.eval.decoding.verify import verify_chain_batch, verify_tree_batch, warp

V, NEW, N_SAMPLES = 8, 3, 20_000
SETTINGS = [{"temperature": 0.7, "top_k": 5, "top_p": 1.0},
            {"temperature": 1.0, "top_k": 0, "top_p": 0.9}]
OFFSETS = [0, 1, 1 + V, 1 + V + V * V]  # context id = OFFSETS[len] + base-V number


def ctx_id(seq: torch.Tensor, length: int) -> torch.Tensor:
    """Context ids of ``seq[:, :length]`` ((B, L) tokens) -> (B,)."""
    ids = torch.zeros(seq.shape[0], dtype=torch.long)
    for i in range(length):
        ids = ids * V + seq[:, i]
    return ids + OFFSETS[length]


class Toy:
    """Logit tables for target and draft (draft = damped target + noise: partial acceptance)."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        n_ctx = OFFSETS[-1]
        target = 2.0 * torch.randn(n_ctx, V, generator=g)
        draft = 0.5 * target + 1.5 * torch.randn(n_ctx, V, generator=g)
        self.p = warp(target, temperature, top_k, top_p)  # (n_ctx, V)
        self.q = warp(draft, temperature, top_k, top_p)

    def exact(self) -> torch.Tensor:
        """(V**NEW,) exact probability of every output (index = base-V number)."""
        probs = torch.zeros(V ** NEW)
        for out in itertools.product(range(V), repeat=NEW):
            seq = torch.tensor([out])
            pr = 1.0
            for i in range(NEW):
                pr *= float(self.p[ctx_id(seq, i), out[i]])
            probs[int(ctx_id(seq, NEW)) - OFFSETS[NEW]] = pr
        return probs


def _draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=g).squeeze(-1)


def chain_step(toy: Toy, seq: torch.Tensor, length: int, k: int, g: torch.Generator):
    """One speculative chain step for draws sharing ``length``: returns new tokens (B, k+1),
    count."""
    b = seq.shape[0]
    work = seq.clone()
    qs, ps = [], []
    for i in range(k + 1):
        cid = ctx_id(work, length + i)
        ps.append(toy.p[cid])
        if i < k:
            qs.append(toy.q[cid])
            work[:, length + i] = _draw(qs[-1], g)
    drafts = work[:, length:length + k]
    q = torch.stack(qs, 1) if qs else torch.zeros(b, 0, V)
    n, nxt = verify_chain_batch(torch.stack(ps, 1), q, drafts, g)
    new = torch.cat([drafts, torch.zeros(b, 1, dtype=torch.long)], 1)
    new.scatter_(1, n.unsqueeze(1), nxt.unsqueeze(1))
    return new, n + 1


TREE_PARENTS = torch.tensor([-1, -1, 0, 0, 1])  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}


def tree_step(toy: Toy, seq: torch.Tensor, length: int, depth: int, g: torch.Generator,
              sampled: bool):
    """One tree step. Point-mass mode: every node is a top-ranked draft token (deterministic);
    sampled mode: root children are two i.i.d. draws from q, deeper nodes one draw each."""
    b = seq.shape[0]
    parents = TREE_PARENTS if depth >= 2 else TREE_PARENTS[:2]
    n = parents.shape[0]
    node_ctx = torch.zeros(b, n + 1, NEW + 2, dtype=torch.long)  # full sequence at each node
    node_ctx[:, 0, :] = torch.cat([seq, torch.zeros(b, 2, dtype=torch.long)], 1)
    tokens = torch.zeros(b, n, dtype=torch.long)
    q = torch.zeros(b, n, V)
    p = torch.zeros(b, n + 1, V)
    p[:, 0] = toy.p[ctx_id(seq, length)]
    depth_of = [0] * n
    rank: dict[int, int] = {}
    for j in range(n):
        par = int(parents[j])
        d = 1 if par < 0 else depth_of[par] + 1
        depth_of[j] = d
        base = node_ctx[:, par + 1]
        q_par = toy.q[ctx_id(base, length + d - 1)]  # (B, V)
        if sampled:
            tok = _draw(q_par, g)
            q[:, j] = q_par
        else:
            rank[par] = rank.get(par, -1) + 1
            tok = torch.topk(q_par, rank[par] + 1, dim=-1).indices[:, -1]
            q[:, j] = torch.nn.functional.one_hot(tok, V).float()
        tokens[:, j] = tok
        node_ctx[:, j + 1] = base
        node_ctx[:, j + 1, length + d - 1] = tok
        p[:, j + 1] = toy.p[ctx_id(node_ctx[:, j + 1], length + d)]
    acc, nxt = verify_tree_batch(p, q if sampled else None, tokens, parents, g)
    count = acc.sum(-1)
    new = torch.zeros(b, depth + 1, dtype=torch.long)
    for i in range(b):
        path = torch.nonzero(acc[i]).flatten().tolist()
        row = tokens[i, path].tolist() + [int(nxt[i])]
        new[i, : len(row)] = torch.tensor(row)
    return new, count + 1


def sample_outputs(toy: Toy, mode: str, seed: int) -> torch.Tensor:
    """N_SAMPLES outputs of NEW tokens -> (N_SAMPLES,) outcome indices."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.zeros(N_SAMPLES, NEW, dtype=torch.long)
    lengths = torch.zeros(N_SAMPLES, dtype=torch.long)
    while bool((lengths < NEW).any()):
        for length in range(NEW):
            rows = torch.nonzero(lengths == length).flatten()
            if rows.numel() == 0:
                continue
            k = NEW - length - 1  # drafts that fit, +1 verified token
            if mode == "chain":
                new, count = chain_step(toy, seq[rows], length, k, g)
            else:
                new, count = (tree_step(toy, seq[rows], length, k, g,
                                        sampled=mode == "tree-sampled")
                              if k > 0 else chain_step(toy, seq[rows], length, 0, g))
            for i in range(new.shape[1]):
                write = (i < count) & (length + i < NEW)
                idx = rows[write]
                seq[idx, length + i] = new[write, i]
            lengths[rows] = lengths[rows] + count
    return ctx_id(seq, NEW) - OFFSETS[NEW]


def chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test; cells with expected < 5 are pooled.
    Any sample in a zero-probability cell is an immediate failure (p = 0)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs.double() * samples.numel()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


MODES = ["chain", "tree-point", "tree-sampled"]


@pytest.mark.parametrize("setting", SETTINGS, ids=["T0.7-topk5", "T1.0-topp0.9"])
@pytest.mark.parametrize("mode", MODES)
def test_speculative_sampling_is_exact(mode, setting):
    toy = Toy(**setting)
    samples = sample_outputs(toy, mode, seed=11)
    assert chi_square_p(samples, toy.exact()) > 0.01


@pytest.mark.parametrize("mode", MODES)
def test_twin_without_residual_step_fails(mode, monkeypatch):
    """Same test with a broken verifier (rejections resample from p, not norm(max(p - q, 0)))."""
    monkeypatch.setattr(verify, "_residual", lambda r, q: r)
    toy = Toy(**SETTINGS[1])
    samples = sample_outputs(toy, mode, seed=11)
    assert chi_square_p(samples, toy.exact()) < 0.01


def test_toy_is_not_trivial():
    """The toy has real rejections (else the twins would prove nothing)."""
    toy = Toy(**SETTINGS[1])
    overlap = torch.minimum(toy.p, toy.q).sum(-1)  # per-context acceptance probability
    assert 0.2 < float(overlap.mean()) < 0.9


# ----------------------------------------------------------------------------- end to end
E2E_SETTING = {"temperature": 0.6, "top_k": 4, "top_p": 1.0}
E2E_SAMPLES = 600
E2E_SUBSET = torch.tensor([0, 1, 3, 4, 6])  # a draft vocabulary of 5 of the 8 ids


def _exact_tiny(model, prompt: list[int]) -> torch.Tensor:
    """(V**3,) exact warped distribution of 3 new tokens of a tiny transformers model."""
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # (64, L+2)
    with torch.no_grad():
        p = warp(model(seqs).logits[:, -3:], **E2E_SETTING)  # (64, 3, V)
    probs = torch.zeros(V ** NEW)
    for a, b in itertools.product(range(V), repeat=2):
        row = p[a * V + b]
        probs[(a * V + b) * V: (a * V + b + 1) * V] = row[0, a] * row[1, b] * row[2]
    return probs


def _e2e_p_value(kind: str) -> float:
    from draftsmith.eval.decoding.decoder import SpeculativeDecoder
    from draftsmith.eval.decoding.proposers import DraftLMProposer
    from draftsmith.eval.decoding.proposers_medusa import MedusaProposer, medusa_choices
    from draftsmith.heads.medusa import MedusaConfig, build_medusa
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=1, vocab=V, hidden=16, layers=1)
    if kind.startswith("draft-lm"):
        # "-vocab": drafts over 5 of the 8 ids only (q = 0 elsewhere, heads/vocab.py)
        proposer = DraftLMProposer(tiny_llama(seed=2, vocab=V, hidden=16, layers=1), V,
                                   tree="tree" in kind, topk=2, total_tokens=4,
                                   vocab_ids=E2E_SUBSET if kind.endswith("vocab") else None)
    else:
        torch.manual_seed(2)
        heads = build_medusa(MedusaConfig(num_heads=2), model).eval()
        for par in heads.parameters():  # move the heads away from the target's own LM head
            par.data.add_(0.5 * torch.randn_like(par))
        proposer = MedusaProposer(heads, V, medusa_choices((3, 2)))
    dec = SpeculativeDecoder(model, proposer, k=2, adaptive=False, fallback=False)
    prompt = [1, 3, 5]
    g = torch.Generator().manual_seed(0)
    outs, accepted = [], 0
    for _ in range(E2E_SAMPLES):
        res = dec.generate(prompt, max_new_tokens=NEW, generator=g, **E2E_SETTING)
        outs.append((res.output_ids[0] * V + res.output_ids[1]) * V + res.output_ids[2])
        accepted += res.stats.accepted
    assert 0 < accepted < E2E_SAMPLES  # speculation really happened, with rejections
    return chi_square_p(torch.tensor(outs), _exact_tiny(model, prompt))


@pytest.mark.parametrize("kind", ["draft-lm-chain", "draft-lm-tree", "medusa-tree",
                                  "draft-lm-chain-vocab", "draft-lm-tree-vocab"])
def test_decoder_end_to_end_sampling_is_exact(kind):
    assert _e2e_p_value(kind) > 0.01


def test_draft_vocab_with_q_on_the_wrong_ids_fails(monkeypatch):
    """The subset chain's twin with the draft's q scattered onto ids 0..4 instead of the subset
    (a drafted id then looks like q = 0: always accepted) must fail the same test."""
    from draftsmith.eval.decoding.proposers import DraftLMProposer

    def misplaced(self, q):
        return q.new_zeros(self.vocab_size).index_copy(0, torch.arange(q.numel()), q)

    monkeypatch.setattr(DraftLMProposer, "_scatter_q", misplaced)
    assert _e2e_p_value("draft-lm-chain-vocab") < 0.01


# ------------------------------------------------- end to end, K = 3 chains and depth-3 trees
# Three drafts need max_new_tokens >= K + 2 (the prefill gives the first token and the last step
# keeps room for its bonus token); with NEW = 3 above K is capped at 1. A binary vocabulary keeps
# the whole output enumerable at 6 new tokens (64 outcomes), so the chi-square is over whole
# outputs again. Twins corrupt q at the third draft position only and must fail.
DEEP_V, DEEP_NEW, DEEP_K, DEEP_SAMPLES = 2, 6, 3, 600
DEEP_PROMPT = [1, 0, 1]
DEEP_SETTINGS = [{"temperature": 0.7, "top_k": 0, "top_p": 1.0},
                 {"temperature": 1.0, "top_k": 0, "top_p": 1.0}]
DEEP_KINDS = ["lm-chain", "lm-tree", "eagle-chain", "eagle-tree"]  # trees: children drawn
TOPK_TREES = ["lm-tree-topk", "eagle-tree-topk"]  # trees of the draft's top-k (point masses)


def _binary_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=DEEP_V, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True, rope_theta=10000.0,
                      initializer_range=0.3, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


class WrongQAtDepth3:
    """A proposer wrapper whose ``q`` rows of the depth-3 nodes (the third drafted position) are
    shifted by one token id (a misaligned q; point-mass nodes get the one-hot of the wrong id)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.layer_ids, self.tree = inner.name, inner.layer_ids, inner.tree
        self.lossless = True

    def reset(self, tokens, target_out) -> None:
        self.inner.reset(tokens, target_out)

    def accept(self, path, new_tokens, target_out) -> None:
        self.inner.accept(path, new_tokens, target_out)

    def propose(self, ctx, k):
        from draftsmith.eval.decoding.proposal import Proposal

        prop = self.inner.propose(ctx, k)
        q = (prop.q if prop.q is not None
             else torch.nn.functional.one_hot(prop.tokens, DEEP_V).float()).clone()
        at = prop.depth() == 3
        q[at] = q[at].roll(1, dims=-1)
        return Proposal(prop.tokens, prop.parents, q)


def _deep_proposer(kind: str, model):
    import copy

    from draftsmith.eval.decoding.proposers import DraftLMProposer
    from draftsmith.eval.decoding.proposers_eagle import EagleProposer
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig
    from tests.conftest import randomize

    tree = "-tree" in kind
    draw = "topk" if kind.endswith("-topk") else "sample"
    if kind.startswith("lm"):  # the target plus noise: long accepted prefixes, some rejections
        draft = randomize(randomize(copy.deepcopy(model), seed=2), seed=5)
        return DraftLMProposer(draft, DEEP_V, tree=tree, topk=2, total_tokens=10, tree_draw=draw)
    # an EAGLE head that is the target's layer over the token embeddings (plus a little of the
    # target's features, and noise): it agrees with the target often enough to reach depth 3
    head = build_eagle(EagleConfig(layout="normed", init_layer=0), model)
    h = model.config.hidden_size
    with torch.no_grad():
        head.fc.bias.zero_()
        head.fc.weight[:, :h] = 0.3 * torch.randn(h, h, generator=torch.Generator().manual_seed(5))
        head.fc.weight[:, h:] = torch.eye(h)
    return EagleProposer(randomize(head, seed=3), DEEP_V, tree=tree, topk=2, total_tokens=10,
                         tree_draw=draw)


def _deep_exact(model, setting: dict) -> torch.Tensor:
    """(V**NEW,) exact warped distribution of DEEP_NEW new tokens (index = base-V number)."""
    rest = torch.tensor(list(itertools.product(range(DEEP_V), repeat=DEEP_NEW - 1)))
    seqs = torch.cat([torch.tensor(DEEP_PROMPT).expand(len(rest), -1), rest], 1)
    with torch.no_grad():
        p = warp(model(seqs).logits[:, len(DEEP_PROMPT) - 1:], **setting).double()
    joint = torch.ones(len(rest), dtype=torch.float64)
    for j in range(DEEP_NEW - 1):
        joint = joint * p[torch.arange(len(rest)), j, rest[:, j]]
    return (joint[:, None] * p[:, -1]).flatten().float()


def _deep_p_value(kind: str, setting: dict, corrupt: bool = False) -> float:
    from draftsmith.eval.decoding.decoder import SpeculativeDecoder

    model = _binary_llama(seed=1)
    proposer = _deep_proposer(kind, model)
    if corrupt:
        proposer = WrongQAtDepth3(proposer)
    dec = SpeculativeDecoder(model, proposer, k=DEEP_K, adaptive=False, fallback=False)
    g = torch.Generator().manual_seed(0)
    outs, deepest, reached_3 = [], 0, 0
    for _ in range(DEEP_SAMPLES):
        res = dec.generate(DEEP_PROMPT, max_new_tokens=DEEP_NEW, generator=g, **setting)
        assert len(res.output_ids) == DEEP_NEW
        outs.append(int("".join(map(str, res.output_ids)), DEEP_V))
        deepest = max(deepest, len(res.stats.reached))
        reached_3 += res.stats.reached[2] if len(res.stats.reached) > 2 else 0
    assert deepest == DEEP_K  # K = 3 was drafted, not capped
    assert reached_3 > DEEP_SAMPLES // 4  # and the third position was decided often
    return chi_square_p(torch.tensor(outs), _deep_exact(model, setting))


@pytest.mark.slow
@pytest.mark.parametrize("setting", DEEP_SETTINGS, ids=["T0.7", "T1.0"])
@pytest.mark.parametrize("kind", DEEP_KINDS + TOPK_TREES)
def test_deep_chains_and_trees_sample_exactly(kind, setting):
    assert _deep_p_value(kind, setting) > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("setting", DEEP_SETTINGS, ids=["T0.7", "T1.0"])
@pytest.mark.parametrize("kind", ["lm-chain", "eagle-chain"] + TOPK_TREES)
def test_twin_a_wrong_q_at_the_third_position_fails(kind, setting):
    """Twin: the same test with q misaligned at draft position 3 only. (Drawn trees are left
    out: over two ids both children of a node are drawn, the second one with certainty, so a
    misaligned q barely moves the outputs; their twins are the drawn-tree tests below.)"""
    p = _deep_p_value(kind, setting, corrupt=True)
    assert p < 1e-3, f"{kind} with a wrong q at position 3 passed the exactness test: p = {p:.3g}"


# ------------------------------------------------- the hybrid: a trained draft beside the suffix
# The inner proposal and the suffix chain merged into one tree every round (mode="merge"): the
# binary outputs repeat, so suffix matches exist every round and the suffix branch (tried after
# the inner root) is often accepted. Twin: the merge gives the suffix nodes the point mass of the
# wrong token id (their q rows shifted by one id); it must fail.
HYBRID_KINDS = ["lm-chain", "eagle-chain"]


def _hybrid_p_value(kind: str, setting: dict) -> float:
    from draftsmith.eval.decoding.decoder import SpeculativeDecoder
    from draftsmith.eval.decoding.proposers_suffix import SuffixProposer

    model = _binary_llama(seed=1)
    proposer = SuffixProposer(_deep_proposer(kind, model), DEEP_V, max_length=3, mode="merge")
    dec = SpeculativeDecoder(model, proposer, k=DEEP_K, adaptive=False, fallback=False)
    g = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(DEEP_SAMPLES):
        res = dec.generate(DEEP_PROMPT, max_new_tokens=DEEP_NEW, generator=g, **setting)
        outs.append(int("".join(map(str, res.output_ids)), DEEP_V))
    assert proposer.accepted["suffix"] > DEEP_SAMPLES // 8  # the suffix branch was taken often
    assert proposer.accepted["inner"] > DEEP_SAMPLES // 8
    return chi_square_p(torch.tensor(outs), _deep_exact(model, setting))


@pytest.mark.slow
@pytest.mark.parametrize("setting", DEEP_SETTINGS, ids=["T0.7", "T1.0"])
@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_hybrid_samples_exactly(kind, setting):
    assert _hybrid_p_value(kind, setting) > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle-chain"])
def test_twin_hybrid_with_misaligned_q_on_the_suffix_nodes_fails(kind, monkeypatch):
    """(Beside the draft LM's chain, a target plus a little noise, the suffix branch is taken
    after the draft's root was rejected, where the residual of two ids holds the other one
    alone: accepted whatever q says. The EAGLE stand-in leaves deeper suffix nodes to decide.)"""
    from draftsmith.eval.decoding.proposers_suffix import SuffixProposer

    monkeypatch.setattr(SuffixProposer, "_suffix_q", lambda self, chain, q: torch.nn.functional
                        .one_hot(torch.tensor(chain), q.shape[-1]).roll(1, -1).float())
    p = _hybrid_p_value(kind, DEEP_SETTINGS[1])
    assert p < 1e-3, f"{kind} + suffix with misaligned suffix q rows passed: p = {p:.3g}"


# ------------------------------------------------------ the dynamic tree's own draws (sampling)
# DynamicTree itself on the toy tables: children drawn without replacement from q (Gumbel-top-k),
# each verified with the q it was drawn from (the parent's q without the earlier siblings). Twins:
# every sibling verified with the parent's whole q, and siblings verified in score order instead
# of draw order; each must fail the same test. At 2,000 samples (seed 3) the exact tree gives
# p = 0.10 and the twins p = 1e-124 and 5e-19 (6,000: 0.26, 0.0 and 4e-57, at three times the time).
DRAWN_SAMPLES, DRAWN_TOPK, DRAWN_TOTAL = 2_000, 3, 5


def _row(table: torch.Tensor, seq: list[int]) -> torch.Tensor:
    """The toy's table row after the generated tokens ``seq``."""
    return table[ctx_id(torch.tensor([seq]), len(seq))][0]


def drawn_tree_outputs(toy: Toy, seed: int) -> torch.Tensor:
    """DRAWN_SAMPLES outputs of NEW tokens, each step a DynamicTree drawn from the toy's q."""
    from draftsmith.eval.decoding.proposal import Sampling
    from draftsmith.eval.decoding.tree import DynamicTree

    g = torch.Generator().manual_seed(seed)
    sampling = Sampling(temperature=1.0)  # the tables are warped already: warp(log q) = q
    outs = []
    for _ in range(DRAWN_SAMPLES):
        seq: list[int] = []
        while len(seq) < NEW:
            depth = NEW - len(seq) - 1

            if depth == 0:
                seq.append(int(_draw(_row(toy.p, seq).unsqueeze(0), g)))
                continue
            tree = DynamicTree(DRAWN_TOPK, sampling=sampling, generator=g)
            path_of = {-1: []}
            frontier = tree.add_children(-1, _row(toy.q, seq).log())
            for j in frontier:
                path_of[j] = [tree.tokens[j]]
            for _ in range(2, depth + 1):
                new = []
                for j in tree.expand(frontier):
                    for c in tree.add_children(j, _row(toy.q, seq + path_of[j]).log()):
                        path_of[c] = path_of[j] + [tree.tokens[c]]
                        new.append(c)
                frontier = new
            prop = tree.proposal(DRAWN_TOTAL)
            kept = tree.kept
            p = torch.stack([_row(toy.p, seq)] + [_row(toy.p, seq + path_of[j]) for j in kept])
            acc, nxt = verify_tree_batch(p.unsqueeze(0), prop.q.unsqueeze(0), prop.tokens,
                                         prop.parents, g)
            seq += prop.tokens[acc[0]].tolist() + [int(nxt[0])]
        out = seq[:NEW]
        outs.append((out[0] * V + out[1]) * V + out[2])
    return torch.tensor(outs)


@pytest.mark.slow
def test_drawn_dynamic_tree_samples_exactly():
    toy = Toy(**SETTINGS[1])
    assert chi_square_p(drawn_tree_outputs(toy, seed=3), toy.exact()) > 0.01


@pytest.mark.slow
def test_twin_drawn_siblings_verified_with_the_parents_whole_q_fails(monkeypatch):
    from draftsmith.eval.decoding.tree import DynamicTree

    def whole_q(self, kept):
        return torch.stack([self.q_of[self.parents[j]] for j in kept])

    monkeypatch.setattr(DynamicTree, "_q_rows", whole_q)
    toy = Toy(**SETTINGS[1])
    assert chi_square_p(drawn_tree_outputs(toy, seed=3), toy.exact()) < 0.01


@pytest.mark.slow
def test_twin_drawn_siblings_verified_in_score_order_fails(monkeypatch):
    from draftsmith.eval.decoding.tree import DynamicTree

    def score_order(self, j):
        return (self.depths[j], -self.scores[j], j)

    monkeypatch.setattr(DynamicTree, "_order", score_order)
    toy = Toy(**SETTINGS[1])
    assert chi_square_p(drawn_tree_outputs(toy, seed=3), toy.exact()) < 0.01


def test_a_drawn_tree_keeps_its_budget_draw_order_and_distinct_siblings():
    from draftsmith.eval.decoding.proposal import Sampling
    from draftsmith.eval.decoding.tree import DynamicTree

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, V, generator=g)
    for total in (1, 3, 5, 9):
        tree = DynamicTree(3, sampling=Sampling(temperature=1.0, top_p=0.9), generator=g)
        frontier, row = tree.add_children(-1, logits[0]), 1
        for _ in range(2):
            new = []
            for j in tree.expand(frontier):
                new += tree.add_children(j, logits[row])
                row += 1
            frontier = new
        prop = tree.proposal(total)
        kept = tree.kept
        assert 1 <= len(kept) <= total
        for i, j in enumerate(kept):
            par = tree.parents[j]
            sibs = tree.children[par]
            assert len({tree.tokens[s] for s in sibs}) == len(sibs)  # drawn without replacement
            assert par < 0 or par in kept
            assert all(s in kept for s in sibs[: sibs.index(j)])  # earlier siblings kept too
            q = prop.q[i]
            assert abs(float(q.sum()) - 1) < 1e-5 and float(q[tree.tokens[j]]) > 0
            assert all(float(q[tree.tokens[s]]) == 0 for s in sibs[: sibs.index(j)])
        assert len(tree.children[-1]) <= int((tree.q_of[-1] > 0).sum())  # no zero-q children


def test_a_greedy_tree_is_the_top_k_of_point_masses():
    from draftsmith.eval.decoding.proposal import Sampling
    from draftsmith.eval.decoding.tree import DynamicTree

    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    for sampling, draw in ((Sampling(temperature=0.0), "sample"),
                           (Sampling(temperature=1.0), "topk")):
        tree = DynamicTree(3, sampling=sampling, draw=draw)
        tree.add_children(-1, logits)
        prop = tree.proposal(3)
        assert prop.q is None
        assert prop.tokens.tolist() == torch.topk(logits, 3).indices.tolist()
