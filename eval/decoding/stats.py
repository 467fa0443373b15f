"""The decoder's fixed return types and its K controller (adaptive K, fallback to plain)."""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from draftsmith.eval.decoding.cost import Costs, best_k, expected_tokens_constant, speedup


@dataclass
class DecodeStats:
    """Acceptance and timing statistics of one or more decodes (one fixed type for every proposer).

    Attributes:
        tokens_generated: new tokens returned.
        target_forwards: target forward passes (the prefill counts as one: it yields the first
            token).
        tau: tokens per target forward, bonus tokens included (1.0 for plain decoding).
        drafted: draft positions offered for verification (chain length or tree depth, per step).
        accepted: draft tokens accepted.
        acceptance_rate: ``accepted / drafted``.
        alpha: conditional acceptance per draft position ``i`` (1-based, list index ``i - 1``):
            P(position i accepted | positions < i accepted and position i drafted).
        alpha_cumulative: ``prod_{j <= i} alpha_j``.
        reached: per position, steps that drafted it with all earlier positions accepted.
        accepted_at: per position, steps that accepted it.
        spec_steps: verification steps with at least one drafted token.
        plain_steps: steps without drafts (K = 0, fallback, or the last token of the budget).
        draft_time_s: time spent in the proposer.
        verify_time_s: time in target forwards (prefill included) and verification.
        wall_time_s: total time.
        tokens_per_s: ``tokens_generated / wall_time_s``.
        stop_reason: ``eos``, ``stop_sequence``, ``max_new_tokens`` or ``time_budget`` (``mixed``
            after merging different reasons).
    """

    tokens_generated: int = 0
    target_forwards: int = 0
    tau: float = 0.0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    alpha: list[float] = field(default_factory=list)
    alpha_cumulative: list[float] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    spec_steps: int = 0
    plain_steps: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    stop_reason: str = ""

    def record_step(self, depth: int, n_accepted: int) -> None:
        """Count one verification step: ``depth`` positions drafted, ``n_accepted`` accepted."""
        if depth == 0:
            self.plain_steps += 1
            return
        self.spec_steps += 1
        self.drafted += depth
        self.accepted += n_accepted
        while len(self.reached) < depth:
            self.reached.append(0)
            self.accepted_at.append(0)
        for i in range(min(depth, n_accepted + 1)):
            self.reached[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    def finalize(self) -> DecodeStats:
        """Fill the derived fields from the counts; returns ``self``."""
        self.tau = self.tokens_generated / self.target_forwards if self.target_forwards else 0.0
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.alpha = [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]
        cum, prod = [], 1.0
        for a in self.alpha:
            prod *= a
            cum.append(prod)
        self.alpha_cumulative = cum
        self.tokens_per_s = self.tokens_generated / self.wall_time_s if self.wall_time_s else 0.0
        return self

    @staticmethod
    def merge(parts: list[DecodeStats]) -> DecodeStats:
        """Sum counts and times of several decodes and recompute the derived fields."""
        out = DecodeStats()
        reasons = {p.stop_reason for p in parts}
        for p in parts:
            for name in ("tokens_generated", "target_forwards", "drafted", "accepted", "spec_steps",
                         "plain_steps", "draft_time_s", "verify_time_s", "wall_time_s"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            n = max(len(out.reached), len(p.reached))
            out.reached = [_at(out.reached, i) + _at(p.reached, i) for i in range(n)]
            out.accepted_at = [_at(out.accepted_at, i) + _at(p.accepted_at, i) for i in range(n)]
        out.stop_reason = reasons.pop() if len(reasons) == 1 else "mixed"
        return out.finalize()

    def to_dict(self) -> dict:
        return asdict(self)


class RoundTime(NamedTuple):
    """One round of the decoding loop, timed (``SpeculativeDecoder.round_log``).

    ``draft_s``: the proposer's ``propose``; ``forward_s``: the target's forward over the pending
    token and the drafts; ``round_s``: the whole round, from ``propose`` to the end of the loop
    body, so that ``round_s - draft_s - forward_s`` is the bookkeeping (acceptance, commit, cache
    rollbacks, the proposer's ``accept``, the K controller).
    """

    depth: int  # deepest drafted position (0: a plain step)
    nodes: int  # drafted tokens (chain length or tree nodes)
    accepted: int
    tokens: int  # committed this round: the accepted drafts and the next token
    draft_s: float
    forward_s: float
    round_s: float

    @property
    def bookkeeping_s(self) -> float:
        return self.round_s - self.draft_s - self.forward_s


def _at(xs: list[int], i: int) -> int:
    return xs[i] if i < len(xs) else 0


@dataclass
class _Step:
    depth: int
    nodes: int
    accepted: int
    tokens: int
    t_draft: float
    t_verify: float


class KController:
    """Chooses the draft length for the next step from recent measurements.

    * **Adaptive K** (chains): with ``a`` the Laplace-smoothed acceptance over the last ``window``
      speculative steps, per-token draft cost ``t_d`` and a linear fit of verify time against the
      number of fed tokens (``t_verify(K)`` feeds ``K + 1``), pick the K of the highest
      :func:`eval.decoding.cost.speedup` with constant acceptance ``a``.
    * **Fallback**: a one-sided test on the tokens per speculative step over the last
      ``fallback_window`` steps. With ``m`` their mean, ``s^2`` their variance pooled with a
      prior of ``prior_steps`` pseudo-steps of variance ``prior_var`` (so that a short streak
      of rejections, variance 0, is not taken as certainty) and ``c`` the measured cost of a
      speculative step in plain steps, fall back when ``m + z * s / sqrt(n) < c``: when even
      the optimistic end of the estimate is slower than plain decoding. A useless draft (one
      token per step, ``c`` around 1.3-1.7) falls back after 3-10 steps; a draft whose early
      steps happen to be rejected does not. While fallen back, decode plainly for
      ``probe_every`` steps, then probe with one speculative step; each probe after which the
      test still says "loss" doubles the plain stretch (up to ``max_backoff`` doublings).
      With ``z=0`` and ``fallback_window=8`` this is the earlier rule (fall back
      when the mean of 8 steps is a loss, decided after 3), which fell back on 70% of MT-bench
      steps with a head that paid 1.22x speculating throughout.

    Args:
        k: initial (and, when not adaptive, fixed) draft length or tree depth.
        k_max: largest K the adaptive rule may pick.
        adaptive: adapt K (chains only).
        fallback: allow falling back to plain decoding.
        window: speculative steps remembered by adaptive K.
        min_steps: steps needed before a fallback decision.
        fallback_window: speculative steps the fallback test looks at.
        z: the test's one-sided normal quantile (2.0: about 2% false alarms per decision).
        prior_steps: pseudo-steps of the variance prior.
        prior_var: their variance (0.25: a token gained on half the steps).
        probe_every: plain steps before the first probe while fallen back.
        max_backoff: most doublings of ``probe_every`` after failed probes.
    """

    def __init__(self, k: int, k_max: int | None = None, adaptive: bool = True,
                 fallback: bool = True, window: int = 8, min_steps: int = 3,
                 probe_every: int = 32, max_backoff: int = 3, fallback_window: int = 32,
                 z: float = 2.0, prior_steps: float = 4.0, prior_var: float = 0.25) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k
        self.k_max = max(k, k_max or 2 * max(k, 1))
        self.adaptive = adaptive
        self.fallback = fallback
        self.min_steps = min_steps
        self.probe_every = probe_every
        self.steps: deque[_Step] = deque(maxlen=window)
        self.history: deque[_Step] = deque(maxlen=max(fallback_window, min_steps))
        self.z, self.prior_steps, self.prior_var = z, prior_steps, prior_var
        self.plain_times: deque[float] = deque(maxlen=16)
        self.plain_left = 0
        self.max_backoff = max_backoff
        self.backoff = 0  # doublings of probe_every for the next fallback
        self.tree = False

    def next_k(self) -> int:
        """Draft length for the next step (0 = plain step)."""
        if self.k == 0:
            return 0
        if self.plain_left > 0:
            self.plain_left -= 1
            return 0
        return self.k

    def record_plain(self, t_step: float) -> None:
        self.plain_times.append(t_step)

    def record(self, depth: int, nodes: int, accepted: int, tokens: int,
               t_draft: float, t_verify: float) -> None:
        """Record one speculative step and update K / the fallback state."""
        step = _Step(depth, nodes, accepted, tokens, t_draft, t_verify)
        self.steps.append(step)
        self.history.append(step)
        if self.adaptive and not self.tree:
            self.k = self._best_k()
        if not self.fallback or len(self.history) < self.min_steps:
            return
        if self.is_loss():
            self.plain_left = self.probe_every << self.backoff
            self.backoff = min(self.backoff + 1, self.max_backoff)
        else:
            self.backoff = 0

    def t_plain(self) -> float:
        """Plain step time: measured median, else the fastest verify seen (an upper bound)."""
        if self.plain_times:
            return statistics.median(self.plain_times)
        return min(s.t_verify for s in self.history)

    def is_loss(self) -> bool:
        """The fallback test: is speculation slower than plain decoding, beyond the noise of
        the tokens per step? (See the class docstring.)"""
        n = len(self.history)
        tokens = [s.tokens for s in self.history]
        m = statistics.fmean(tokens)
        var = ((self.prior_steps * self.prior_var + sum((x - m) ** 2 for x in tokens))
               / (self.prior_steps + n))
        cost = statistics.fmean(s.t_draft + s.t_verify for s in self.history) / self.t_plain()
        return m + self.z * math.sqrt(var / n) < cost

    def _verify_fit(self) -> tuple[float, float]:
        """Least-squares ``t_verify = c0 + c1 * fed_tokens`` over the window (slope 0 if flat)."""
        xs = [s.nodes + 1 for s in self.steps]
        ys = [s.t_verify for s in self.steps]
        if self.plain_times:
            xs.append(1)
            ys.append(statistics.median(self.plain_times))
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        return my - slope * mx, slope

    def _best_k(self) -> int:
        drafted = sum(s.depth for s in self.steps)
        accepted = sum(s.accepted for s in self.steps)
        a = (accepted + 1) / (drafted + 2)
        t_d = sum(s.t_draft for s in self.steps) / max(drafted, 1)
        c0, c1 = self._verify_fit()
        ks = range(1, self.k_max + 1)
        # a unit plain step: the argmax does not depend on t_ar; the fit may dip below 0 early on
        costs = Costs(1.0, t_d, {k: max(c0 + c1 * (k + 1), 1e-9) for k in ks})
        return best_k({k: speedup(expected_tokens_constant(a, k), k, costs) for k in ks})
