"""Acceptance math for speculative decoding, as pure tensor functions.

Names follow the papers: ``p`` is the target's next-token distribution and ``q`` the draft's,
both after the *same* warping (temperature, top-k, top-p) by :func:`warp`.

Lossless rules implemented here:

* **Chain** (:func:`verify_chain`): draft token ``x_i ~ q_i`` is accepted with probability
  ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the next token is drawn from the
  residual ``norm(max(p_i - q_i, 0))``; when all ``K`` drafts are accepted a bonus token is drawn
  from ``p_K``. The output is distributed exactly as sampling from ``p`` token by token.
* **Tree** (:func:`verify_tree`): recursive rejection sampling over the children of the current
  node. Each child ``c`` was drawn from a distribution ``q_c``; it is accepted with probability
  ``min(1, r(x_c) / q_c(x_c))`` where ``r`` is the current residual (initially the target's ``p``
  at the node); on rejection ``r <- norm(max(r - q_c, 0))`` and the next sibling is tried. When no
  child is accepted the next token is drawn from ``r``. Children chosen *deterministically*
  (top-k of a draft head, prompt lookup) are point masses: ``q_c = one_hot(x_c)``. Then the
  acceptance probability is ``r(x_c)`` and the residual is ``r`` with ``x_c`` removed, which is
  exactly lossless for any deterministic choice of candidates. Children sampled i.i.d. from one
  ``q`` (with replacement) pass that same ``q`` for every sibling; children drawn *without*
  replacement (the dynamic tree when sampling, ``eval.decoding.tree.DynamicTree``) pass, for sibling
  ``i``, ``q`` without siblings ``0..i-1``, renormalised, and are tried in draw order. Both are
  lossless: each sibling is one rejection-sampling step of the current residual with the
  distribution that sibling was actually drawn from.
* At temperature 0 the warped distributions are one-hot and both rules reduce to exact greedy
  matching (accept iff the draft equals the target's argmax; the next token is the argmax).
  :func:`verify_greedy` computes that directly from the target's argmax per row, without the
  ``(N+1, V)`` one-hot distributions or a per-node loop over vocabulary-sized tensors.

:func:`verify_tree_typical` is Medusa's typical acceptance. It is **lossy** (the output is not
distributed as the target's samples) and reports ``lossless=False``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

_EPS = 1e-12


def top1(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the index of each row's first maximum, as argmax gives it, taken by
    ``max``: torch's CPU argmax over bf16 rows is about 4x slower (17 x 49,152 bf16 logits:
    1.63 ms against 0.39 ms; one row of 151,936: 0.57 against 0.15 ms, 2 threads here)."""
    return logits.max(-1).indices


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0,
         top_p: float = 1.0) -> torch.Tensor:
    """Turn logits into the sampling distribution used by both target and draft.

    Order: temperature, then top-k, then top-p (nucleus: the smallest set of most likely tokens
    whose mass reaches ``top_p``; the most likely token is always kept).

    Args:
        logits: ``(..., V)`` raw logits.
        temperature: ``0`` means greedy (one-hot on the argmax); otherwise ``> 0``.
        top_k: keep the ``top_k`` most likely tokens; ``0`` disables.
        top_p: nucleus mass in ``(0, 1]``; ``1.0`` disables.

    Returns:
        ``(..., V)`` float32 probabilities summing to one over the last dim.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(top1(logits), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # (..., V) mass of better tokens
        drop_sorted = mass_before >= top_p  # the top token has mass_before 0, so it is kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _sample(dist: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row of ``dist (B, V)`` (unnormalised, non-negative) -> ``(B,)``."""
    return torch.multinomial(dist, 1, generator=generator).squeeze(-1)


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(r - q, 0))`` row-wise for ``(B, V)``; falls back to ``r`` where nothing is left.

    The fallback only triggers when ``r <= q`` everywhere, i.e. ``r == q``; then the rejection
    that led here had probability zero and any choice is exact.
    """
    res = (r - q).clamp_min(0.0)
    total = res.sum(-1, keepdim=True)
    empty = total <= _EPS
    return torch.where(empty, r, res / total.clamp_min(_EPS))


def _accept(r_x: torch.Tensor, q_x: torch.Tensor,
            generator: torch.Generator | None) -> torch.Tensor:
    """Accept with probability ``min(1, r_x / q_x)`` elementwise: ``u * q_x < r_x`` with
    ``u ~ U[0,1)``."""
    u = torch.rand(r_x.shape, generator=generator, device=r_x.device)
    return u * q_x < r_x


def verify_chain_batch(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                       generator: torch.Generator | None = None,
                       lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless chain verification for a batch of independent chains.

    Args:
        p: ``(B, K+1, V)`` target distributions; row ``i`` is the distribution of draft position
            ``i``, row ``K`` the bonus distribution after all drafts.
        q: ``(B, K, V)`` draft distributions the drafts were sampled from.
        draft: ``(B, K)`` draft token ids.
        generator: random generator (used even at temperature 0, where results are deterministic).
        lengths: ``(B,)`` drafts per chain (default ``K`` for all): chain ``b`` is
            ``draft[b, :lengths[b]]``, its bonus distribution ``p[b, lengths[b]]``, and what
            follows is padding (never accepted).

    Returns:
        ``n_accepted (B,)`` long and ``next_token (B,)`` long (residual sample or bonus token).
    """
    b, k1, v = p.shape
    k = k1 - 1
    if q.shape != (b, k, v) or draft.shape != (b, k):
        raise ValueError(f"shape mismatch: p {tuple(p.shape)} needs q (B, K, V)={(b, k, v)} "
                         f"and draft (B, K)={(b, k)}, got q {tuple(q.shape)}, "
                         f"draft {tuple(draft.shape)}")
    p = p.float()
    q = q.float()
    idx = draft.long().unsqueeze(-1)  # (B, K, 1)
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)  # (B, K)
    q_x = q.gather(-1, idx).squeeze(-1)  # (B, K)
    accepted = _accept(p_x, q_x, generator)  # (B, K)
    if lengths is not None:  # padding is rejected, and q = 0 there: the bonus row is p itself
        real = torch.arange(k, device=p.device) < lengths.to(p.device).unsqueeze(-1)  # (B, K)
        accepted &= real
        q = q * real.unsqueeze(-1)
    n = accepted.long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
    q_ext = torch.cat([q, q.new_zeros(b, 1, v)], dim=1)  # (B, K+1, V); q = 0 at the bonus row
    rows = torch.arange(b, device=p.device)
    dist = _residual(p[rows, n], q_ext[rows, n])  # (B, V): residual, or p_K when all accepted
    return n, _sample(dist, generator)


class Verified(NamedTuple):
    """What one verification keeps: the accepted draft nodes from the root down (a chain's
    first ``len(path)`` drafts), then the token the target adds after them."""

    path: list[int]
    next_token: int


def verify_chain(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                 generator: torch.Generator | None = None) -> Verified:
    """Lossless verification of one draft chain.

    Args:
        p: ``(K+1, V)`` target distributions (after :func:`warp`).
        q: ``(K, V)`` draft distributions the drafts were sampled from (after the same warp).
        draft: ``(K,)`` draft token ids.
        generator: random generator.

    Returns:
        :class:`Verified`: the first ``len(path)`` drafts are kept, then ``next_token``.
    """
    n, nxt = verify_chain_batch(p.unsqueeze(0), q.unsqueeze(0), draft.unsqueeze(0), generator)
    return Verified(list(range(int(n[0]))), int(nxt[0]))


def _check_tree(parents: torch.Tensor, n: int) -> None:
    if parents.shape != (n,):
        raise ValueError(f"parents must have shape (N,)={(n,)}, got {tuple(parents.shape)}")
    idx = torch.arange(n, device=parents.device)
    if bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError("tree nodes must be in topological order: -1 <= parents[j] < j for every "
                         "node j")


def verify_tree_batch(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor,
                      parents: torch.Tensor, generator: torch.Generator | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate verification of token trees, for a batch of independent draws.

    All draws share the tree *shape* (``parents``); tokens may differ per draw. Nodes are visited
    in index order. A node is tried when its parent is the current node of that draw; siblings are
    therefore tried in increasing index order, and a node's children (larger indices) are reached
    only after it was accepted. This equals the recursive algorithm.

    Args:
        p: ``(B, N+1, V)`` target distributions: row 0 at the root (the last committed token),
            row ``j+1`` after tree node ``j``.
        q: ``(B, N, V)`` the distribution node ``j`` was drawn from, or ``None`` when every node
            is a deterministic choice (point mass on its token).
        tokens: ``(N,)`` node token ids shared by the batch, or ``(B, N)`` per draw.
        parents: ``(N,)`` parent node index, ``-1`` for children of the root; ``parents[j] < j``.
        generator: random generator.

    Returns:
        ``accepted (B, N)`` bool mask of accepted nodes (a root path) and ``next_token (B,)``.
    """
    b, n1, v = p.shape
    n = n1 - 1
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0).expand(b, -1)
    if tokens.shape != (b, n):
        raise ValueError(f"tokens must have shape (N,)={(n,)} or (B, N)={(b, n)} to match p "
                         f"(B, N+1, V), got {tuple(tokens.shape)}")
    if q is not None and q.shape != (b, n, v):
        raise ValueError(f"q must have shape (B, N, V)={(b, n, v)} or be None, "
                         f"got {tuple(q.shape)}")
    _check_tree(parents, n)
    p = p.float()
    tokens = tokens.long().to(p.device)
    cur = torch.full((b,), -1, dtype=torch.long, device=p.device)  # current node per draw
    r = p[:, 0].clone()  # (B, V) current residual at the current node
    accepted = torch.zeros(b, n, dtype=torch.bool, device=p.device)
    u = torch.rand(b, n, generator=generator, device=p.device)  # one uniform per node and draw
    for j in range(n):
        active = cur == int(parents[j])  # (B,)
        if not bool(active.any()):
            continue
        x = tokens[:, j : j + 1]  # (B, 1)
        if q is None:
            q_j = torch.zeros(b, v, device=p.device).scatter_(-1, x, 1.0)
        else:
            q_j = q[:, j].float()
        r_x = r.gather(-1, x).squeeze(-1)  # (B,)
        q_x = q_j.gather(-1, x).squeeze(-1)  # (B,)
        ok = active & (u[:, j] * q_x < r_x)  # accept w.p. min(1, r(x) / q(x))
        rej = active & ~ok
        accepted[:, j] = ok
        cur = torch.where(ok, torch.full_like(cur, j), cur)
        r = torch.where(ok.unsqueeze(-1), p[:, j + 1], r)
        r = torch.where(rej.unsqueeze(-1), _residual(r, q_j), r)
    return accepted, _sample(r, generator)


def verify_tree(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor,
                parents: torch.Tensor, generator: torch.Generator | None = None
                ) -> Verified:
    """Lossless verification of one token tree (see :func:`verify_tree_batch`).

    Args:
        p: ``(N+1, V)`` target distributions (row 0 at the root, row ``j+1`` after node ``j``).
        q: ``(N, V)`` draft distributions per node, or ``None`` for deterministic (point-mass)
            nodes.
        tokens: ``(N,)`` node token ids.
        parents: ``(N,)`` parent indices (``-1`` = root), topologically ordered.
        generator: random generator.

    Returns:
        :class:`Verified`: accepted node indices from the root downwards, then the next token.
    """
    acc, nxt = verify_tree_batch(p.unsqueeze(0), None if q is None else q.unsqueeze(0),
                                 tokens, parents, generator)
    return Verified(torch.nonzero(acc[0]).flatten().tolist(), int(nxt[0]))


def verify_greedy(target_argmax: torch.Tensor, tokens: torch.Tensor,
                  parents: torch.Tensor | None = None) -> Verified:
    """Temperature-0 verification of a chain or a tree from the target's argmax per row.

    Exactly what :func:`verify_chain` / :func:`verify_tree` return for one-hot (greedy)
    distributions: walking the nodes in index order, a node is accepted when its parent is the
    current node and its token is the target's argmax after that parent; the next token is the
    argmax after the last accepted node.

    Args:
        target_argmax: ``(N+1,)`` target argmax per row (row 0 at the root, row ``j+1`` after
            node ``j``).
        tokens: ``(N,)`` node token ids.
        parents: ``(N,)`` parent indices (``-1`` = root), topologically ordered; ``None`` = a chain.

    Returns:
        :class:`Verified`: accepted node indices from the root downwards, then the next token.
    """
    n = tokens.shape[0]
    if target_argmax.shape != (n + 1,):
        raise ValueError(f"target_argmax must have shape (N+1,)={(n + 1,)} for {n} nodes, got "
                         f"{tuple(target_argmax.shape)}")
    if parents is None:
        parents = torch.arange(-1, n - 1)
    _check_tree(parents, n)
    best, toks, par = target_argmax.tolist(), tokens.tolist(), parents.tolist()
    path: list[int] = []
    cur = -1
    for j in range(n):
        if par[j] == cur and toks[j] == best[cur + 1]:
            path.append(j)
            cur = j
    return Verified(path, int(best[cur + 1]))


def verify_tree_typical(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                        generator: torch.Generator | None = None) -> Verified:
    """Medusa's typical acceptance over a tree. **Lossy**: outputs are not target samples.

    A node is acceptable when its parent is acceptable (or is the root) and
    ``p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))`` with ``H`` the entropy of the
    target distribution at its parent. The deepest acceptable node (lowest index on ties) wins; the
    next token is sampled from ``p`` after it (argmax when ``p`` is one-hot).

    Args:
        p: ``(N+1, V)`` target distributions (after temperature warping).
        tokens: ``(N,)`` node token ids.
        parents: ``(N,)`` parent indices (``-1`` = root), topologically ordered.
        posterior_threshold: hard acceptance threshold.
        posterior_alpha: entropy-scaled threshold factor.
        generator: random generator for the next token.

    Returns:
        :class:`Verified` (not a sample of the target: the mode is lossy).
    """
    n = tokens.shape[0]
    _check_tree(parents, n)
    p = p.float()
    entropy = -(p * p.clamp_min(_EPS).log()).sum(-1)  # (N+1,)
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold),
                              posterior_alpha * torch.exp(-entropy))  # (N+1,)
    ok = [False] * n
    depth = [0] * n
    best, best_depth = -1, 0
    for j in range(n):
        par = int(parents[j])
        row = par + 1
        if par >= 0 and not ok[par]:
            continue
        ok[j] = bool(p[row, int(tokens[j])] > threshold[row])
        depth[j] = 1 if par < 0 else depth[par] + 1
        if ok[j] and depth[j] > best_depth:
            best, best_depth = j, depth[j]
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    path.reverse()
    nxt = int(_sample(p[best + 1].unsqueeze(0), generator)[0])
    return Verified(path, nxt)
