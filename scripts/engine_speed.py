"""An engine's own speedup, paired per prompt: plain, speculative, plain again in one engine run.

The runners (``scripts/engine_runners/``) time each prompt three times in the same engine
process, after a warm-up; :func:`paired_speedup` turns the three tokens/s of every prompt into
the speedup, its spread and the noise flag, with the rules of the decoder's own paired runs
(``eval/session.py`` :class:`~draftsmith.eval.session.Paired`): a prompt's ratio is its
speculative tokens/s over the mean of its two plain tokens/s, the speedup is the median ratio,
and the run is noisy when more than a quarter of the prompts had plain runs further apart than
``noise_tolerance`` of their mean. The ratios are ``eval/speedup.py``'s paired speedup, the
one definition every tool uses; this module adds the engines' noise flag and report row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from draftsmith.eval.session import NOISE_TOLERANCE, NOISY_SHARE
from draftsmith.eval.speedup import paired_speedup as paired_runs


@dataclass(frozen=True)
class PairedSpeed:
    """``speedup``: median per-prompt ratio; ``spread``: (min, max) ratio; ``noisy``: see the
    module docstring; ``noisy_prompts`` of ``prompts``; ``ratios`` and ``plain_drift`` per
    prompt."""

    speedup: float | None
    spread: tuple[float, float] | None
    noisy: bool | None
    noisy_prompts: int
    prompts: int
    ratios: list[float]
    plain_drift: list[float]

    def as_row(self, prefix: str = "engine_") -> dict:
        d = asdict(self)
        return {f"{prefix}speedup": d["speedup"],
                f"{prefix}speedup_spread": None if self.spread is None else list(self.spread),
                f"{prefix}noisy": d["noisy"], f"{prefix}noisy_prompts": d["noisy_prompts"],
                f"{prefix}paired_prompts": d["prompts"]}


def paired_speedup(plain_before: Sequence[float], spec: Sequence[float],
                   plain_after: Sequence[float],
                   noise_tolerance: float = NOISE_TOLERANCE) -> PairedSpeed:
    """Speedup, spread and noise flag from per-prompt tokens/s (plain, speculative, plain).

    Raises:
        ValueError: the three lists differ in length, or ``noise_tolerance`` is negative.
    """
    if not len(plain_before) == len(spec) == len(plain_after):
        raise ValueError(f"one tokens/s per prompt in each list: got {len(plain_before)}, "
                         f"{len(spec)}, {len(plain_after)}")
    if not float(noise_tolerance) >= 0:
        raise ValueError(f"noise_tolerance must be >= 0, got {noise_tolerance}")
    paired = paired_runs(list(spec), [(a, b) for a, b in zip(plain_before, plain_after)])
    drift = [d for d, r in zip(paired.base_drift, paired.per_unit) if r is not None]
    noisy_prompts = sum(d > noise_tolerance for d in drift)
    return PairedSpeed(
        speedup=paired.median, spread=paired.spread,
        noisy=noisy_prompts > NOISY_SHARE * len(drift) if drift else None,
        noisy_prompts=noisy_prompts, prompts=len(paired.ratios), ratios=paired.ratios,
        plain_drift=drift)


def from_timings(prompts: Sequence[dict], noise_tolerance: float = NOISE_TOLERANCE) -> PairedSpeed:
    """:func:`paired_speedup` of a runner's per-prompt records (``plain_s`` and
    ``plain_tokens``: the two plain runs; ``spec_s``, ``spec_tokens``)."""
    def tps(tokens: float, seconds: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0

    return paired_speedup([tps(p["plain_tokens"][0], p["plain_s"][0]) for p in prompts],
                          [tps(p["spec_tokens"], p["spec_s"]) for p in prompts],
                          [tps(p["plain_tokens"][1], p["plain_s"][1]) for p in prompts],
                          noise_tolerance)


def best_draft_length(speed_by_k: dict[int, PairedSpeed]) -> int | None:
    """The draft length with the highest paired speedup (None: none measured)."""
    measured = {k: s.speedup for k, s in speed_by_k.items() if s.speedup is not None}
    return max(measured, key=measured.get) if measured else None
