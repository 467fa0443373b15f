"""Distillation losses between a teacher p (the target) and a student q (a draft).

All losses are ``nn.Module``s with the same call::

    loss = L(student_logits, teacher_logits, mask)
    loss = L(student_logits, None, mask, teacher_hidden=h, lm_head_weight=W, draft_to_target=d2t)
    loss = L(student_logits, None, mask, teacher_logp=rows, teacher_logp_index=idx, recompute=True)

* ``student_logits`` (B, T, V_draft); ``mask`` (B, T) bool: entries with False are ignored
  (there is no ignore_index; padding and non-assistant positions are masked out); None = all.
* The teacher is given either as logits (B, T, V), as final hidden states (B, T, H) plus the
  frozen LM head weight (V, H), or as log-probabilities (B, T, V_draft), possibly as distinct
  rows (R, V_draft) with each entry's row (``shared_teacher_rows``). Hidden states are evaluated
  in chunks of ``chunk_size`` positions along T (with activation checkpointing under autograd),
  so at most (B, chunk, V) teacher probabilities exist at a time, in forward and in backward;
  ``recompute=True`` checkpoints the chunks of the other forms too, so that nothing
  vocabulary-wide is kept for backward (the recipe asks for it past
  ``train.teacher_logits_budget``: a 262k-token vocabulary's fp32 tensors for every chunk of
  every draft position would be several GiB).
* Temperature: ``p = softmax(z_p / temperature)`` and ``q = softmax(z_q / temperature)``; no
  ``temperature**2`` factor is applied.
* The result is the mean over masked entries (0 when the mask is empty).

Reduced draft vocabulary (``draft_to_target`` (V_draft,) long, the target id of each draft id):
the teacher is restricted to the draft ids. With ``renormalize=False`` (default) the teacher
probabilities of the draft ids are taken from the full-vocabulary softmax and *not*
renormalised, so the mass on ids the draft cannot propose counts as loss; TVD is then exactly the
rejection rate of speculative sampling with that draft. With ``renormalize=True`` the teacher is
the softmax over the draft ids only (a proper distribution; the outside mass is ignored).

``feature_regression`` is EAGLE's other term: smooth-L1 between the draft's predicted features
and the target's hidden states (the recipe adds it with weight ``draft.feature_weight``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from draftsmith.data import teacher as data_teacher
from draftsmith.train.teacher_probs import target_to_draft_index, teacher_log_probs

LOSS_TERMS = ("fkl", "rkl", "tvd", "jsd", "ce", "ce_data")  # the config validator reads these


class _ForwardKL(torch.autograd.Function):
    """Row-wise KL(p || q) with q = softmax(z / T), its gradient written out by hand.

    Forward: sum_v p log p - sum_v p log q; backward: dz = g ((sum_v p) q - p) / T, from the q
    kept by the forward. Autograd through ``log_softmax`` would keep and traverse several more
    (N, V) temporaries and exponentiate again in backward; on a CPU these vocabulary-wide passes,
    not the matmuls, dominated a distillation step. ``p`` may be restricted (sum below 1).
    """

    @staticmethod
    def forward(ctx, z: Tensor, log_p: Tensor, temperature: float) -> Tensor:  # (N, V) -> (N,)
        zt = data_teacher.scale_logits(z, temperature)
        if zt.data_ptr() == z.data_ptr():
            zt = zt.clone()  # overwritten in place below
        p = log_p.exp()
        mass = p.sum(-1, keepdim=True)  # (N, 1); 1 unless the teacher is restricted
        cross = torch.linalg.vecdot(p, log_p) - torch.linalg.vecdot(p, zt)  # (N,)
        zmax = zt.amax(dim=-1, keepdim=True)
        q = zt.sub_(zmax).exp_()
        total = q.sum(-1, keepdim=True)
        q.div_(total)  # softmax(z / T), kept for backward
        kl = cross + (mass * (zmax + total.log())).squeeze(-1)  # log q = z / T - zmax - log total
        ctx.save_for_backward(q, p, mass)
        ctx.temperature, ctx.z_dtype = temperature, z.dtype
        return kl

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, p, mass = ctx.saved_tensors
        dz = q.mul(mass).sub_(p).mul_(grad[:, None] / ctx.temperature)
        return dz.to(ctx.z_dtype), None, None


def fused_forward_kl(student_logits: Tensor, log_p: Tensor, temperature: float = 1.0) -> Tensor:
    """(..., V) student logits, (..., V) teacher log-probs -> (...) KL(p || softmax(z / T))."""
    shape = student_logits.shape[:-1]
    v = student_logits.shape[-1]
    return _ForwardKL.apply(student_logits.reshape(-1, v), log_p.reshape(-1, v),
                            float(temperature)).reshape(shape)


# ----- pointwise terms: (N, V) log p, (N, V) log q -> (N,) ----------------------------------
def forward_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum_v p (log p - log q)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(q || p) = sum_v q (log q - log p)."""
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def tvd(log_p: Tensor, log_q: Tensor) -> Tensor:
    """1 - sum_v min(p, q): total variation for normalised p, q; the rejection rate."""
    return 1.0 - torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def generalized_jsd(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    """beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q."""
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * forward_kl(log_p, log_m) + (1 - beta) * forward_kl(log_q, log_m)


def _check_inputs(student_logits: Tensor, mask: Tensor, teacher_logits: Tensor | None,
                  teacher_hidden: Tensor | None, lm_head_weight: Tensor | None,
                  teacher_logp: Tensor | None = None) -> Tensor:
    given = [t for t in (teacher_logits, teacher_hidden, teacher_logp) if t is not None]
    if len(given) != 1:
        raise ValueError("give the teacher exactly one way: either as teacher_logits (B, T, V), "
                         "as teacher_hidden (B, T, H) with lm_head_weight (V, H), or as "
                         "teacher_logp (B, T, V_draft)")
    if teacher_hidden is not None and lm_head_weight is None:
        raise ValueError("teacher_hidden needs lm_head_weight (V, H), the target's LM head")
    teacher = given[0]
    if student_logits.dim() != 3 or mask.shape != student_logits.shape[:2]:
        raise ValueError(f"student_logits must be (B, T, V) and mask (B, T); got "
                         f"{tuple(student_logits.shape)} and {tuple(mask.shape)}")
    if teacher.shape[:2] != mask.shape:
        raise ValueError(f"teacher {tuple(teacher.shape)} and mask {tuple(mask.shape)} disagree "
                         "on (B, T)")
    return teacher


class DistillLoss(nn.Module):
    """Weighted mix of distillation terms, sharing one teacher pass per chunk.

    Terms (keys of ``weights``): ``fkl`` KL(p||q), ``rkl`` KL(q||p), ``tvd``
    1 - sum min(p, q), ``jsd`` generalised JSD with ``beta``, ``ce`` -log q(argmax p),
    ``ce_data`` -log q(label) on the data token (skipping entries whose label is outside a
    reduced draft vocabulary). EAGLE's feature regression is a separate function,
    ``feature_regression``, on the draft's features rather than its logits.

    Args:
        weights: term name -> weight (terms with weight 0 are skipped).
        temperature: distillation temperature for teacher and student (> 0).
        beta: beta of the generalised JSD, in (0, 1).
        renormalize: restricted-teacher choice for a reduced draft vocabulary (module doc).
        chunk_size: positions along T per teacher chunk.
        fused: compute ``fkl`` with ``fused_forward_kl`` (hand-written gradient); False uses
            autograd through ``log_softmax`` (the reference it is tested against).
        softcap: the target's final logit soft-cap for teachers given as hidden states (the
            recipe passes ``data.teacher.logit_softcap(target config)``), or None.
    """

    def __init__(self, weights: dict[str, float], temperature: float = 1.0,
                 beta: float = 0.5, renormalize: bool = False, chunk_size: int = 256,
                 fused: bool = True, softcap: float | None = None) -> None:
        super().__init__()
        unknown = set(weights) - set(LOSS_TERMS)
        if unknown:
            raise ValueError(f"unknown loss terms {sorted(unknown)}; allowed: {LOSS_TERMS}")
        if not any(float(w) != 0 for w in weights.values()):
            raise ValueError("DistillLoss needs at least one term with a non-zero weight")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < beta < 1:
            raise ValueError(f"JSD beta must be in (0, 1), got {beta}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.weights = {k: float(v) for k, v in weights.items() if float(v) != 0}
        self.temperature = float(temperature)
        self.jsd_beta = float(beta)
        self.renormalize = renormalize
        self.chunk_size = chunk_size
        self.fused = bool(fused)
        self.softcap = float(softcap) if softcap else None

    def forward(self, student_logits: Tensor, teacher_logits: Tensor | None = None,
                mask: Tensor | None = None, *, teacher_hidden: Tensor | None = None,
                lm_head_weight: Tensor | None = None, draft_to_target: Tensor | None = None,
                labels: Tensor | None = None, teacher_logp: Tensor | None = None,
                teacher_logp_index: Tensor | None = None,
                recompute: bool | None = None) -> Tensor:
        """Scalar weighted loss; arguments as in ``forward_with_parts``."""
        return self.forward_with_parts(
            student_logits, teacher_logits, mask, teacher_hidden=teacher_hidden,
            lm_head_weight=lm_head_weight, draft_to_target=draft_to_target, labels=labels,
            teacher_logp=teacher_logp, teacher_logp_index=teacher_logp_index,
            recompute=recompute)[0]

    def forward_with_parts(self, student_logits: Tensor, teacher_logits: Tensor | None = None,
                           mask: Tensor | None = None, *, teacher_hidden: Tensor | None = None,
                           lm_head_weight: Tensor | None = None,
                           draft_to_target: Tensor | None = None, labels: Tensor | None = None,
                           teacher_logp: Tensor | None = None,
                           teacher_logp_index: Tensor | None = None,
                           recompute: bool | None = None
                           ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted loss and its parts.

        Args:
            student_logits: (B, T, V_draft).
            teacher_logits: (B, T, V) or None.
            mask: (B, T) bool, entries that count; None counts every entry.
            teacher_hidden: (B, T, H) or None (then ``lm_head_weight`` (V, H) is required).
            lm_head_weight: (V, H) the target's LM head.
            draft_to_target: (V_draft,) long, for a reduced draft vocabulary.
            labels: (B, T) long target ids (for ``ce_data``).
            teacher_logp: (B, T, V_draft) teacher log-probabilities already at this
                temperature and restricted to the draft vocabulary (``shared_teacher_log_probs``);
                replaces ``teacher_logits`` / ``teacher_hidden``. With ``teacher_logp_index``:
                (R, V_draft) distinct teacher rows (``shared_teacher_rows``).
            teacher_logp_index: (B, T) long, the row of ``teacher_logp`` (R, V_draft) holding
                each entry's teacher; rows are gathered chunk by chunk (no (B, T, V_draft) copy).
            recompute: keep nothing vocabulary-wide for backward: every chunk is recomputed in
                backward (activation checkpointing), so at most one chunk's (B, chunk, V)
                tensors exist at a time, at the cost of a second pass over them. None: only when
                the teacher comes from ``teacher_hidden`` (its logits are recomputed anyway).

        Returns:
            ``(total, parts)``: scalar weighted sum, and each unweighted term (detached).
        """
        if mask is None:
            mask = torch.ones(student_logits.shape[:2], dtype=torch.bool,
                              device=student_logits.device)
        rows_logp = None  # (R, V_draft) teacher rows that teacher_logp_index points into
        if teacher_logp_index is not None:
            if teacher_logp is None or teacher_logp.dim() != 2:
                got = None if teacher_logp is None else tuple(teacher_logp.shape)
                raise ValueError("teacher_logp_index needs teacher_logp as (R, V_draft) rows "
                                 f"(shared_teacher_rows), got {got}")
            rows_logp, teacher_logp = teacher_logp, teacher_logp_index  # chunks carry indices
        teacher = _check_inputs(student_logits, mask, teacher_logits, teacher_hidden,
                                lm_head_weight, teacher_logp)
        mask = mask.bool()
        terms = list(self.weights)
        inv = self._label_index(labels, draft_to_target)
        labels_t = labels if labels is not None else torch.zeros_like(mask, dtype=torch.long)
        given_log_p = teacher_logp is not None

        def chunk_fn(s: Tensor, t: Tensor, m: Tensor, lab: Tensor) -> Tensor:
            if given_log_p:
                log_p = t if rows_logp is None else rows_logp[t]
            else:
                with torch.no_grad():
                    log_p = teacher_log_probs(t, self.temperature, lm_head_weight,
                                              draft_to_target, self.renormalize, self.softcap)
            return self._chunk_sums(s, log_p, m, lab, inv)

        sums = torch.zeros(len(terms) + ("ce_data" in terms), device=student_logits.device)
        # torch.split (not slicing): its backward concatenates the chunk gradients once
        # instead of materialising a full-size zero gradient per chunk. Chunks are
        # recomputed in backward (checkpointed) on the memory-bounded paths: the teacher from
        # hidden states through the LM head, or when the caller asks (``recompute``).
        cs = self.chunk_size
        if recompute is None:
            recompute = teacher_hidden is not None
        recompute = bool(recompute) and torch.is_grad_enabled() and student_logits.requires_grad
        for args in zip(student_logits.split(cs, 1), teacher.split(cs, 1), mask.split(cs, 1),
                        labels_t.split(cs, 1)):
            if not bool(args[2].any()):
                continue
            if recompute:
                sums = sums + checkpoint(chunk_fn, *args, use_reentrant=False)
            else:
                sums = sums + chunk_fn(*args)
        return self._weighted(sums, mask.sum().clamp(min=1).float(), student_logits)

    def _label_index(self, labels: Tensor | None,
                     draft_to_target: Tensor | None) -> Tensor | None:
        """For ``ce_data`` over a reduced draft vocabulary: each target id's draft id (-1 where
        it has none), else None."""
        if "ce_data" not in self.weights:
            return None
        if labels is None:
            raise ValueError("the ce_data term needs labels (B, T) of target ids")
        if draft_to_target is None:
            return None
        # sized from the ids: a teacher given as teacher_logp does not tell the target's
        # vocabulary size
        vocab = int(torch.cat([draft_to_target, labels.flatten()]).max()) + 1
        return target_to_draft_index(draft_to_target, vocab)

    def _chunk_sums(self, s: Tensor, log_p: Tensor, m: Tensor, lab: Tensor,
                    inv: Tensor | None) -> Tensor:
        """One chunk's sums over its counted entries, a sum per term (``ce_data``: the sum and
        its count), from the student logits ``s`` and the teacher's ``log_p``."""
        log_q = None
        if not self.fused or any(name != "fkl" for name in self.weights):
            log_q = torch.log_softmax(data_teacher.scale_logits(s, self.temperature), dim=-1)
        out = []
        for name in self.weights:
            if name == "ce_data":
                ids = inv[lab] if inv is not None else lab
                ok = m & (ids >= 0)
                v = -log_q.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                out += [torch.where(ok, v, 0.0).sum(), ok.sum().float()]
            else:
                out.append(torch.where(m, self._term(name, s, log_p, log_q), 0.0).sum())
        return torch.stack(out)

    def _term(self, name: str, s: Tensor, log_p: Tensor, log_q: Tensor | None) -> Tensor:
        """One term per entry (not ``ce_data``)."""
        if name == "fkl":
            return (fused_forward_kl(s, log_p, self.temperature) if self.fused
                    else forward_kl(log_p, log_q))
        if name == "rkl":
            return reverse_kl(log_p, log_q)
        if name == "tvd":
            return tvd(log_p, log_q)
        if name == "jsd":
            return generalized_jsd(log_p, log_q, self.jsd_beta)
        return -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)  # ce

    def _weighted(self, sums: Tensor, n: Tensor,
                  like: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The terms' means (over the ``n`` counted entries; ``ce_data`` over its own count)
        and their weighted sum."""
        parts: dict[str, Tensor] = {}
        total = like.new_zeros((), dtype=torch.float32)
        i = 0
        for name in self.weights:
            if name == "ce_data":
                value = sums[i] / sums[i + 1].clamp(min=1)
                i += 2
            else:
                value = sums[i] / n
                i += 1
            parts[name] = value.detach()
            total = total + self.weights[name] * value
        return total, parts


def feature_regression(pred: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Smooth-L1 (beta 1) between predicted and target features, averaged over H and then over
    masked entries: EAGLE's regression of the target's next hidden state.

    Args:
        pred: (B, T, H) the draft's predicted features.
        target: (B, T, H) the target's hidden states for the same entries.
        mask: (B, T) bool, entries that count.

    Returns:
        Scalar float32 tensor (0 when the mask is empty).
    """
    if pred.shape != target.shape or pred.shape[:2] != mask.shape:
        raise ValueError(f"pred {tuple(pred.shape)}, target {tuple(target.shape)} and mask "
                         f"{tuple(mask.shape)} must be (B, T, H), (B, T, H), (B, T)")
    per = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)  # (B, T)
    mask = mask.bool()
    return torch.where(mask, per, 0.0).sum() / mask.sum().clamp(min=1)
