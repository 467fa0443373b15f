"""Suffix chains in batches: the drafts of a :class:`~eval.decoding.proposers_suffix.
SuffixProposer` for every row of a :class:`~eval.decoding.batch.BatchDecoder`, alone
(``draft=suffix``) or beside the batched drafter of a trained draft (the hybrid: an EAGLE head or
a draft LM, :mod:`eval.decoding.batch_drafters`).

Each row keeps a :class:`~eval.decoding.proposers_suffix.SuffixIndex` over its prompt and
committed tokens, extended at each commit, and its own
:class:`~eval.decoding.proposers_suffix.AcceptRates` (the suffix chain's acceptance per draft,
per bucket of match length, Beta prior; the inner's accepted drafts per round, prior one; both
measured on the row's own verified rounds). Each round, row ``b`` (``ks[b]`` from its K
controller; 0: fallen back, no draft) drafts one of

* its suffix chain: what followed the latest earlier occurrence of its longest suffix match, up
  to the proposer's ``max_length`` and the tokens the row may still add (as batch one), none
  where the match is shorter than ``min_match``;
* the inner drafter's chain of ``ks[b]`` (an EAGLE head or a draft LM);
* nothing (a plain step).

The rows share one verification, as wide as the longest chain, and one inner proposal, so the
choice is the batch's (:meth:`BatchSuffix._choose`): a cap on the suffix chains (0: none), and
whether the rows whose rates expect more from the inner's chain than from their capped suffix
chain take it, whichever gives the most expected tokens of all rows per second, from the
verification's measured cost against the block's width (a line through recent rounds, as batch
one fits it) and the inner's measured seconds per step. The inner does not run in a round of
suffix chains alone.

The decoder's block holds each row's real drafts (the lengths :meth:`BatchSuffix.propose_chains`
returns), padding after them, and each row's K controller records what it really drafted.

Losslessness: a suffix token is a deterministic proposal, a point mass (``q`` one-hot at the
drafted id), so each row's rejection sampling stays exact at any temperature; rows that drafted
the inner chain keep the inner drafter's ``q``. Greedy rows match the target's argmax as always.
(``tests/eval/test_batch_suffix.py``: greedy rows equal batch-one decoding; a chi-square test of
sampled rows, with a twin whose suffix rows get a wrong ``q`` and fails.)

The inner drafter's state (:meth:`BatchSuffix.commit`): its cache must hold each row's committed
tokens only. The draft LM (``BatchDraftLM.commit``) keeps the drafted slots of accepted drafts on
the rows whose verified chain was its own (``own``); a suffix row keeps none of them (they hold
the draft LM's tokens, not the suffix tokens) and feeds its accepted suffix tokens at the next
proposal, as committed tokens. The EAGLE head (``BatchEagle.commit``) drops every drafted slot
and is given each row's verified tokens with the target's features of them.

Chains only: batched trees draft the inner's tree alone (``eval/decode.py`` wraps a tree draft
in no suffix proposer at ``batch_size > 1``; :func:`~eval.decoding.batch_drafters.
batch_drafter_for` refuses a suffix proposer around a tree), and the proposer's ``mode="merge"``
(both proposals in one tree every round, batch one's tests) has no batched form.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Protocol

import torch
from torch import Tensor

from draftsmith.eval.decoding.proposal import Sampling
from draftsmith.eval.decoding.proposers_suffix import (
    LENGTHS,
    AcceptRates,
    SuffixIndex,
    SuffixProposer,
    VerifyCost,
)

STEP_SAMPLES = 8  # the inner's seconds per step: the median of its latest rounds
# rounds without the inner after which the rows choose by their rates alone once (the inner
# drafts for the rows that favour it): its rates and step time measured anew, not kept stale
PROBE_EVERY = 16


class InnerDrafter(Protocol):
    """The calls the hybrid makes of a trained draft's batched drafter (a
    :class:`~eval.decoding.batch_drafters.BatchDrafter`, which imports this module)."""

    def start(self, tokens: list[list[int]], features: Tensor, valid: Tensor) -> None: ...

    def propose(self, k: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]: ...

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor,
               own: Tensor | None = None) -> None: ...

    def select(self, rows: Tensor) -> None: ...


class BatchSuffix:
    """The batched suffix chains of ``proposer`` (its ``max_length``, ``min_match``), beside the
    batched drafter ``inner`` of its inner proposer (None: suffix chains alone).

    The proposer's ``choices`` and ``accepted`` count the rows' rounds (one per row and round
    that drafted) and accepted drafts of each part, as batch one counts its rounds: reports read
    them there.
    """

    def __init__(self, proposer: SuffixProposer, inner: InnerDrafter | None = None) -> None:
        self.proposer, self.inner = proposer, inner
        self.index: list[SuffixIndex] = []
        self.rates: list[AcceptRates] = []
        self._round: dict | None = None
        self.steps: deque[float] = deque(maxlen=STEP_SAMPLES)  # inner seconds per step
        self.without_inner = 0  # rounds since the inner last drafted
        self.fit = VerifyCost()  # seconds per verification against the block's width

    @property
    def max_k(self) -> int | None:
        """The longest chain the inner drafter drafts (None: any; suffix chains are not bound
        by it)."""
        return getattr(self.inner, "max_k", None)

    def start(self, tokens: list[list[int]], features: Tensor, valid: Tensor) -> None:
        """Each row's prompt and first token ``tokens[b]``; ``features``, ``valid``: the
        target's prefill, for the inner drafter."""
        self.index = [SuffixIndex(t) for t in tokens]
        self.rates = [AcceptRates() for _ in tokens]
        self._round = None
        if self.inner is not None:
            self.inner.start(tokens, features, valid)

    def _matches(self, limits: list[int]) -> tuple[list[int], list[list[int]]]:
        """Each row's match length and suffix chain (up to ``limits[b]`` tokens; none below
        ``min_match``)."""
        matches, chains = [], []
        for index, limit in zip(self.index, limits):
            m, chain = index.continuation(limit) if limit > 0 else (0, [])
            m, chain = (m, chain) if m >= self.proposer.min_match else (0, [])
            matches.append(m)
            chains.append(chain)
        return matches, chains

    def _choose(self, want: list[int], matches: list[int], chains: list[list[int]]
                ) -> tuple[list[bool], int]:
        """Which rows draft the inner chain this round, and the longest suffix chain drafted.

        The batch shares one verification, as wide as its longest chain, and one inner
        proposal of the longest ``k`` of the rows that take it, so the choice is the batch's:
        for each cap on the suffix chains (0: rows without the inner's chain take plain steps),
        with or without the inner for the rows whose rates expect more accepted drafts from it
        than from their capped suffix chain, the expected tokens of all rows per second
        (verification: a line through the measured rounds' widths; the inner: the median of its
        latest seconds per step), the best kept. Before both are measured, and once every
        :data:`PROBE_EVERY` rounds without the inner, each row takes what its rates favour,
        uncapped: that measures them, and a draft dropped early on a few rounds is tried again
        with what the rows have learnt since."""
        longest = max(len(c) for c in chains)
        inner_at = [self.inner is not None and k > 0 for k in want]

        def expect(b: int, cap: int) -> float:
            n = min(len(chains[b]), cap)
            return self.rates[b].suffix_tokens(matches[b], n) if n else 0.0

        def prefer(cap: int) -> list[bool]:
            return [a and expect(b, cap) < r.inner_tokens()
                    for b, (a, r) in enumerate(zip(inner_at, self.rates))]

        probe = self.inner is not None and (not self.steps or self.without_inner >= PROBE_EVERY)
        if not self.fit or probe:
            return prefer(longest), longest
        t_step = statistics.median(self.steps) if self.steps else 0.0  # (no inner: unused)
        best = (0.0, [False] * len(want), 0)
        for cap in [0] + [n for n in LENGTHS if n < longest] + [longest]:
            width = min(longest, cap)
            tokens = sum(1 + expect(b, cap) for b in range(len(want)))
            best = max(best, (tokens / self.fit.cost(width + 1), [False] * len(want), cap),
                       key=lambda c: c[0])
            own = prefer(cap)
            if any(own):
                k_inner = max(k for k, o in zip(want, own) if o)
                width = max([k_inner] + [min(len(c), cap) for c, o in zip(chains, own) if not o])
                tokens = sum(1 + (r.inner_tokens() if o else expect(b, cap))
                             for b, (o, r) in enumerate(zip(own, self.rates)))
                cost = k_inner * t_step + self.fit.cost(width + 1)
                best = max(best, (tokens / cost, own, cap), key=lambda c: c[0])
        return best[1], best[2]

    @torch.inference_mode()
    def propose_chains(self, ks: Tensor, sampling: Sampling, generator: torch.Generator | None,
                       budgets: list[int] | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """Each row's chain: drafts ``(B, K)`` (CPU), ``q`` ``(B, K, V)`` (None: every row's
        drafts are point masses, or greedy) and the drafts each row has ``(B,)`` (as
        :meth:`~eval.decoding.batch_drafters.BatchDrafter.propose_chains`). A row with
        ``ks[b] > 0`` drafts the inner's chain of ``ks[b]`` or a suffix chain of up to the
        proposer's ``max_length`` and ``budgets[b]`` (the tokens it may still add; default
        ``ks``), as batch one does; ``ks[b] = 0``: none."""
        want = ks.tolist()
        limits = [min(self.proposer.max_length, budget) if k > 0 else 0
                  for k, budget in zip(want, want if budgets is None else budgets)]
        matches, chains = self._matches(limits)
        own, cap = self._choose(want, matches, chains)
        chains = [c[:cap] for c in chains]
        lengths = [k if o else len(c) for k, o, c in zip(want, own, chains)]
        k_inner = max((k for k, o in zip(want, own) if o), default=0)
        self.without_inner = 0 if k_inner else self.without_inner + 1
        drafts = torch.zeros(len(want), max(lengths), dtype=torch.long)
        q = None
        if k_inner:
            t0 = time.perf_counter()
            inner_drafts, inner_q = self.inner.propose(k_inner, sampling, generator)
            self.steps.append((time.perf_counter() - t0) / k_inner)
            drafts[:, :k_inner] = inner_drafts.cpu()
            if inner_q is not None:
                q = inner_q.new_zeros(len(want), max(lengths), inner_q.shape[-1])
                q[:, :k_inner] = inner_q
        for b, (o, chain) in enumerate(zip(own, chains)):
            if o:
                continue
            drafts[b] = 0  # the inner's drafts of a row that does not take them: padding
            drafts[b, :len(chain)] = torch.tensor(chain, dtype=torch.long)
            if q is not None:  # beside the inner's q rows, this row's point masses
                q[b] = 0
                if chain:
                    q[b, :len(chain)] = self.proposer._suffix_q(chain, q[b]).to(q)
        self._round = {"own": own, "k_inner": k_inner, "matches": matches, "lengths": lengths,
                       "t": time.perf_counter()}
        return drafts, q, torch.tensor(lengths, dtype=ks.dtype)

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor) -> None:
        """Row ``b`` accepted ``n[b]`` of its drafts ``drafts[b]`` (``k``: the block's drafts
        per row), then ``nxt[b]``; ``features (B, k + 1, .)``: the target's of the block."""
        r, self._round = self._round, None
        n_rows, nxt_rows = n.tolist(), nxt.tolist()
        for b, index in enumerate(self.index):
            index.extend(drafts[b, :n_rows[b]].tolist() + [nxt_rows[b]])
        own = None
        if r is not None:
            # from the end of the proposal to here: the target's verification of the block
            self.fit.add(max(r["lengths"]) + 1, time.perf_counter() - r["t"])
            own = torch.tensor(r["own"])
            for b, (o, length) in enumerate(zip(r["own"], r["lengths"])):
                if not length:
                    continue
                part = "inner" if o else "suffix"
                self.proposer.choices[part] += 1
                self.proposer.accepted[part] += n_rows[b]
                if o:
                    self.rates[b].add_inner(n_rows[b])
                else:
                    self.rates[b].add_suffix(r["matches"][b], length, n_rows[b])
        if self.inner is not None:
            self.inner.commit(0 if r is None else r["k_inner"], n, drafts, nxt, features,
                              own=own)

    def select(self, rows: Tensor) -> None:
        keep = rows.tolist()
        self.index = [self.index[i] for i in keep]
        self.rates = [self.rates[i] for i in keep]
        if self.inner is not None:
            self.inner.select(rows)
