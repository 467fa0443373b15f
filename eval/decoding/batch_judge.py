"""The batch's own fallback: whether a batch of rows speculates this round or takes a plain step.

Each row of a :class:`~eval.decoding.batch.BatchDecoder` has a K controller that judges its own
rounds, but the rows share every verification: a row whose drafts keep being accepted keeps the
block wide, and the rows that fell back pay that width for one token each. Whether speculation
pays is the batch's question: the tokens all rows commit per second in speculative rounds
against a plain step of the batch.

:class:`BatchJudge` asks it with the fallback test of batch one
(:meth:`~eval.decoding.k_controller.KController.is_loss`, a one-sided test on tokens per round
against the round's cost in plain steps), fed the batch's rounds: a round's tokens are the mean
over its rows of the tokens each committed (a row that drafted nothing commits one), its cost is
its drafting and verification time, and a plain step is a round in which no row drafted, timed
whole (the drafter kept in step with the committed tokens included). Plain steps are measured,
not guessed: before the first decision (after ``min_steps`` speculative rounds) and again after
every ``plain_every`` speculative rounds the batch takes one. While fallen back the batch takes
plain steps and probes as batch one does (``probe_every`` steps, doubling after failed probes).

Losslessness is untouched: a plain step is the target's own token for every row.
(``tests/eval/test_batch_judge.py``.)
"""
from __future__ import annotations

from draftsmith.eval.decoding.k_controller import KController

PLAIN_EVERY = 32  # speculative rounds between two measured plain steps of the batch


class BatchJudge:
    """The batch's fallback (see the module docstring); ``k``: the batch's draft length."""

    def __init__(self, k: int, plain_every: int = PLAIN_EVERY) -> None:
        self.ctrl = KController(max(k, 1), adaptive=False, fallback=True)
        self.plain_every = plain_every
        self.since_plain = 0  # speculative rounds since the last plain step
        self.plain_rounds = 0  # plain steps the judge asked for (measurements and fallbacks)

    def speculates(self) -> bool:
        """Whether the batch drafts this round (False: every row takes a plain step)."""
        if self.ctrl.next_k() == 0:  # fallen back: a plain stretch
            self.plain_rounds += 1
            return False
        measured = bool(self.ctrl.plain_times)
        due = len(self.ctrl.history) + 1 >= self.ctrl.min_steps and not measured
        if due or (measured and self.since_plain >= self.plain_every):
            self.plain_rounds += 1
            return False
        return True

    def record(self, depths: list[int], nodes: list[int], committed: list[int],
               t_draft: float, t_verify: float) -> None:
        """One round of the batch: per row its draft depth, drafted nodes and committed tokens;
        the round's drafting and verification seconds."""
        if max(depths) == 0:
            self.ctrl.record_plain(t_draft + t_verify)
            self.since_plain = 0
            return
        self.since_plain += 1
        tokens = sum(committed) / len(committed)
        self.ctrl.record(max(depths), max(nodes), tokens - 1, tokens, t_draft, t_verify)
