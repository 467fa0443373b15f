"""The EAGLE-2 dynamic draft tree, shared by the EAGLE head and the draft LM
(:mod:`eval.decoding.proposers`, :mod:`eval.decoding.proposers_eagle`): its bookkeeping and its
drafting loop (:meth:`DynamicTree.grow`); the drafter's forward stays with them."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from draftsmith.eval.decoding.proposal import Proposal, Sampling

# ----- the EAGLE-2 dynamic draft tree (used by the EAGLE head and the draft LM) ---------------
# Drafting a tree of depth D: the root's k candidate tokens are depth-1 nodes; at each further
# depth the k frontier nodes with the highest cumulative draft log-probability are fed to the
# drafter in one forward (a tree attention mask over its cache: the committed prefix, fed ancestors
# and the node itself) and each gets k children. Finally the total_tokens best nodes of all depths
# are kept, each with what it needs (see below). DynamicTree is only the bookkeeping; the
# drafter's forward stays with the proposer.
#
# How a node's k children are chosen decides what verification needs to stay lossless:
# * greedy decoding, or ``draw="topk"``: the draft's top-k tokens, deterministic choices, so each
#   node is a point mass (``Proposal.q`` None) and is accepted with the residual's mass on it;
# * sampling with ``draw="sample"``: k tokens drawn *without replacement* from the warped draft
#   distribution q (Gumbel-top-k: the top k of log q + Gumbel noise, in that order, are sequential
#   draws). Sibling i was drawn from q with siblings 0..i-1 removed and renormalised, and that is
#   the q it is verified with (recursive rejection sampling, eval/decoding/verify.py). A calibrated
#   draft then has its first child accepted with probability sum(min(p, q)) instead of p(top-1): at
#   T = 1 that is most of the gain. Siblings must be verified in draw order and a kept sibling's
#   earlier siblings are kept too (dropping one would change the later ones' q).
TREE_DRAWS = ("topk", "sample")


def check_tree_draw(value: object) -> str:
    """``tree_draw`` as given, or a ValueError naming the allowed values."""
    if value not in TREE_DRAWS:
        raise ValueError(f"tree_draw={value!r}: allowed {', '.join(TREE_DRAWS)} (how a sampled "
                         "decode's dynamic tree picks children)")
    return str(value)


class DynamicTree:
    """EAGLE-2 dynamic tree bookkeeping: nodes drafted so far, their scores, and the order in
    which they were fed to the drafter's cache.

    Args:
        topk: children per expanded node, and nodes expanded per depth.
        to_target: maps drafter token ids to target ids (reduced vocabularies); identity if None.
        sampling: the decode's sampling settings; children are drawn from the warped draft
            distribution when it is not greedy and ``draw`` is ``"sample"``.
        generator: random generator of the draws.
        scatter_q: maps drafter-vocabulary probabilities ``(n, Vd)`` to the target's ``(n, V)``.
        draw: ``"sample"`` (draws without replacement when sampling) or ``"topk"`` (always the
            top-k: point masses).
    """

    def __init__(self, topk: int,
                 to_target: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 sampling: Sampling | None = None, generator: torch.Generator | None = None,
                 scatter_q: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 draw: str = "sample") -> None:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        check_tree_draw(draw)
        self.topk = topk
        self.to_target = to_target
        self.sampling, self.generator = sampling, generator
        self.scatter_q = scatter_q
        self.sampled = draw == "sample" and sampling is not None and not sampling.greedy
        self.tokens: list[int] = []   # target ids
        self.draft_ids: list[int] = []  # drafter ids
        self.scores: list[float] = []  # cumulative draft log-prob
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.fed: list[int] = []  # nodes fed to the drafter, in its cache order
        self.fed_row: dict[int, int] = {}  # node -> its index in ``fed``
        self.fed_anc = torch.zeros(0, 0, dtype=torch.bool)  # (F, F) fed ancestor-or-self
        self.children: dict[int, list[int]] = {}  # parent -> children in draw order
        self.q_of: dict[int, torch.Tensor] = {}  # sampled: parent -> warped draft q (Vd,)
        self.kept: list[int] = []  # the last proposal's nodes, in its order

    def _draw(self, parent: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled decodes: the children's drafter ids (in draw order) and their log-probs."""
        q = self.sampling.warp(logits)  # (Vd,) float32
        self.q_of[parent] = q
        n = min(self.topk, int((q > 0).sum()))
        gen = self.generator
        u = torch.rand(q.shape, generator=gen, device=gen.device if gen is not None
                       else q.device).to(q.device).clamp_min(1e-30)
        logq = q.log()
        picks = torch.topk(logq - (-u.log()).log(), n).indices  # Gumbel-top-k, in draw order
        return picks, logq[picks]

    def add_children(self, parent: int, logits: torch.Tensor) -> list[int]:
        """Add ``topk`` children of ``parent`` (``-1`` = the committed sequence) from the
        drafter's raw ``logits (Vd,)`` after it; returns their node indices."""
        return self.add_children_batch([parent], logits.unsqueeze(0))

    def add_children_batch(self, parents: Sequence[int], logits: torch.Tensor) -> list[int]:
        """Add ``topk`` children to each of ``parents`` from the drafter's raw ``logits (n, Vd)``
        (row ``i`` after ``parents[i]``): one log-softmax and one top-k for all rows when the
        children are the top-k, one host transfer; returns the new nodes, parent by parent."""
        if self.sampled:
            drawn = [self._draw(par, row) for par, row in zip(parents, logits)]
            picks = [d[0] for d in drawn]
            ids = [p if self.to_target is None else self.to_target(p) for p in picks]
            rows = [(lp.tolist(), pk.tolist(), tid.tolist())
                    for (_, lp), pk, tid in zip(drawn, picks, ids)]
        else:
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1),
                             min(self.topk, logits.shape[-1]), dim=-1)  # (n, k)
            ids = top.indices if self.to_target is None else self.to_target(top.indices)
            rows = list(zip(top.values.tolist(), top.indices.tolist(), ids.tolist()))
        new: list[int] = []
        for parent, (logp, picks_d, picks_t) in zip(parents, rows):
            base = self.scores[parent] if parent >= 0 else 0.0
            depth = self.depths[parent] + 1 if parent >= 0 else 1
            first = len(self.tokens)
            self.tokens.extend(int(t) for t in picks_t)
            self.draft_ids.extend(int(d) for d in picks_d)
            self.scores.extend(base + lp for lp in logp)
            self.parents.extend([parent] * len(logp))
            self.depths.extend([depth] * len(logp))
            self.children[parent] = list(range(first, len(self.tokens)))
            new.extend(self.children[parent])
        return new

    def grow(self, root_logits: torch.Tensor, depth: int, n_cached: int,
             forward: Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Draft the tree ``depth`` deep: the root's children from ``root_logits (Vd,)``, then
        per further depth the best frontier nodes fed to the drafter in one forward,
        ``forward(nodes, mask, pos) -> (len(nodes), Vd)`` logits after each (``mask`` and
        ``pos`` from :meth:`feed`, the drafter holding ``n_cached`` committed entries)."""
        frontier = self.add_children(-1, root_logits)
        for _ in range(2, depth + 1):
            expand = self.expand(frontier)
            mask, pos = self.feed(expand, n_cached)
            frontier = self.add_children_batch(expand, forward(expand, mask, pos))

    def expand(self, frontier: list[int]) -> list[int]:
        """The ``k`` frontier nodes with the best cumulative score (to feed next)."""
        return sorted(frontier, key=lambda j: -self.scores[j])[: self.topk]

    def feed(self, nodes: list[int], n_cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``nodes`` as fed after the drafter's ``n_cached`` committed entries and the nodes
        fed before; returns their attention mask ``(n, n_cached + fed)`` (bool: the committed
        prefix, fed ancestors, self) and position ids ``(n,)`` (``n_cached + depth - 1``).
        A fed node's parent was fed before it (only fed nodes get children), so a row is its
        parent's row of the fed-ancestry matrix plus itself."""
        f0, m = len(self.fed), len(nodes)
        par = torch.tensor([self.fed_row.get(self.parents[j], -1) for j in nodes],
                           dtype=torch.long)
        rows = torch.zeros(m, f0 + m, dtype=torch.bool)
        has = par >= 0
        if bool(has.any()):
            rows[has, :f0] = self.fed_anc[par[has]]
        rows[:, f0:] = torch.eye(m, dtype=torch.bool)
        anc = torch.zeros(f0 + m, f0 + m, dtype=torch.bool)
        anc[:f0, :f0] = self.fed_anc
        anc[f0:] = rows
        self.fed_anc = anc
        for i, j in enumerate(nodes):
            self.fed_row[j] = f0 + i
        self.fed.extend(nodes)
        mask = torch.cat([torch.ones(m, n_cached, dtype=torch.bool), rows], dim=1)
        pos = torch.tensor([n_cached + self.depths[j] - 1 for j in nodes], dtype=torch.long)
        return mask, pos

    def _needed(self, j: int) -> list[int]:
        """What keeping node ``j`` requires: its ancestors and, for drawn nodes, the siblings
        drawn before it (and theirs)."""
        need, node = [], j
        while node >= 0:
            if self.sampled:
                sibs = self.children[self.parents[node]]
                need += sibs[: sibs.index(node)]
            node = self.parents[node]
            if node >= 0:
                need.append(node)
        return need

    def proposal(self, total: int, max_depth: int | None = None) -> Proposal:
        """At most ``total`` nodes: the best first (ties: shallower first), each with what it
        requires (:meth:`_needed`) where that still fits, in the order of :meth:`_order` (kept in
        ``self.kept``). Top-k trees need nothing extra (a node scores below its ancestors).
        ``max_depth``: only nodes that deep or shallower (the proposal a tree drafted to that
        depth makes: deeper nodes change nothing above them)."""
        order = sorted((j for j in range(len(self.tokens))
                        if max_depth is None or self.depths[j] <= max_depth),
                       key=lambda j: (-self.scores[j], self.depths[j], j))
        keep: set[int] = set()
        for j in order:  # best first, each with what it needs, while the budget holds
            if len(keep) >= total:
                break
            add = {j, *self._needed(j)} - keep
            if len(keep) + len(add) <= total:
                keep |= add
        kept = sorted(keep, key=self._order)
        self.kept = kept
        new_index = {j: i for i, j in enumerate(kept)}
        return Proposal(
            torch.tensor([self.tokens[j] for j in kept], dtype=torch.long),
            torch.tensor([new_index[self.parents[j]] if self.parents[j] >= 0 else -1 for j in kept],
                         dtype=torch.long),
            self._q_rows(kept) if self.sampled else None)

    def _order(self, j: int) -> tuple:
        """Sort key of a kept node: its depth (parents first), then its score; drawn nodes
        then in draw order, which verification follows (siblings are tried in index order)."""
        return (self.depths[j], j) if self.sampled else (self.depths[j], -self.scores[j], j)

    def _q_rows(self, kept: list[int]) -> torch.Tensor:
        """``(n, V)``: the distribution each kept node was drawn from, its parent's q without
        the siblings drawn before it, renormalised."""
        rows = []
        for j in kept:
            par = self.parents[j]
            q = self.q_of[par].clone()
            sibs = self.children[par]
            q[[self.draft_ids[s] for s in sibs[: sibs.index(j)]]] = 0.0
            rows.append(q / q.sum())
        q = torch.stack(rows)
        return q if self.scatter_q is None else self.scatter_q(q)
