"""The K controller: the decoding loop's policy for the next step's draft length (adaptive K)
and for when to stop speculating (fallback to plain decoding), from the steps measured so far."""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from draftsmith.eval.decoding.cost import Costs, best_k, expected_tokens_constant, speedup


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
