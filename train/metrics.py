"""Training-time estimates of speculative acceptance, per draft position.

For one draft position, with target p and draft q warped at the same temperature, speculative
sampling accepts a drafted token with probability ``sum_v min(p_v, q_v)``; at temperature 0
(greedy) it accepts iff the two argmaxes agree. With a reduced draft vocabulary the teacher is
restricted to the draft ids *without* renormalising, so these numbers are the true acceptance
rates of that draft.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from draftsmith.train.teacher_probs import teacher_log_probs


def expected_acceptance(p: Tensor, q: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked positions of ``sum_v min(p, q)``.

    Args:
        p: (B, T, V) target probabilities.
        q: (B, T, V) draft probabilities.
        mask: (B, T) bool.

    Returns:
        Scalar tensor (0 when the mask is empty).
    """
    mask = mask.bool()
    acc = torch.minimum(p, q).sum(-1)  # (B, T)
    return torch.where(mask, acc, 0.0).sum() / mask.sum().clamp(min=1)


def top1_agreement(p: Tensor, q: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked positions of ``argmax p == argmax q`` (greedy acceptance).

    Args:
        p: (B, T, V) target probabilities or logits.
        q: (B, T, V) draft probabilities or logits (same vocabulary as p).
        mask: (B, T) bool.

    Returns:
        Scalar float tensor.
    """
    mask = mask.bool()
    agree = (p.argmax(-1) == q.argmax(-1)) & mask
    return agree.sum().float() / mask.sum().clamp(min=1)


class AcceptanceStats(NamedTuple):
    """Sums over masked positions, ready to all-reduce across processes.

    Attributes:
        alpha_sum: sum of ``sum_v min(p, q)`` (at temperature 0: of top-1 agreement).
        top1_sum: number of positions whose draft argmax is the target's argmax.
        count: number of masked positions.
    """

    alpha_sum: Tensor
    top1_sum: Tensor
    count: Tensor

    @property
    def alpha(self) -> float:
        return float(self.alpha_sum / self.count.clamp(min=1))

    @property
    def top1(self) -> float:
        return float(self.top1_sum / self.count.clamp(min=1))


@torch.no_grad()
def acceptance_stats(draft_logits: Tensor, mask: Tensor, teacher_hidden: Tensor | None = None,
                     lm_head_weight: Tensor | None = None, teacher_logits: Tensor | None = None,
                     temperature: float = 1.0, draft_to_target: Tensor | None = None,
                     chunk_size: int = 256, softcap: float | None = None) -> AcceptanceStats:
    """Expected acceptance and top-1 agreement of one draft position, over its masked rows in
    chunks: only the counted positions are scored, ``chunk_size`` of them at a time, so the
    teacher's full-vocabulary log-probabilities never exceed (chunk_size, V) whatever the batch
    (a (B, T) chunk of a 152k vocabulary held gigabytes in validation).

    Args:
        draft_logits: (B, T, V_draft).
        mask: (B, T) bool.
        teacher_hidden: (B, T, H) with ``lm_head_weight`` (V, H), or ``teacher_logits`` (B, T, V).
        temperature: sampling temperature for both (0 = greedy: alpha is top-1 agreement).
        draft_to_target: (V_draft,) long target id of each draft id (reduced vocabulary).
        chunk_size: masked positions per chunk.
        softcap: the target's final logit soft-cap (hidden-state teachers), or None.

    Returns:
        ``AcceptanceStats`` of sums over masked positions.
    """
    if (teacher_hidden is None) == (teacher_logits is None):
        raise ValueError("give exactly one of teacher_hidden (+ lm_head_weight) or teacher_logits")
    if teacher_hidden is not None and lm_head_weight is None:
        raise ValueError("teacher_hidden needs lm_head_weight (V, H)")
    teacher = teacher_hidden if teacher_hidden is not None else teacher_logits
    mask = mask.bool()
    b_idx, t_idx = mask.nonzero(as_tuple=True)  # the counted rows, gathered a chunk at a time
    alpha = torch.zeros((), device=draft_logits.device)
    top1 = torch.zeros((), device=draft_logits.device)
    tau = temperature if temperature > 0 else 1.0
    for r0 in range(0, b_idx.shape[0], chunk_size):
        rows = b_idx[r0:r0 + chunk_size], t_idx[r0:r0 + chunk_size]
        log_p = teacher_log_probs(teacher[rows], tau, lm_head_weight, None,
                                  softcap=softcap)  # (c, V)
        q_logits = draft_logits[rows].float()
        draft_top = q_logits.argmax(-1)
        if draft_to_target is not None:
            draft_top = draft_to_target[draft_top]
        agree = (draft_top == log_p.argmax(-1)).sum()
        top1 = top1 + agree
        if temperature == 0:
            alpha = alpha + agree
            continue
        if draft_to_target is not None:
            log_p = log_p[..., draft_to_target]  # restricted, not renormalised
        q = torch.softmax(q_logits / temperature, dim=-1)
        alpha = alpha + torch.minimum(log_p.exp(), q).sum()
    return AcceptanceStats(alpha, top1, mask.sum().float())
