"""SpecForge's own EAGLE-3 trainer on a CPU; run inside the specforge environment.

    SPECFORGE_DEVICE=cpu FSDP_SHARDING=NO_SHARD \
    <engines>/specforge/bin/python scripts/engine_runners/specforge_train.py STATS.json \
        EXPORT_DIR THREADS -- train --config run.yaml

The trainer is SpecForge 0.2.0's own entry point (``specforge.cli.main``, what ``specforge
train --config run.yaml`` runs: one in-process worker on gloo), under its documented CPU
switches ``SPECFORGE_DEVICE=cpu`` and ``FSDP_SHARDING=NO_SHARD``, with the smallest CPU wrapper
that lets it train, every patch listed here:

1. ``specforge/core/loss.py`` imports ``triton`` at module level: the ``triton`` wheel is
   installed in the environment (``scripts/engine_envs.py``) so that it imports; none of its
   kernels is launched.
2. The EAGLE-3 loss, ``LogSoftmaxLoss.apply(logits, target_p, position_mask)`` in
   ``specforge.algorithms.eagle3.model``, is a Triton GPU kernel: it is routed to
   :func:`kl_loss`, plain torch with autograd, which computes what SpecForge's own reference
   implementation beside the kernel (``specforge.core.loss._compute_loss``) computes.

Nothing else of SpecForge is changed: its data reader, collator, draft model, TTT unrolling,
teacher (``_compute_target_p``), optimizer (``BF16Optimizer``), scheduler, FSDP wrapper and
checkpoints run as they are (its ``torch.compile``'d helpers compile for the CPU). After
training, SpecForge's own exporter (``specforge export --to sglang``: ``export_to_sglang``)
writes the run's last checkpoint to EXPORT_DIR as the draft folder SGLang serves, which
``heads/peer_import.py`` reads.

Measured beside it, and written to STATS.json: ``trained_tokens``, the loss-masked positions of
the first unrolled step over every training forward (the batch's ``loss_mask`` after
SpecForge's own reader, which is the position mask of its first TTT step before it drops
positions whose teacher argmax lies outside the draft vocabulary); ``loss_positions``, the
positions its first step's loss actually counts (after that drop); ``train_loop_s``, the wall
time of ``TrainerController.fit`` (data loading, forward, backward, optimizer; model assembly,
the final checkpoint and the export excluded); ``steps``; ``version``; ``checkpoint`` (the
export). This file imports only SpecForge and torch.
"""
from __future__ import annotations

import json
import sys
import time

import torch


def kl_loss(logits: torch.Tensor, target_p: torch.Tensor,
            position_mask: torch.Tensor) -> torch.Tensor:
    """The EAGLE-3 step loss as SpecForge defines it, in plain torch (autograd gives the
    gradient its Triton kernel writes by hand: ``(softmax(logits) - target_p) * mask / (B*T)``
    for teacher rows that sum to 1).

    Args:
        logits: (B, T, V_draft) draft logits (any float dtype; computed in fp32).
        target_p: (B, T, V_draft) teacher probabilities over the draft vocabulary.
        position_mask: (B, T, 1) 0/1, the positions that count.

    Returns:
        () the cross-entropy ``-sum_v target_p * log_softmax(logits)`` of the counted
        positions, averaged over all ``B * T`` positions (uncounted ones add 0).
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    per_position = (target_p * log_q).sum(dim=-1, keepdim=True)  # (B, T, 1)
    return -(position_mask * per_position).mean()


class _PlainTorchLoss:
    """Stands where ``LogSoftmaxLoss`` (a ``torch.autograd.Function``) stood: ``apply``."""

    apply = staticmethod(kl_loss)


def main(argv: list[str]) -> int:
    stats_path, export_dir, threads = argv[0], argv[1], int(argv[2])
    args = argv[argv.index("--") + 1:]
    torch.set_num_threads(threads)
    from importlib.metadata import version

    from specforge import cli
    from specforge.algorithms.eagle3 import model as eagle3_model
    from specforge.training.controller import TrainerController
    from specforge.training.strategies.base import Eagle3TrainStrategy

    stats = {"trained_tokens": 0, "loss_positions": 0, "train_loop_s": 0.0, "steps": 0,
             "version": version("specforge")}
    state = {"in_fit": False, "first_step": False}

    def counted_loss(logits, target_p, position_mask):
        if state["first_step"]:  # the first TTT step of this forward
            stats["loss_positions"] += int(position_mask.sum())
            state["first_step"] = False
        return kl_loss(logits, target_p, position_mask)

    class _CountedLoss:
        apply = staticmethod(counted_loss)

    eagle3_model.LogSoftmaxLoss = _CountedLoss  # 2.
    forward_loss = Eagle3TrainStrategy.forward_loss

    def counted_forward(self, batch, ctx=None):
        if state["in_fit"]:
            stats["trained_tokens"] += int(batch.tensors["loss_mask"].sum())
            state["first_step"] = True
        return forward_loss(self, batch, ctx)

    Eagle3TrainStrategy.forward_loss = counted_forward
    fit = TrainerController.fit

    def timed_fit(self, data):
        state["in_fit"] = True
        t0 = time.perf_counter()
        try:
            steps = fit(self, data)
        finally:
            stats["train_loop_s"] += time.perf_counter() - t0
            state["in_fit"] = False
        stats["steps"] = int(steps)
        return steps

    TrainerController.fit = timed_fit
    try:
        code = int(cli.main(args) or 0)
        if code == 0:
            stats["checkpoint"] = export(args, export_dir)
    finally:
        with open(stats_path, "w") as f:
            json.dump(stats, f)
    return code


def export(args: list[str], out: str) -> str:
    """SpecForge's SGLang export of the run's last checkpoint (``--config`` in ``args``)."""
    from specforge.config import load_config
    from specforge.export.to_sglang import export_to_sglang

    config = args[args.index("--config") + 1]
    cfg = load_config(config, [])
    return export_to_sglang(cfg.output_dir, cfg.model.draft_model_config, out,
                            vocab_mapping_path=cfg.model.vocab_mapping_path or None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
