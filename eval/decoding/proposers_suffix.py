"""The suffix proposer: text the context already holds, drafted for free, alone or beside a
trained draft (the hybrid).

:class:`SuffixIndex` is a suffix automaton over the committed tokens (prompt and generated text),
extended by one token in amortised constant time: the longest suffix of the sequence that also
ends earlier, and where it last did, come from one suffix link, so a lookup costs O(1) plus
the drafted tokens, never a rescan. The draft is what followed that earlier occurrence.

:class:`SuffixProposer` drafts each round from (a) the suffix match, (b) its ``inner`` proposer
(a trained draft: EAGLE head, draft LM, ...), or (c) one tree holding both (the inner proposal
and the suffix chain as one more branch off the pending token), whichever promises the most
accepted tokens per unit of time, from rates measured in this request:

* the suffix chain's acceptance per position, per bucket of match length (Beta prior);
* the inner proposal's accepted tokens per round (its best path against what was committed);
* the inner draft's time, and the target's verification cost as a linear fit against the nodes
  fed (the time from the end of ``propose`` to ``accept``).

Losslessness: suffix tokens are deterministic choices (point masses, ``q`` one-hot), valid
proposals at any temperature, and a sibling branch added after the inner nodes changes nothing
about how those were drawn, so greedy verification and recursive rejection sampling stay exact
(``tests/eval/test_sampling_exact.py``: a chi-square test, with a twin whose merged tree gives the
suffix nodes a wrong ``q`` and fails).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.target_model import TargetOutput

LINK_WALK = 64  # suffix-link states whose latest end is refreshed per token (older: stale)
LENGTHS = (1, 2, 4, 8, 16)  # suffix chain lengths considered per round
BUCKETS = (1, 2, 3, 4, 8, 16)  # match-length buckets of the acceptance estimate (lower bounds)
# the acceptance per suffix draft a bucket starts from (a Beta prior of PRIOR_WEIGHT drafts):
# short matches are guesses, long ones copies; measured drafts soon outweigh it
PRIOR_ALPHA = (0.15, 0.25, 0.35, 0.5, 0.65, 0.8)
PRIOR_WEIGHT = 4.0
SUFFIX_MODES = ("auto", "merge")


class SuffixIndex:
    """A suffix automaton of a token sequence, built online (:meth:`append`).

    Each state keeps its transitions, suffix link, longest length and the latest two end
    positions of its strings (refreshed along the first :data:`LINK_WALK` suffix links per
    token; a state further up keeps an older end, still a true occurrence).
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.ends: list[list[int]] = [[-1, -1]]  # latest end, the one before
        self.last = 0
        for t in tokens:
            self.append(t)

    def _state(self, length: int, link: int, nxt: dict[int, int], ends: list[int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.ends.append(ends)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        """Extend the sequence by ``token``."""
        i = len(self.tokens)
        self.tokens.append(token)
        cur = self._state(self.length[self.last] + 1, 0, {}, [-1, -1])
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._state(self.length[p] + 1, self.link[q], dict(self.next[q]),
                                    list(self.ends[q]))
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        s, walked = cur, 0
        while s > 0 and walked < LINK_WALK:  # states whose strings now also end at i
            ends = self.ends[s]
            if ends[0] != i:
                ends[1], ends[0] = ends[0], i
            s, walked = self.link[s], walked + 1

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def match(self) -> tuple[int, int]:
        """``(m, e)``: the longest suffix of the sequence that also ends earlier has ``m``
        tokens and its latest earlier occurrence ends at position ``e``; ``(0, -1)``: none."""
        s = self.link[self.last]
        if s <= 0:
            return 0, -1
        last, before = self.ends[s]
        end = last if last != len(self.tokens) - 1 else before
        return (self.length[s], end) if end >= 0 else (0, -1)

    def continuation(self, limit: int) -> tuple[int, list[int]]:
        """The match length and up to ``limit`` tokens that followed its earlier occurrence."""
        m, e = self.match()
        return (m, self.tokens[e + 1:e + 1 + limit]) if m else (0, [])


def _bucket(m: int) -> int:
    return max(i for i, lo in enumerate(BUCKETS) if m >= lo)


class AcceptRates:
    """The rates a request measured, behind each round's choice between the suffix chain and the
    inner draft: the suffix chain's acceptance per drafted token, per bucket of match length
    (Beta prior), and the inner draft's accepted tokens per round (prior: one in one round).
    Batch one keeps one per request, a batch one per row (:mod:`eval.decoding.batch_suffix`)."""

    def __init__(self) -> None:
        # suffix acceptance per match bucket: accepted and rejected drafts, prior included
        self.s_acc = [PRIOR_WEIGHT * a for a in PRIOR_ALPHA]
        self.s_rej = [PRIOR_WEIGHT * (1 - a) for a in PRIOR_ALPHA]
        self.i_tokens, self.i_rounds = 1.0, 1.0

    def suffix_tokens(self, m: int, length: int) -> float:
        """Expected accepted suffix drafts of a chain of ``length`` at match length ``m``."""
        b = _bucket(m)
        a = self.s_acc[b] / (self.s_acc[b] + self.s_rej[b])
        return sum(a ** j for j in range(1, length + 1))

    def inner_tokens(self) -> float:
        """Expected accepted drafts of the inner draft's proposal."""
        return self.i_tokens / self.i_rounds

    def add_suffix(self, m: int, length: int, accepted: int) -> None:
        """A suffix chain of ``length`` drafted at match length ``m`` had ``accepted`` drafts
        accepted (a rejection counted where it stopped short)."""
        b = _bucket(m)
        self.s_acc[b] += accepted
        self.s_rej[b] += 1.0 if accepted < length else 0.0

    def add_inner(self, accepted: int) -> None:
        """The inner draft's proposal of a round had ``accepted`` drafts accepted."""
        self.i_tokens += accepted
        self.i_rounds += 1


class VerifyCost:
    """Seconds to verify a number of fed tokens: a least-squares line through the last
    ``keep`` measured rounds (slope at least 0; a flat prior of 1% of the intercept per token
    before two distinct sizes were seen; ``1 + 0.01 n``, unitless, before any)."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self.rounds: list[tuple[int, float]] = []  # (tokens fed, seconds)

    def __bool__(self) -> bool:
        return bool(self.rounds)

    def add(self, fed: int, seconds: float) -> None:
        self.rounds = (self.rounds + [(fed, seconds)])[-self.keep:]

    def cost(self, fed: float) -> float:
        if not self.rounds:
            return 1.0 + 0.01 * fed
        xs = [x for x, _ in self.rounds]
        ys = [y for _, y in self.rounds]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        slope = max(slope, 0.0) if var else 0.01 * my
        return max(my + slope * (fed - mx), 1e-6)


def _accepted_along(tokens: Sequence[int], parents: Sequence[int], committed: Sequence[int],
                    offset: int = 0) -> int:
    """How many of ``committed`` a proposal's tree (nodes ``offset + j``, parents in the same
    numbering, ``-1`` = the pending token) holds as a root path: what it would have had
    accepted, greedily."""
    child = {(int(p), int(t)): offset + j for j, (p, t) in enumerate(zip(parents, tokens))}
    node, n = -1, 0
    for tok in committed:
        node = child.get((node, int(tok)), None)
        if node is None:
            break
        n += 1
    return n


class SuffixProposer(Proposer):
    """Suffix drafts alone (``inner`` None) or beside a trained draft (see the module docstring).

    Args:
        inner: the trained draft's proposer, or None.
        vocab_size: the target's vocabulary size (one-hot ``q`` rows of suffix nodes in a
            sampled tree).
        max_length: longest suffix chain drafted.
        min_match: shortest match drafted from.
        mode: ``"auto"`` (the per-round choice) or ``"merge"`` (the inner proposal and the
            suffix chain together whenever there is a match: tests).
    """

    def __init__(self, inner: Proposer | None = None, vocab_size: int | None = None,
                 max_length: int = 16, min_match: int = 1, mode: str = "auto") -> None:
        if mode not in SUFFIX_MODES:
            raise ValueError(f"mode={mode!r}: allowed {SUFFIX_MODES}")
        if max_length < 1 or min_match < 1:
            raise ValueError(f"max_length and min_match must be >= 1, got {max_length}, "
                             f"{min_match}")
        self.inner, self.vocab_size = inner, vocab_size
        self.max_length, self.min_match, self.mode = max_length, min_match, mode
        self.name = "suffix" if inner is None else inner.name  # reports group by the draft
        self.layer_ids = () if inner is None else tuple(inner.layer_ids)
        self.tree = inner is not None and bool(inner.tree)
        self.lossless = inner is None or bool(inner.lossless)
        self.index = SuffixIndex()
        self.choices = {"suffix": 0, "inner": 0, "both": 0}  # rounds drafted each way
        self.accepted = {"suffix": 0, "inner": 0}  # drafts accepted from each part
        self._reset_rates()

    # the inner draft's settings, as reports read them
    @property
    def total_tokens(self) -> int | None:
        return getattr(self.inner, "total_tokens", None)

    @property
    def tree_draw(self) -> str | None:
        return getattr(self.inner, "tree_draw", None)

    @property
    def draft_vocab(self) -> int | None:
        return getattr(self.inner, "draft_vocab", None)

    def _reset_rates(self) -> None:
        self.rates = AcceptRates()
        self.i_nodes = 0.0
        self.i_time = 0.0  # inner propose seconds per round (running mean)
        self.fit = VerifyCost()
        self._round: dict | None = None

    # ----- protocol ----------------------------------------------------------------------------
    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        self.index = SuffixIndex(tokens)
        self._reset_rates()
        if self.inner is not None:
            self.inner.reset(tokens, target_out)

    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        self._round = None
        if k <= 0:
            return Proposal.empty()
        self.index.extend(ctx.tokens[len(self.index.tokens):])
        budget = ctx.budget if ctx.budget is not None else self.max_length
        m, cont = self.index.continuation(min(self.max_length, budget))
        if m < self.min_match:
            cont = []
        use_inner, length = self._choose(m, len(cont))
        inner = None
        if use_inner:
            t0 = time.perf_counter()
            inner = self.inner.propose(ctx, k)
            dt = time.perf_counter() - t0
            self.i_time = dt if not self.i_time else 0.8 * self.i_time + 0.2 * dt
            self.i_nodes = len(inner) if not self.i_nodes else 0.8 * self.i_nodes + 0.2 * len(inner)
        chain = cont[:length]
        prop = self._merge(inner, chain)
        what = "both" if inner is not None and chain else "inner" if inner is not None else "suffix"
        if len(prop):
            self.choices[what] += 1
        self._round = {"inner": inner, "chain": chain, "match": m,
                       "nodes": len(prop), "t": time.perf_counter()}
        return prop

    def accept(self, path: list[int], new_tokens: list[int], target_out: TargetOutput) -> None:
        r, self._round = self._round, None
        inner_path = path
        if r is not None:
            self.fit.add(r["nodes"] + 1, time.perf_counter() - r["t"])
            n_inner = 0 if r["inner"] is None else len(r["inner"])
            inner_path = path if path and path[0] < n_inner else []
            self.accepted["inner" if inner_path else "suffix"] += len(path)
            chain = r["chain"]
            if chain:
                a = _accepted_along(chain, range(-1, len(chain) - 1), new_tokens)
                self.rates.add_suffix(r["match"], len(chain), a)
            if r["inner"] is not None:
                prop = r["inner"]
                self.rates.add_inner(_accepted_along(prop.tokens.tolist(), prop.parents.tolist(),
                                                     new_tokens))
        if self.inner is not None:
            self.inner.accept(inner_path, new_tokens, target_out)

    def shadow_chain(self, ctx: DecodeContext, k: int) -> Proposal:
        """The trained draft's chain alone (shadow drafts judge the draft; the rates of the
        per-round choice stay those of verified rounds)."""
        self._round = None
        return self.propose(ctx, k) if self.inner is None else self.inner.shadow_chain(ctx, k)

    def pause(self, paused: bool) -> bool:
        """While paused, rounds draft suffix chains alone (where a match pays); the trained
        draft still follows every committed token, ready to resume."""
        if self.inner is None:
            return False
        self.paused = paused
        return True

    def outcome(self, proposal: Proposal, path: list[int],
                new_tokens: list[int]) -> tuple[int, int] | None:
        """The trained draft's own chain this round, beside or without a suffix chain."""
        inner = None if self._round is None else self._round["inner"]
        if inner is None or not len(inner) or not inner.is_chain:
            return None
        return len(inner), _accepted_along(inner.tokens.tolist(), inner.parents.tolist(),
                                           new_tokens)

    # ----- the choice --------------------------------------------------------------------------
    def _choose(self, m: int, available: int) -> tuple[bool, int]:
        """Whether the inner draft drafts, and the suffix chain's length (0: none). Suffix
        chains alone (no inner draft, or paused) are drafted only where they beat a plain
        step, whose cost is the fit's at one fed token."""
        if self.inner is None or self.paused:
            if not available:
                return False, 0
            return False, max(range(available + 1), key=lambda n: (
                (1 + self.rates.suffix_tokens(m, n)) / self.fit.cost(n + 1), -n))
        if not available:
            return True, 0
        if self.mode == "merge":
            return True, available
        e_inner = self.rates.inner_tokens()
        n_inner = self.i_nodes or 1.0
        best = ((1 + e_inner) / (self.i_time + self.fit.cost(n_inner + 1)), True, 0)
        for n in [x for x in LENGTHS if x < available] + [available]:
            s = self.rates.suffix_tokens(m, n)
            alone = (1 + s) / self.fit.cost(n + 1)
            both = (1 + max(e_inner, s)) / (self.i_time + self.fit.cost(n_inner + n + 1))
            best = max(best, (alone, False, n), (both, True, n), key=lambda c: c[0])
        return best[1], best[2]

    # ----- the merged proposal -----------------------------------------------------------------
    def _merge(self, inner: Proposal | None, chain: list[int]) -> Proposal:
        """The inner proposal's nodes, then the suffix chain as one more branch off the pending
        token (nodes ``n_inner ...``); ``q`` one-hot on the suffix nodes when the inner nodes
        carry distributions (sampled drafts), else None (all point masses)."""
        if inner is None:
            return Proposal.chain(chain) if chain else Proposal.empty()
        if not chain:
            return inner
        n = len(inner)
        tokens = torch.cat([inner.tokens, torch.tensor(chain, dtype=torch.long)])
        parents = torch.cat([inner.parents,
                             torch.tensor([-1] + list(range(n, n + len(chain) - 1)),
                                          dtype=torch.long)])
        q = None
        if inner.q is not None:
            q = torch.cat([inner.q, self._suffix_q(chain, inner.q).to(inner.q)])
        return Proposal(tokens, parents, q)

    def _suffix_q(self, chain: list[int], inner_q: torch.Tensor) -> torch.Tensor:
        """``(L, V)`` the distributions the suffix nodes were drawn from: point masses."""
        return torch.nn.functional.one_hot(torch.tensor(chain), inner_q.shape[-1]).float()
