"""The paired speedup: how much faster a method decodes than a baseline on the same inputs.

Both sides run every unit (a prompt, a batch, a round) in the same process, close together in
time, so that whatever the machine does meanwhile hits both sides of that unit's ratio alike. Per
unit, the method's tokens/s over the baseline's, each the median of its runs there (one run, or
several interleaved: plain before and after, or rounds); the speedup is the median of these
ratios over the units. A unit whose baseline took no time has no ratio.

The one definition for every tool that reports a speedup: ``eval/session.py`` (decode, measure,
batches), ``scripts/bench.py``, ``scripts/bench_fallback.py``, ``scripts/bench_batch.py`` and the
engines (``scripts/engine_speed.py``).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Runs = float | Sequence[float]  # a unit's tokens/s: one run, or several


@dataclass(frozen=True)
class PairedSpeedup:
    """A method against a baseline, unit by unit.

    Attributes:
        per_unit: per unit, the method's median tokens/s over the baseline's (None where the
            baseline's median is 0).
        base_drift: per unit, how far apart the baseline's runs were: their range over their
            median (0 for a single run or a baseline that took no time).
    """

    per_unit: list[float | None]
    base_drift: list[float]

    @property
    def ratios(self) -> list[float]:
        """The units' ratios, those without one left out."""
        return [r for r in self.per_unit if r is not None]

    @property
    def median(self) -> float | None:
        """The speedup: the median of :attr:`ratios` (None when no unit has one)."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def spread(self) -> tuple[float, float] | None:
        """``(min, max)`` of :attr:`ratios`."""
        return (min(self.ratios), max(self.ratios)) if self.ratios else None


def _runs(x: Runs) -> list[float]:
    return [float(x)] if isinstance(x, (int, float)) else [float(v) for v in x]


def paired_speedup(method: Sequence[Runs], base: Sequence[Runs]) -> PairedSpeedup:
    """The paired speedup of ``method`` over ``base``: per unit, the tokens/s of each side (a
    number, or a sequence of repeated runs), in the same order on both sides.

    Raises:
        ValueError: the two sides do not have the same number of units.
    """
    if len(method) != len(base):
        raise ValueError(f"a paired speedup needs the same units on both sides: {len(method)} "
                         f"for the method, {len(base)} for the baseline")
    per_unit, drift = [], []
    for m, b in zip(method, base):
        b_runs = _runs(b)
        b_mid = statistics.median(b_runs)
        per_unit.append(statistics.median(_runs(m)) / b_mid if b_mid > 0 else None)
        drift.append((max(b_runs) - min(b_runs)) / b_mid if b_mid > 0 else 0.0)
    return PairedSpeedup(per_unit, drift)
