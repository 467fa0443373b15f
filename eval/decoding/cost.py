"""The cost model of speculative decoding: expected tokens per step, expected speedup, K*.

A step drafts ``K`` tokens and verifies them in one target forward. With conditional acceptance
``alpha_i`` per draft position (P(position i accepted | positions < i accepted)) it yields

    E_K = 1 + sum_{i<=K} prod_{j<=i} alpha_j

tokens (the accepted drafts plus the target's own next token) and costs ``K * t_draft +
t_verify(K)`` seconds, against ``E_K`` plain steps of ``t_ar`` each:

    speedup(K) = E_K * t_ar / (K * t_draft + t_verify(K)),   K* = argmax_K speedup(K).

``t_verify(K)`` is the time of ONE target forward over ``K + 1`` tokens (the pending token and
the ``K`` drafts) with the cache, so ``t_verify(0)`` is a plain step. ``speculation.json`` stores
the costs (written by :func:`eval.kstar.measure_speculation`) as ``{"t_ar": s, "t_draft": s per
drafted token, "t_verify": {"K": s}}``. Trees have no prediction here: ``eval/measure.py``
chooses the tree shape by decoding with each.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple


class Costs(NamedTuple):
    """Seconds of a plain step, of drafting one token, and of verifying ``K`` drafts, per K."""

    t_ar: float
    t_draft: float
    t_verify: dict[int, float]


def parse_costs(costs: Mapping) -> Costs | None:
    """Read the ``costs`` of a ``speculation.json`` (``t_verify`` a mapping from K, string keys
    allowed, or a list indexed by K); ``None`` when ``t_ar``, ``t_draft`` or ``t_verify`` is
    missing."""
    t_ar, t_draft, t_ver = costs.get("t_ar"), costs.get("t_draft"), costs.get("t_verify")
    if t_ar is None or t_draft is None or t_ver is None:
        return None
    pairs = t_ver.items() if isinstance(t_ver, Mapping) else enumerate(t_ver)
    return Costs(float(t_ar), float(t_draft),
                 {int(k): float(v) for k, v in pairs if v is not None})


def expected_tokens(alpha: Sequence[float], k: int) -> float:
    """``E_K`` for conditional per-position acceptances ``alpha`` (needs ``len(alpha) >= k``)."""
    if k > len(alpha):
        raise ValueError(f"need alpha for {k} positions, have {len(alpha)}")
    total, prod = 1.0, 1.0
    for a in alpha[:k]:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha values must lie in [0, 1], got {a}")
        prod *= a
        total += prod
    return total


def expected_tokens_constant(alpha: float, k: int) -> float:
    """``E_K`` when every position accepts with the same ``alpha``: ``sum_{i<=K} alpha^i``."""
    return expected_tokens([alpha] * k, k)


def speedup(tokens: float, k: int, costs: Costs) -> float:
    """``tokens * t_ar / (K * t_draft + t_verify(K))``: a step yielding ``tokens`` against plain
    decoding."""
    step = k * costs.t_draft + costs.t_verify[k]
    if costs.t_ar <= 0 or costs.t_draft < 0 or step <= 0:
        raise ValueError(f"costs must be positive, got t_ar={costs.t_ar}, "
                         f"t_draft={costs.t_draft}, step cost {step} at K={k}")
    return tokens * costs.t_ar / step


def expected_speedups(alpha: Sequence[float], costs: Costs,
                      ks: Iterable[int] | None = None) -> dict[int, float]:
    """Expected speedup per K of ``ks`` (default: every K of ``costs.t_verify``), ascending; K
    without a verify cost or an alpha is left out."""
    ks = sorted(set(costs.t_verify if ks is None else ks))
    return {k: speedup(expected_tokens(alpha, k), k, costs)
            for k in ks if k in costs.t_verify and k <= len(alpha)}


def best_k(speedups: Mapping[int, float]) -> int:
    """The K of the highest speedup; ties go to the smaller K (less drafting, same gain)."""
    return max(speedups, key=lambda k: (speedups[k], -k))


def choose_kstar(alpha: Sequence[float], costs: Costs) -> tuple[int, dict[int, float]]:
    """``(K*, expected speedup per K)``; plain decoding (K = 0, speedup 1) is always an option,
    so K* is 0 when no K pays."""
    speedups = expected_speedups(alpha, costs)
    return best_k({0: 1.0, **speedups}), speedups
