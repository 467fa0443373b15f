"""speculators' own EAGLE-3 trainer on a CPU; run inside the speculators environment.

    <engines>/speculators/bin/python scripts/engine_runners/speculators_train.py STATS.json \
        THREADS -- <speculators train arguments>

The trainer is speculators 0.9.0's (``speculators.train.cli.main(TrainConfig.resolve(argv))``)
with the smallest CPU wrapper that lets it run, every patch listed here:

1. ``Trainer`` moves the model and each batch to ``get_local_rank()`` (0, i.e. ``cuda:0``):
   the trainer module's ``get_local_rank`` returns ``"cpu"``.
2. ``_StepTimer`` calls ``torch.accelerator.synchronize()`` on logged steps, which raises
   without an accelerator: it is a no-op when there is none.
3. ``Trainer.device_type`` falls back to ``"cuda"`` without an accelerator, which turns
   ``torch.autocast`` off on a CPU: it is set to ``"cpu"`` (autocast in
   ``--hidden-states-dtype``, as on a GPU).
4. The epoch loop stops once ``--max-steps`` is reached (0.9.0 runs one more step in every
   remaining epoch): the checkpoint is saved as at an epoch's end and training ends there
   (pass more ``--epochs`` than the steps need).

Measured beside it, and written to STATS.json: ``trained_tokens``, the loss-masked positions of
the first unrolled step over every training forward (the trainer's ``loss_mask`` after its own
shift); ``train_loop_s``, the wall time of ``train_epoch`` calls (data loading, forward,
backward, optimizer; checkpoint saving and validation between epochs excluded); ``steps``. This
file imports only speculators and torch.
"""
from __future__ import annotations

import json
import sys
import time


class _Done(Exception):
    """Training reached ``--max-steps``."""


def main(argv: list[str]) -> None:
    stats_path, threads = argv[0], int(argv[1])
    args = argv[argv.index("--") + 1:]
    import torch

    torch.set_num_threads(threads)
    from importlib.metadata import version

    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train import cli, trainer
    from speculators.train.config import TrainConfig

    stats = {"trained_tokens": 0, "train_loop_s": 0.0, "steps": 0,
             "version": version("speculators")}
    no_accelerator = torch.accelerator.current_accelerator() is None
    trainer.get_local_rank = lambda: "cpu"  # 1.
    if no_accelerator:
        torch.accelerator.synchronize = lambda *a, **k: None  # 2.
    init = trainer.Trainer.__init__

    def cpu_init(self, *a, **k):
        init(self, *a, **k)
        if no_accelerator:
            self.device_type = "cpu"  # 3.

    trainer.Trainer.__init__ = cpu_init
    forward = Eagle3DraftModel.forward

    def counted(self, *a, **k):
        mask = k.get("loss_mask")
        if self.training and mask is not None:
            stats["trained_tokens"] += int(mask.sum())
        return forward(self, *a, **k)

    Eagle3DraftModel.forward = counted
    epoch = trainer.Trainer.train_epoch

    def timed(self, epoch_index, *a, **k):
        t0 = time.perf_counter()
        try:
            out = epoch(self, epoch_index, *a, **k)
        finally:
            stats["train_loop_s"] += time.perf_counter() - t0
            stats["steps"] = int(self.global_step)
        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            self.maybe_save_checkpoint(epoch_index)  # 4.
            stats["checkpoint_epoch"] = epoch_index
            raise _Done
        return out

    trainer.Trainer.train_epoch = timed
    try:
        cli.main(TrainConfig.resolve(args))
    except _Done:
        pass
    finally:
        with open(stats_path, "w") as f:
            json.dump(stats, f)


if __name__ == "__main__":
    main(sys.argv[1:])
