"""The training objective of one micro-batch: the configured divergence between the draft and
its teacher at every draft position, weighted and summed (EAGLE's feature regression added).

The teacher comes from the cached hidden states through the target's frozen LM head, by one of
three paths, the cheapest that fits ``train.teacher_logits_budget``:

1. shared (``train.teacher_per_token``): the (U, V_draft) log-probabilities of the distinct rows
   every position reads, computed once for all positions (from the cache's log-normaliser when
   ``train.teacher_lse`` and the draft's vocabulary allow);
2. per position, the (N, V) teacher logits at once;
3. per position, the teacher recomputed inside the loss chunk by chunk (never all (N, V) held).

Over the budget, the loss also recomputes its chunks in backward instead of keeping them
(``train.memory.recompute_loss``). The recipe (``train/distill.py``) calls the objective once
per micro-batch.
"""
from __future__ import annotations

from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from draftsmith.data.teacher import teacher_logits
from draftsmith.train.losses import feature_regression
from draftsmith.train.memory import recompute_loss, shared_teacher_fits
from draftsmith.train.teacher_probs import shared_teacher_rows
from draftsmith.train.trainable import TrainableDraft


class DistillObjective:
    """The loss of a micro-batch for one run.

    Args:
        cfg: the run's config (read at each call: ``train.teacher_per_token``,
            ``train.teacher_logits_budget``, ``train.teacher_lse``, ``draft.feature_weight``).
        draft: the draft being trained (its ``module`` may be wrapped by accelerate later).
        lm_head: (V, H) the target's frozen LM-head weight, on the training device.
        softcap: the target's final logit soft-cap, or None.
        accelerator: the run's ``Accelerator`` (token counts are reduced over its processes).
    """

    def __init__(self, cfg: DictConfig, draft: TrainableDraft, lm_head: torch.Tensor,
                 softcap: float | None, accelerator: Any) -> None:
        self.cfg, self.draft, self.lm_head = cfg, draft, lm_head
        self.softcap, self.accelerator = softcap, accelerator
        self.loss_fn = hydra.utils.instantiate(cfg.loss, softcap=softcap)

    def __call__(self, batch: dict) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """Weighted loss over draft positions for one micro-batch.

        Each position's loss is a mean over its masked tokens *across all processes*: the local
        mean is rescaled by (local tokens / global tokens x processes), so after DDP/DeepSpeed
        average the gradients, N processes make the same update as one process on the union of
        their batches, whatever the padding.

        Returns:
            ``(loss, parts, n_tokens)``: the loss, the per-position local losses
            (``loss/pos{k}``) and the global count of position-1 tokens.
        """
        acc = self.accelerator
        outputs = self.draft.forward(batch)
        weights = self.draft.position_weights
        total = torch.zeros((), device=acc.device)
        parts: dict[str, float] = {}
        shared = self._shared_teacher(batch, outputs)
        # vocabulary-wide student logits over the budget: the loss keeps nothing of its chunks
        # for backward but recomputes them (at most one chunk's (rows, V) tensors alive)
        recompute = recompute_loss(sum(pos.draft_logits.numel() for pos in outputs),
                                   self.cfg.train.teacher_logits_budget)
        for k, pos in enumerate(outputs):
            lk = self._position_loss(pos, k, shared, recompute)
            if pos.draft_hidden is not None and self.cfg.draft.feature_weight > 0:
                feat = feature_regression(pos.draft_hidden, pos.teacher_hidden, pos.mask)
                lk = lk + self.cfg.draft.feature_weight * feat
            n_local = pos.mask.sum().float()
            n_global = acc.reduce(n_local.detach().clone(), reduction="sum").clamp(min=1)
            total = total + weights[k] * lk * (n_local / n_global * acc.num_processes)
            parts[f"loss/pos{k + 1}"] = float(lk.detach())
            if k == 0:
                n_tokens = n_global
        return total, parts, n_tokens

    def _position_loss(self, pos: Any, k: int,
                       shared: tuple[torch.Tensor, list[torch.Tensor]] | None,
                       recompute: bool) -> torch.Tensor:
        """The divergence at draft position ``k`` (0-based), by the teacher path that fits.

        Only the counted rows (assistant tokens, no padding) go through the loss: families return
        them packed as (1, N, ...), all counted.
        """
        student, labels, t_hidden = pos.draft_logits, pos.labels, pos.teacher_hidden
        d2t = self.draft.draft_to_target
        if student.shape[1] == 0:
            return student.sum() * 0.0
        if shared is not None:
            log_p, rows = shared
            return self.loss_fn(student, None, None, teacher_logp=log_p,
                                teacher_logp_index=rows[k][None], draft_to_target=d2t,
                                labels=labels, recompute=recompute)
        budget = self.cfg.train.teacher_logits_budget
        if not recompute and student.shape[1] * self.lm_head.shape[0] <= budget:
            teacher = teacher_logits(t_hidden, self.lm_head, softcap=self.softcap).detach()
            return self.loss_fn(student, teacher, None, draft_to_target=d2t, labels=labels)
        return self.loss_fn(student, None, None, teacher_hidden=t_hidden,
                            lm_head_weight=self.lm_head, draft_to_target=d2t, labels=labels)

    def _shared_teacher(self, batch: dict, outputs: list
                        ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The (U, V_draft) teacher log-probabilities of the distinct rows the positions read,
        each computed once (``train.teacher_per_token``), and per position the (N_k,) row of
        each counted entry; or None for the per-position path (that setting off, or the batch's
        (B*T, V_draft) log-probabilities over the budget)."""
        if not self.cfg.train.teacher_per_token:
            return None
        hidden = batch["hidden"].flatten(0, 1)  # (B*T, H): at most this many distinct rows
        d2t = self.draft.draft_to_target
        vocab = self.lm_head.shape[0] if d2t is None else d2t.numel()
        if not shared_teacher_fits(hidden.shape[0], vocab, self.cfg.train.teacher_logits_budget):
            return None
        rows = [pos.teacher_index[pos.mask] for pos in outputs]
        lse = batch.get("teacher_lse") if self.cfg.train.teacher_lse else None  # cache format 2
        return shared_teacher_rows(hidden, rows, self.lm_head, self.loss_fn.temperature, d2t,
                                   self.loss_fn.renormalize, None,
                                   None if lse is None else lse.flatten(), self.softcap)
