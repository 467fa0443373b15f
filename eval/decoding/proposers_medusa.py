"""Medusa heads as a proposer: a static tree of candidates from the top-k of each head."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.proposers import Proposer, fit_vocab
from draftsmith.eval.decoding.target_model import TargetOutput


def medusa_choices(branching: Sequence[int]) -> list[tuple[int, ...]]:
    """Tree paths as rank tuples: depth ``d`` nodes take the top ``branching[d-1]`` tokens of head
    ``d-1`` under every kept parent (a Cartesian product), in topological order."""
    if not branching or any(int(b) < 1 for b in branching):
        raise ValueError("branching must be a non-empty list of positive ints, "
                         f"got {list(branching)}")
    out: list[tuple[int, ...]] = []
    for depth in range(1, len(branching) + 1):
        out.extend(itertools.product(*[range(int(b)) for b in branching[:depth]]))
    return out


class MedusaProposer(Proposer):
    """Medusa heads: a static tree of candidates from the top-k of each head.

    Head ``i`` applied to the target's final hidden state at the last committed position predicts
    the token ``i + 1`` places after the pending one. Candidates are deterministic top-k choices,
    so each node's ``q`` is a point mass and verification stays lossless.

    Args:
        heads: module with ``forward(hidden (B, T, H)) -> logits (B, T, N_heads, V)``; heads
            sharing the target's LM head (``lm_head="shared"``) must have it attached.
        vocab_size: the target's vocabulary size.
        choices: tree paths as rank tuples (see :func:`medusa_choices`); default ``(4, 2, 2, 1)``.

    Raises:
        ValueError: the heads share the target's LM head and it is not attached.
    """

    name = "medusa"

    @classmethod
    def for_draft(cls, heads: nn.Module, head_config: Any, vocab_size: int, settings: Any,
                  vocab_ids: torch.Tensor | None = None) -> MedusaProposer:
        """Medusa heads drafting the static tree of ``settings.options["medusa_branching"]``, or a
        chain (one candidate per head) when ``settings.tree`` is off."""
        branching = (settings.options["medusa_branching"] if settings.tree
                     else [1] * int(head_config.num_heads))
        return cls(heads, vocab_size, medusa_choices(list(branching)))

    def __init__(self, heads: nn.Module, vocab_size: int,
                 choices: Sequence[tuple[int, ...]] | None = None) -> None:
        if not getattr(heads, "target_attached", True):
            raise ValueError("these Medusa heads share the target's LM head, which is not "
                             "attached: load the draft with its target (load_package(..., "
                             "target=...)) or call heads.attach_target(target_model)")
        self.heads = heads
        self.vocab_size = vocab_size
        choices = list(choices) if choices is not None else medusa_choices((4, 2, 2, 1))
        self.choices = sorted({tuple(int(r) for r in c) for c in choices},
                              key=lambda c: (len(c), c))
        self.tree = len(self.choices) > max(len(c) for c in self.choices)  # not one path
        missing = [c for c in self.choices if len(c) > 1 and c[:-1] not in set(self.choices)]
        if missing:
            raise ValueError(f"medusa choices {missing[:3]} lack their parent paths; every prefix "
                             "of a choice must also be a choice")
        self.hidden: torch.Tensor | None = None

    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        self.hidden = target_out.hidden[-1]

    @torch.inference_mode()
    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        if k <= 0 or self.hidden is None:
            return Proposal.empty()
        logits = self.heads(self.hidden.view(1, 1, -1))[0, 0].float()  # (N_heads, V)
        depth = min(k, logits.shape[0])
        chosen = [c for c in self.choices if len(c) <= depth]
        if not chosen:
            return Proposal.empty()
        max_rank = max(max(c) for c in chosen) + 1
        top = torch.topk(fit_vocab(logits[:depth], self.vocab_size), max_rank, dim=-1).indices
        index = {c: j for j, c in enumerate(chosen)}
        tokens = [int(top[len(c) - 1, c[-1]]) for c in chosen]
        parents = [index[c[:-1]] if len(c) > 1 else -1 for c in chosen]
        return Proposal(torch.tensor(tokens, dtype=torch.long),
                        torch.tensor(parents, dtype=torch.long))

    def accept(self, path: list[int], new_tokens: list[int], target_out: TargetOutput) -> None:
        self.hidden = target_out.hidden[-1]
