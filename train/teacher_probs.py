"""The teacher's log-probabilities over the draft vocabulary, per entry or once per distinct row.

Hidden states go through ``data.teacher.teacher_logits``, the one implementation of the
teacher's logits (shared with the feature cache, which cannot import ``train/``). With a reduced
draft vocabulary (``draft_to_target`` (V_draft,) long, the target id of each draft id) the
teacher is restricted to the draft ids: taken from the full-vocabulary softmax and not
renormalised by default (the mass on other ids counts as loss), or with ``renormalize`` the
softmax over the draft ids only. The losses (``train/losses.py``), the metrics and the training
objective read the teacher through here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.data import teacher as data_teacher


def teacher_log_probs(teacher: Tensor, temperature: float, lm_head_weight: Tensor | None = None,
                      draft_to_target: Tensor | None = None, renormalize: bool = False,
                      softcap: float | None = None) -> Tensor:
    """Teacher log-probabilities over the draft vocabulary.

    Hidden states go through ``data.teacher.teacher_logits``, the one implementation of the
    teacher's logits (shared with the feature cache, which cannot import ``train/``).

    Args:
        teacher: (..., V) logits, or (..., H) hidden states when ``lm_head_weight`` is given.
        temperature: > 0.
        lm_head_weight: (V, H) frozen LM head, or None when ``teacher`` holds logits.
        draft_to_target: (V_draft,) long target id of each draft id, or None (same vocabulary).
        renormalize: with a reduced vocabulary, renormalise over the draft ids (module doc).
        softcap: the target's final logit soft-cap (``data.teacher.logit_softcap``) or None;
            applied to hidden-state teachers (logits given as ``teacher`` are taken as they are).

    Returns:
        (..., V_draft) float32 log-probabilities (not normalised when restricted without
        renormalising).
    """
    if lm_head_weight is not None:
        logits = data_teacher.teacher_logits(teacher, lm_head_weight, temperature, softcap)
    else:
        logits = data_teacher.scale_logits(teacher, temperature)
    if draft_to_target is None:
        return torch.log_softmax(logits, dim=-1)
    if renormalize:
        return torch.log_softmax(logits[..., draft_to_target], dim=-1)
    return torch.log_softmax(logits, dim=-1)[..., draft_to_target]


def target_to_draft_index(draft_to_target: Tensor, vocab_size: int) -> Tensor:
    """(V,) long: the draft id of each target id, -1 where the target id is not in the draft."""
    inv = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_to_target.device)
    inv[draft_to_target] = torch.arange(draft_to_target.numel(), device=draft_to_target.device)
    return inv


TEACHER_CHUNK_ELEMENTS = 1 << 26  # rows x vocabulary per teacher LM-head call (256 MiB fp32)


@torch.no_grad()
def shared_teacher_rows(hidden: Tensor, rows: list[Tensor], lm_head_weight: Tensor,
                        temperature: float, draft_to_target: Tensor | None = None,
                        renormalize: bool = False, chunk_size: int | None = None,
                        log_normalizer: Tensor | None = None,
                        softcap: float | None = None) -> tuple[Tensor, list[Tensor]]:
    """Teacher log-probabilities of the distinct rows several draft positions read, each row
    computed once, and where each position's entries find theirs.

    The teacher of draft position k at token t is the position-1 teacher of token t+k-1, so the
    positions of one batch read mostly the same rows of ``hidden``: the LM head and the
    vocabulary-wide softmax run once per distinct row instead of once per position, and the
    positions index the one (U, V_draft) result instead of holding copies of it.

    With ``log_normalizer`` (the feature cache's ``teacher_lse``: the teacher's ``logsumexp`` at
    temperature 1, computed when the cache was built) a reduced, not renormalised draft
    vocabulary needs only the draft's rows of the LM head: ``log p = lm_head[d2t](h) - lse``,
    with no vocabulary-wide logits or softmax (most of a training step's teacher cost).

    Args:
        hidden: (R, H) the batch's final hidden states, flattened over (B, T).
        rows: per draft position, (N_k,) long indices into ``hidden`` (``teacher_index``).
        lm_head_weight: (V, H) the target's frozen LM head.
        temperature: > 0.
        draft_to_target: (V_draft,) long, for a reduced draft vocabulary.
        renormalize: see the module docstring.
        chunk_size: distinct rows per LM-head call (bounds the (chunk, V) logits held at once);
            None: ``TEACHER_CHUNK_ELEMENTS // V`` rows.
        log_normalizer: (R,) float32 ``teacher_lse`` of each row of ``hidden``, or None. Used
            only where it is exact: temperature 1, a reduced vocabulary, no renormalising.
        softcap: the target's final logit soft-cap, or None.

    Returns:
        ``(log_p, index)``: (U, V_draft) float32 log-probabilities of the U distinct rows (as
        ``teacher_log_probs``), and per position the (N_k,) long row of ``log_p`` of each entry.
    """
    flat = torch.cat([r.reshape(-1) for r in rows])
    unique, inverse = torch.unique(flat, return_inverse=True)
    vocab = lm_head_weight.shape[0]
    if chunk_size is None:
        chunk_size = max(1, TEACHER_CHUNK_ELEMENTS // vocab)
    width = vocab if draft_to_target is None else draft_to_target.numel()
    log_p = torch.empty(unique.numel(), width, dtype=torch.float32, device=hidden.device)
    lse_path = (log_normalizer is not None and temperature == 1.0
                and draft_to_target is not None and not renormalize)
    rows_w = lm_head_weight[draft_to_target] if lse_path else None  # (V_draft, H): draft rows
    for start in range(0, unique.numel(), chunk_size):
        c = unique[start:start + chunk_size]
        if lse_path:
            log_p[start:start + c.numel()] = (data_teacher.teacher_logits(hidden[c], rows_w,
                                                                      softcap=softcap)
                                              - log_normalizer[c, None])
        else:
            log_p[start:start + c.numel()] = teacher_log_probs(
                hidden[c], temperature, lm_head_weight, draft_to_target, renormalize, softcap)
    return log_p, list(inverse.split([r.numel() for r in rows]))


@torch.no_grad()
def shared_teacher_log_probs(hidden: Tensor, rows: list[Tensor], lm_head_weight: Tensor,
                             temperature: float, draft_to_target: Tensor | None = None,
                             renormalize: bool = False, chunk_size: int | None = None,
                             log_normalizer: Tensor | None = None) -> list[Tensor]:
    """Per position, the (N_k, V_draft) float32 teacher log-probabilities of its entries
    (copies gathered from :func:`shared_teacher_rows`, whose arguments it takes)."""
    log_p, index = shared_teacher_rows(hidden, rows, lm_head_weight, temperature,
                                       draft_to_target, renormalize, chunk_size, log_normalizer)
    return [log_p[i] for i in index]
