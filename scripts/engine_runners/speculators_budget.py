"""The token budget per step (``--total-seq-len``) at which speculators' own packing sampler
gives its first ``steps`` batches a given number of loss-masked tokens; run inside the
speculators environment.

    <engines>/speculators/bin/python scripts/engine_runners/speculators_budget.py JOB.json OUT.json

speculators packs rows of varying length under a token budget, so a budget of
``sequences_per_step`` mean lengths trains fewer tokens than that many rows do (a batch closes
when the next row does not fit). ``make peers`` compares trainers at equal trained tokens, so it
asks the sampler speculators trains with (``MultipackDistributedBatchSamplerV2``, one replica,
the run's seed, epochs in order) which budget comes nearest to the other trainers' tokens.

JOB.json: ``lengths`` and ``masked`` (per training row: tokens, and loss-masked positions as the
trainer counts them), ``steps``, ``seed``, ``target`` (loss-masked tokens to match), ``low`` and
``high`` (the budgets tried, every ``stride``). OUT.json: ``budget``, ``tokens`` (what it
trains), ``target``. This file imports only speculators and numpy.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def trained_tokens(sampler_cls, lengths: list[int], masked: list[int], budget: int, steps: int,
                   seed: int) -> int:
    """Loss-masked tokens in the first ``steps`` batches the sampler packs under ``budget``."""
    sampler = sampler_cls(batch_max_length=budget, lengths=lengths, num_replicas=1, rank=0,
                          seed=seed)
    total, done, epoch = 0, 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        batches = list(sampler)
        if not batches:
            raise ValueError(f"budget {budget} packs no batch")
        for batch in batches[:steps - done]:
            total += sum(masked[int(i)] for i in batch)
        done += min(len(batches), steps - done)
        epoch += 1
    return total


def main(job_path: str, out_path: str) -> None:
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    job = json.loads(Path(job_path).read_text())
    target = int(job["target"])
    best = None
    for budget in range(int(job["low"]), int(job["high"]) + 1, int(job.get("stride", 8))):
        got = trained_tokens(MultipackDistributedBatchSamplerV2, job["lengths"], job["masked"],
                             budget, int(job["steps"]), int(job["seed"]))
        if best is None or abs(got - target) < abs(best[1] - target):
            best = (budget, got)
    Path(out_path).write_text(json.dumps({"budget": best[0], "tokens": best[1],
                                          "target": target}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
