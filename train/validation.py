"""Validation acceptance of a draft on a held-back split: alpha-hat and top-1 agreement per draft
position. Training validates with it (``train/distill.py``), and ``scripts/peers_train.py``
scores every trainer's checkpoint with it, so that all figures come from one evaluator."""
from __future__ import annotations

from typing import Any

import torch

from draftsmith.train.runtime import make_epoch_loader


@torch.no_grad()
def validate_draft(draft: Any, val_set: Any, accelerator: Any, micro_batch_size: int,
                   eval_batches: int | None, temperature: float, lm_head: torch.Tensor,
                   softcap: float | None = None, own_batches: int | None = None) -> dict:
    """Per draft position of ``draft`` (a ``TrainableDraft``): the expected acceptance
    ``sum(min(p, q))`` (at temperature 0: top-1 agreement) and the top-1 agreement over the
    loss-masked positions of ``val_set``, in a fixed order, under ``accelerator.autocast()``,
    summed over processes.

    Args:
        eval_batches: micro-batches per process (None: the whole split).
        lm_head: (V, H) the target's LM head (the teacher's).
        own_batches: batches per rank of a machine-local cache (else None).

    Returns:
        ``{"alpha_hat": [...], "top1": [...], "tokens": N, "temperature": T}`` (N: the counted
        positions of the first draft position).
    """
    from draftsmith.train.metrics import acceptance_stats

    model = draft.module
    was_training = model.training
    model.eval()
    acc, sums = accelerator, None
    loader = make_epoch_loader(val_set, micro_batch_size, seed=0, epoch=0, shuffle=False,
                               accelerator=acc, drop_last=False, own_batches=own_batches)
    for i, batch in enumerate(loader):
        if eval_batches is not None and i >= eval_batches:
            break
        with acc.autocast():
            outputs = draft.forward(batch)
        stats = [acceptance_stats(pos.draft_logits, pos.mask, pos.teacher_hidden, lm_head,
                                  temperature=temperature,
                                  draft_to_target=draft.draft_to_target, softcap=softcap)
                 for pos in outputs]
        # (K, 3): per position, the sums of acceptance, of top-1 agreement and the count
        batch_sums = torch.stack([torch.stack(tuple(st)) for st in stats]).to(
            acc.device, torch.float64)
        sums = batch_sums if sums is None else sums + batch_sums
    model.train(was_training)
    if sums is None:
        sums = torch.zeros(draft.num_positions, 3, device=acc.device, dtype=torch.float64)
    sums = acc.reduce(sums, reduction="sum")
    n = sums[:, 2].clamp(min=1)
    return {"alpha_hat": (sums[:, 0] / n).tolist(), "top1": (sums[:, 1] / n).tolist(),
            "tokens": int(sums[0, 2].item()), "temperature": temperature}
