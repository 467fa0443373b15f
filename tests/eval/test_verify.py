"""Pure verification functions with hand-set distributions: always / never / partial accept,
greedy matching, residual sampling, warping and bad input."""
from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoding.verify import (
    top1,
    verify_chain,
    verify_chain_batch,
    verify_greedy,
    verify_tree,
    verify_tree_batch,
    verify_tree_typical,
    warp,
)

V = 6


def onehot(*ids: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def dist(*rows: list[float]) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- warp
def test_warp_greedy_is_argmax_one_hot():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9, 0.0, 0.0]])
    assert torch.equal(warp(logits, 0.0), onehot(1))


def test_warp_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0 + 1e-9, 1e-9]))
    torch.testing.assert_close(warp(logits, 1.0)[:4], torch.tensor([0.5, 0.3, 0.15, 0.05]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(warp(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0, 0, 0]))
    # nucleus 0.8: tokens before the third hold 0.8 already -> keep two
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.8),
                               torch.tensor([0.625, 0.375, 0, 0, 0, 0]))
    kept3 = warp(logits, 1.0, top_p=0.81)
    assert (kept3 > 0).sum() == 3
    # the top token survives any nucleus
    assert torch.equal(warp(logits, 1.0, top_p=0.01), onehot(0)[0])
    hot = warp(logits, 0.5)
    assert hot[0] > 0.5 and torch.isclose(hot.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("kw, msg", [({"temperature": -1.0}, "temperature"),
                                     ({"temperature": 1.0, "top_k": -2}, "top_k"),
                                     ({"temperature": 1.0, "top_p": 1.5}, "top_p")])
def test_warp_rejects_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        warp(torch.zeros(V), **kw)


# ----------------------------------------------------------------------------- chain
def test_chain_always_accept_then_bonus():
    q = dist([1, 2, 3, 0, 0, 0], [0, 0, 1, 1, 1, 1])
    p = torch.cat([q, onehot(5)])  # p == q at drafted positions; bonus is certain
    for seed in range(20):
        assert verify_chain(p, q, torch.tensor([2, 4]), gen(seed)) == ([0, 1], 5)


def test_chain_never_accept_samples_residual():
    q = onehot(1, 2, 3)
    p = dist([0, 0, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1])
    for seed in range(20):
        path, nxt = verify_chain(p, q, torch.tensor([1, 2, 3]), gen(seed))
        n = len(path)
        assert n == 0 and nxt in (2, 5)


def test_chain_partial_accept():
    q = onehot(1, 2, 3)
    # positions 0, 1 put mass 1 on the draft; position 2 gives the draft probability 0
    p = torch.cat([onehot(1, 2), dist([0, 0, 0, 0, 1, 0]), onehot(0)])
    for seed in range(20):
        assert verify_chain(p, q, torch.tensor([1, 2, 3]), gen(seed)) == ([0, 1], 4)


def test_chain_greedy_matches_target_argmax():
    target_logits = torch.randn(5, V, generator=gen(1))
    draft = target_logits[:4].argmax(-1).clone()
    draft[2] = (draft[2] + 1) % V  # first mismatch at position 2
    p = warp(target_logits, 0.0)
    q = onehot(*draft.tolist())
    path, nxt = verify_chain(p, q, draft, gen(0))
    n = len(path)
    assert (n, nxt) == (2, int(target_logits[2].argmax()))


def test_chain_acceptance_probability_and_residual():
    # p(x)=0.2, q(x)=0.6 -> accept w.p. 1/3; residual = norm(max(p - q, 0)) on the other tokens
    p0 = torch.tensor([0.2, 0.5, 0.3, 0, 0, 0])
    q0 = torch.tensor([0.6, 0.1, 0.3, 0, 0, 0])
    b = 30000
    p = torch.stack([p0, onehot(4)[0]]).expand(b, 2, V)
    q = q0.expand(b, 1, V)
    n, nxt = verify_chain_batch(p, q, torch.zeros(b, 1, dtype=torch.long), gen(3))
    rate = n.float().mean().item()
    assert abs(rate - 1 / 3) < 4 * (1 / 3 * 2 / 3 / b) ** 0.5
    assert torch.all(nxt[n == 1] == 4)
    assert set(nxt[n == 0].tolist()) == {1}  # residual: max(p-q,0) = [0, .4, 0, ...]


def test_chain_shape_errors():
    with pytest.raises(ValueError, match="shape mismatch"):
        verify_chain(torch.ones(3, V) / V, torch.ones(3, V) / V, torch.tensor([0, 1]))


# ----------------------------------------------------------------------------- tree
TREE_PARENTS = torch.tensor([-1, -1, 0, 0, 1])  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}


def test_tree_always_accept_deep_path():
    tokens = torch.tensor([1, 2, 3, 4, 5])
    # target certain of 2 at the root, then of 5 after node 1, then bonus 0
    u = torch.full((1, V), 1 / V)
    p = torch.cat([onehot(2), u, onehot(5), u, u, onehot(0)])
    for seed in range(10):
        path, nxt = verify_tree(p, None, tokens, TREE_PARENTS, gen(seed))
        assert (path, nxt) == ([1, 4], 0)


def test_tree_never_accept_samples_residual_without_tried_tokens():
    tokens = torch.tensor([1, 2, 3, 4, 5])
    p = torch.cat([dist([0, 1, 1, 1, 0, 0]), torch.full((5, V), 1 / V)])
    for seed in range(50):
        path, nxt = verify_tree(p, None, tokens, TREE_PARENTS, gen(seed))
        if not path:  # point-mass rejections remove tokens 1 and 2 from the residual
            assert nxt == 3
    # with p(1) = p(2) = 0 nothing is ever accepted
    p[0] = onehot(3)[0]
    assert verify_tree(p, None, tokens, TREE_PARENTS, gen(0)) == ([], 3)


def test_tree_partial_accept_second_sibling():
    tokens = torch.tensor([1, 2, 3, 4, 5])
    p = torch.cat([onehot(2), torch.full((5, V), 1 / V)])
    p[2] = onehot(0)[0]  # after node 1 the target wants 0, but node 4 drafted 5
    assert verify_tree(p, None, tokens, TREE_PARENTS, gen(0)) == ([1], 0)


def test_tree_point_mass_sibling_frequencies():
    # root p = {a: .5, b: .3, c: .2}; children a, b as point masses
    b = 40000
    p_root = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0])
    p = torch.cat([p_root[None], onehot(4), onehot(5)]).expand(b, 3, V)
    acc, nxt = verify_tree_batch(p, None, torch.tensor([0, 1]), torch.tensor([-1, -1]), gen(5))
    freq = torch.stack([acc[:, 0], acc[:, 1], ~acc.any(-1)]).float().mean(-1)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.012, rtol=0)
    assert torch.all(nxt[~acc.any(-1)] == 2)


def test_tree_greedy_equals_chain_greedy_on_a_chain():
    logits = torch.randn(4, V, generator=gen(2))
    draft = logits[:3].argmax(-1)
    draft[1] = (draft[1] + 3) % V
    p = warp(logits, 0.0)
    path, nxt = verify_tree(p, None, draft, torch.tensor([-1, 0, 1]))
    chain_path, nxt_chain = verify_chain(p, onehot(*draft.tolist()), draft)
    n = len(chain_path)
    assert (len(path), nxt) == (n, nxt_chain) == (1, int(logits[1].argmax()))


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """Parents of a random topologically ordered tree of ``n`` nodes."""
    return torch.tensor([int(torch.randint(-1, j, (1,), generator=g)) for j in range(n)])


def test_greedy_fast_path_equals_one_hot_rules_on_random_trees():
    # the fast path must return exactly what the general rules return for one-hot distributions;
    # tokens copy the target's argmax after their parent half of the time, so deep paths occur
    g = gen(5)
    depths = []
    for _ in range(300):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = random_tree(n, g)
        logits = torch.randn(n + 1, V, generator=g)
        best = logits.argmax(-1)
        tokens = torch.randint(0, V, (n,), generator=g)
        copy = torch.rand(n, generator=g) < 0.5
        tokens = torch.where(copy, best[parents + 1], tokens)
        expected = verify_tree(warp(logits, 0.0), None, tokens, parents, gen(0))
        assert verify_greedy(best, tokens, parents) == expected
        chain = torch.where(torch.rand(n, generator=g) < 0.6, best[:n], tokens)
        assert verify_greedy(best, chain) == verify_chain(warp(logits, 0.0),
                                                         onehot(*chain.tolist()), chain, gen(0))
        depths.append(len(expected[0]))
    assert max(depths) >= 3 and min(depths) == 0  # the cases did reach deep and empty paths


def test_greedy_fast_path_checks_shapes():
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="topological"):
        verify_greedy(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                      torch.tensor([1, -1]))


def test_tree_rejects_non_topological_order():
    with pytest.raises(ValueError, match="topological"):
        verify_tree(torch.ones(3, V) / V, None, torch.tensor([0, 1]), torch.tensor([1, -1]))


def test_typical_acceptance_is_marked_lossy():
    tokens = torch.tensor([1, 2, 3, 4, 5])
    p = torch.cat([dist([0, 1, 9, 0, 0, 0]), torch.full((5, V), 1 / V)])
    p[1] = onehot(0)[0]  # children of node 0 (tokens 3, 4) are implausible
    p[2] = onehot(5)[0]
    res = verify_tree_typical(p, tokens, TREE_PARENTS, generator=gen(0))
    assert res.path == [1, 4] and res.next_token in range(V)


def test_chain_batch_lengths_cut_each_chain_and_take_its_bonus_row():
    # q = p: every real draft is accepted; padding never is, and the next token comes from the
    # bonus row p[b, lengths[b]] (one-hot here, so it is known)
    b, k, v = 3, 4, 6
    p = torch.softmax(torch.randn(b, k + 1, v, generator=torch.Generator().manual_seed(0)), -1)
    bonus = torch.tensor([5, 2, 4])
    lengths = torch.tensor([0, 2, 4])
    for i in range(b):
        p[i, lengths[i]] = torch.nn.functional.one_hot(bonus[i], v).float()
    draft = p[:, :k].argmax(-1)
    q = p[:, :k].clone()
    n, nxt = verify_chain_batch(p, q, draft, torch.Generator().manual_seed(1), lengths=lengths)
    assert n.tolist() == [0, 2, 4] and nxt.tolist() == bonus.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_top1_is_argmax_ties_included(dtype):
    # top1 takes max's index for speed; it must pick argmax's token, the first maximum, also
    # where a row's maximum repeats (frequent in 16-bit logits: these rows are built with ties)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 997, generator=g) * 2).round().to(dtype)
    tied = (logits == logits.max(-1, keepdim=True).values).sum(-1) > 1
    assert int(tied.sum()) > 32  # the case that tells a first from a last maximum
    assert torch.equal(top1(logits), logits.argmax(-1))
    assert int(top1(logits[5])) == int(logits[5].argmax())
    last = logits.shape[-1] - 1 - logits.flip(-1).argmax(-1)  # the last maximum differs
    assert not torch.equal(last, logits.argmax(-1))
