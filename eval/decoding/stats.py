"""The decoder's fixed return type: acceptance and timing statistics of one or more decodes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple


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
