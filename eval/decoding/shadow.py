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
every ``every`` plain steps, is bounded by ``max_chains`` chains per watch.

The judgement runs both ways. While the draft drafts chains, each verified round adds its
outcome to the same counts (:meth:`Shadow.verified`: position ``i`` reached when the ``i - 1``
drafts before it were accepted, accepted when it was; at T > 0 the rejection-sampling test's
own outcome, whose expectation is the shadow's ``sum min(p, q)``), and every ``recheck`` rounds
after ``min_rounds`` the judge re-times them: predicted below 1.0, the draft stops and the shadow
watches again (a hybrid keeps drafting its suffix chains, :meth:`Proposer.pause`). A record's
acceptance comes from its own prompts (the Qwen2.5-Coder release's chain on MT-bench: 1.30x
predicted from ShareGPT's, 1.07x decoded); the run's own rounds say what it is on these (652
rounds of that chain: 1.14x predicted, 1.15x decoded; bench/judge/).
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
        min_chains: chains scored before the first verdict of a watch.
        max_chains: chains scored at most in one watch (then it stops, undecided or not).
        min_rounds: verified rounds counted before the draft's first verdict while drafting.
        recheck: verified rounds between those verdicts.
        watching: shadow drafting beside plain steps now (False: the draft drafts, or the
            shadow gave up).
    """

    depth: int
    judge: Judge
    margin: float = 1.1
    every: int = 2
    min_chains: int = 24
    max_chains: int = 160
    min_rounds: int = 32
    recheck: int = 16
    watching: bool = True
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    chains: int = 0  # chains scored
    rounds: int = 0  # verified rounds of the draft counted
    verdict: dict | None = None  # the last judgement (k, predicted speedup, switched)
    switches: list[dict] = field(default_factory=list)  # every start and stop of the draft
    _since: int = 0  # chains scored when this watch began
    _steps: int = 0
    _pending: list[tuple[int, list[int]]] = field(default_factory=list)  # (start, drafts)

    def __post_init__(self) -> None:
        if (self.depth < 1 or self.every < 1 or self.recheck < 1
                or not 1 <= self.min_chains <= self.max_chains):
            raise ValueError(f"shadow: need depth >= 1, every >= 1, recheck >= 1 and 1 <= "
                             f"min_chains <= max_chains, got {self.depth}, {self.every}, "
                             f"{self.recheck}, {self.min_chains}, {self.max_chains}")
        self.reached = [0.0] * self.depth
        self.accepted = [0.0] * self.depth

    def wants(self, budget: int) -> int:
        """Drafts for this plain step's shadow chain (0: none); ``budget``: tokens that can still
        be committed after this step's own."""
        if not self.watching:
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
        self._count(1, min(max(overlap, 0.0), 1.0))
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
            accepted = 0
            while accepted < len(seen) and drafts[accepted] == seen[accepted]:
                accepted += 1
            self._count(min(accepted + 1, len(seen)), accepted)
            self.chains += 1 if seen else 0
        self._pending = keep  # empty when final: every chain was scored

    def verified(self, drafts: int, accepted: float) -> bool:
        """Count a verified round of the draft's own chain of ``drafts`` drafts, ``accepted`` of
        them accepted; whether the draft should go on drafting (False: the judge, every
        ``recheck`` rounds after ``min_rounds``, predicts below 1.0, and the shadow watches
        again)."""
        self._count(min(int(accepted) + 1, drafts), accepted)
        self.rounds += 1
        if self.rounds < self.min_rounds or self.rounds % self.recheck:
            return True
        k, predicted = self.judge(self.alpha())
        self._judged(k, predicted, switched=predicted < 1.0, to="plain")
        if predicted >= 1.0:
            return True
        self.watching, self._since = True, self.chains
        return False

    def _count(self, reached: int, accepted: float) -> None:
        """Positions ``1..reached`` reached, the first ``accepted`` of them accepted (a
        fraction: the last one's acceptance probability)."""
        grow = reached - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for i in range(reached):
            self.reached[i] += 1.0
            self.accepted[i] += min(1.0, max(0.0, accepted - i))

    def alpha(self) -> list[float]:
        """Conditional acceptance per position, Laplace-smoothed, for the positions reached."""
        return [(a + 1.0) / (r + 2.0) for a, r in zip(self.accepted, self.reached) if r > 0]

    def decide(self) -> int:
        """While watching: the chain length to draft from now on (0: keep decoding plainly)."""
        watched = self.chains - self._since
        if not self.watching or watched < self.min_chains:
            return 0
        k, predicted = self.judge(self.alpha())
        switched = k > 0 and predicted >= self.margin
        self._judged(k, predicted, switched, to="draft")
        if switched or predicted < 1.0 or watched >= self.max_chains:
            self.watching = False
        return k if switched else 0

    def _judged(self, k: int, predicted: float, switched: bool, to: str) -> None:
        self.verdict = {"k": k, "predicted": round(predicted, 3), "chains": self.chains,
                        "rounds": self.rounds, "alpha": [round(a, 3) for a in self.alpha()],
                        "switched": switched}
        if switched:
            self.switches.append({**self.verdict, "to": to})

    def report(self) -> dict:
        """What the shadow measured and decided (a decode summary's ``shadow``)."""
        return {"chains": self.chains, "rounds": self.rounds,
                "alpha": [round(a, 3) for a in self.alpha()], "watching": self.watching,
                "verdict": self.verdict, "switches": self.switches}
