"""Shadow drafts: a draft's acceptance learnt on the requests at hand while decoding plainly.

A record measured on another machine is re-timed before decoding (``eval/retime.py``), and its
acceptance comes from its own prompts: where the prediction says plain decoding, the draft may
still pay on these prompts (the Qwen2.5-Coder release: 1.14x predicted from ShareGPT acceptance,
1.56x decoded on HumanEval). A shadow round drafts a short chain beside a plain step: the target
is fed the pending token alone, so the step costs and commits what a plain step does, and the
chain is scored afterwards against the tokens the target itself commits:

- at T = 0 a draft at position ``i`` is accepted when it and every draft before it equal the
  committed tokens: what verification would have accepted, counted exactly;
- at T > 0 position 1 is accepted with probability ``sum_x min(p(x), q(x))`` (``p`` the warped
  target distribution of the plain step, ``q`` the draft's), the expectation of the
  rejection-sampling test; the judge fills later positions from the record.

Once ``min_chains`` chains are scored, ``judge(alpha)`` (the record's shapes re-timed with these
alphas, :func:`eval.retime.shadow_judge`) names the best chain length and its predicted speedup.
At ``margin`` or above the decoder drafts that chain from then on, in this request and later ones;
below 1.0, or once ``max_chains`` chains were scored, the shadow stops. Its cost, one short draft
every ``every`` plain steps, is bounded by ``max_chains`` chains per decoder.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# the judge: measured alphas (conditional, per position) -> (best chain K, predicted speedup)
Judge = Callable[[list[float]], tuple[int, float]]


@dataclass
class Shadow:
    """Shadow drafting for one decoder (state kept across its requests).

    Args:
        depth: drafts per shadow chain (1 at T > 0: only position 1 is scored there).
        judge: see the module docstring.
        margin: predicted speedup at which drafting starts.
        every: a shadow chain every ``every`` plain steps.
        min_chains: chains scored before the first verdict.
        max_chains: chains scored at most (then the shadow stops, undecided or not).
    """

    depth: int
    judge: Judge
    margin: float = 1.1
    every: int = 2
    min_chains: int = 24
    max_chains: int = 160
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    chains: int = 0  # chains scored
    active: bool = True
    verdict: dict | None = None  # the last judgement (k, predicted speedup, switched)
    _steps: int = 0
    _pending: list[tuple[int, list[int]]] = field(default_factory=list)  # (start, drafts)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.every < 1 or not 1 <= self.min_chains <= self.max_chains:
            raise ValueError(f"shadow: need depth >= 1, every >= 1 and 1 <= min_chains <= "
                             f"max_chains, got {self.depth}, {self.every}, {self.min_chains}, "
                             f"{self.max_chains}")
        self.reached = [0.0] * self.depth
        self.accepted = [0.0] * self.depth

    def wants(self, budget: int) -> int:
        """Drafts for this plain step's shadow chain (0: none); ``budget``: tokens that can still
        be committed after this step's own."""
        if not self.active:
            return 0
        self._steps += 1
        if self._steps % self.every:
            return 0
        return max(0, min(self.depth, budget + 1))

    def drafted(self, start: int, drafts: list[int]) -> None:
        """A greedy chain whose first draft guesses the token committed at ``start``."""
        self._pending.append((start, list(drafts)))

    def sampled(self, p: torch.Tensor, q: torch.Tensor | None, draft: int) -> None:
        """Score a sampled chain's first draft ``draft`` at once: ``p (V,)`` the plain step's
        warped target distribution, ``q (V,)`` the draft's (None: a point mass on ``draft``)."""
        overlap = float(p[draft]) if q is None else float(torch.minimum(p, q.to(p)).sum())
        self.reached[0] += 1.0
        self.accepted[0] += min(max(overlap, 0.0), 1.0)
        self.chains += 1

    def score(self, generated: list[int], final: bool = False) -> None:
        """Score the greedy chains whose tokens are all committed (``final``: the request ended,
        score what was committed)."""
        keep = []
        for start, drafts in self._pending:
            seen = generated[start:start + len(drafts)]
            if len(seen) < len(drafts) and not final:
                keep.append((start, drafts))
                continue
            for i, token in enumerate(seen):
                self.reached[i] += 1.0
                if drafts[i] != token:
                    break
                self.accepted[i] += 1.0
            self.chains += 1 if seen else 0
        self._pending = keep  # empty when final: every chain was scored

    def alpha(self) -> list[float]:
        """Conditional acceptance per position, Laplace-smoothed, for the positions reached."""
        return [(a + 1.0) / (r + 2.0) for a, r in zip(self.accepted, self.reached) if r > 0]

    def decide(self) -> int:
        """The chain length to draft from now on (0: keep decoding plainly)."""
        if not self.active or self.chains < self.min_chains:
            return 0
        alpha = self.alpha()
        k, predicted = self.judge(alpha)
        switched = k > 0 and predicted >= self.margin
        self.verdict = {"k": k, "predicted": round(predicted, 3), "chains": self.chains,
                        "alpha": [round(a, 3) for a in alpha], "switched": switched}
        if switched or predicted < 1.0 or self.chains >= self.max_chains:
            self.active = False
        return k if switched else 0

    def report(self) -> dict:
        """What the shadow measured and decided (a decode summary's ``shadow``)."""
        return {"chains": self.chains, "alpha": [round(a, 3) for a in self.alpha()],
                "active": self.active, "verdict": self.verdict}
