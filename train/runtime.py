"""Process-level plumbing of the recipe: the Accelerator, data loaders, schedule and logging.

The Accelerator is built so that the launcher really runs what the config says. Several obvious
recipes run the wrong thing silently on a machine without CUDA (two independent rank-0 processes,
DeepSpeed quietly dropped, FSDP never applied); ``make_accelerator`` picks the working recipe and
then *checks* the distributed type and world size against ``cfg.launcher``, failing with the
command to use when they differ.
"""
from __future__ import annotations

import json
import logging
import math
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Subset

from draftsmith.train.config import ConfigError

log = logging.getLogger("draftsmith.distill")


def cpu_threads(requested: int | None) -> int:
    """Torch threads for this process on CPU: ``requested``, else this machine's usable cores
    divided by the processes launched on it (at least 1).

    ``accelerate launch`` exports ``OMP_NUM_THREADS=1`` unless ``--num_cpu_threads_per_process``
    is passed (its CPU auto-sizing only applies with ``use_cpu``), which leaves a one-process CPU
    run on one core; the recipe sets the thread count itself instead.
    """
    if requested is not None:
        return int(requested)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, (cores or 1) // max(local, 1))


def make_accelerator(cfg: DictConfig):
    """Build the Accelerator for the launcher in ``cfg.launcher`` and verify what was launched."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    use_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        torch.set_num_threads(cpu_threads(cfg.train.get("cpu_threads")))
    kwargs: dict = {}
    # a collective waits at most this long for a peer (a dead or hung machine fails the run
    # instead of hanging it; torch's default is 30 minutes for gloo, 10 for NCCL)
    timeout = timedelta(seconds=float(cfg.train.get("dist_timeout_s") or 1800))
    handlers = [InitProcessGroupKwargs(timeout=timeout)]
    if not has_cuda and world > 1:
        if use_fsdp or "FSDP" in cfg.launcher.distributed_type:
            raise ConfigError(
                "launcher=fsdp: accelerate applies FSDP only on CUDA devices; on CPU it would "
                "run plain or wrong data parallelism. Use launcher=ddp or "
                "launcher=deepspeed_zero2 here")
        if use_deepspeed:
            # gloo process group; Accelerator(cpu=True) would silently drop DeepSpeed.
            handlers = [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]
            skip_deepspeed_shm_op()
        else:
            kwargs["cpu"] = True  # real DDP over gloo
    mp = cfg.train.mixed_precision
    if mp == "fp16" and not has_cuda:
        raise ConfigError("train.mixed_precision=fp16 needs CUDA; use bf16 or no on this machine")
    log_with = None if cfg.logging.log_with == "none" else cfg.logging.log_with
    if log_with == "wandb":
        os.environ.setdefault("WANDB_MODE", cfg.logging.get("mode", "offline"))
        os.environ.setdefault("WANDB_DIR", str(Path(cfg.out_dir).resolve()))
        os.environ.setdefault("WANDB_CACHE_DIR", str(Path(cfg.out_dir).resolve() / "wandb-cache"))
    acc = Accelerator(gradient_accumulation_steps=cfg.train.grad_accum, mixed_precision=mp,
                      log_with=log_with, project_dir=cfg.out_dir, kwargs_handlers=handlers,
                      **kwargs)
    _check_launch(cfg, acc)
    return acc


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce kernel when it
    starts (~25 s of two compilers on a fresh machine, again for every environment path): only
    inference tensor parallelism (``inference_all_reduce``) calls it, never ZeRO training, whose
    collectives run on the gloo process group either way. DeepSpeed reads the op's
    compatibility from ``deepspeed.ops.__compatible_ops__``, a dict it keeps for such edits."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _check_launch(cfg: DictConfig, acc) -> None:
    launcher = cfg.launcher
    dtype = acc.distributed_type.name
    if dtype not in list(launcher.distributed_type):
        raise ConfigError(
            f"launcher={launcher.name} expects distributed type {list(launcher.distributed_type)} "
            f"but accelerate launched {dtype} with {acc.num_processes} process(es). Launch with: "
            f"accelerate launch --config_file {launcher.accelerate_config} train/distill.py "
            f"launcher={launcher.name}")
    if launcher.num_processes is not None and acc.num_processes != launcher.num_processes:
        raise ConfigError(
            f"launcher={launcher.name} expects {launcher.num_processes} processes but "
            f"{acc.num_processes} were launched; pass --num_processes {launcher.num_processes} or "
            f"launcher.num_processes={acc.num_processes}")


def long_barrier(acc, timeout_s: float) -> None:
    """``wait_for_everyone`` with its own timeout: converting the target or building the feature
    cache takes far longer than a training collective may wait (``train.dist_timeout_s``). On
    gloo a monitored barrier names a rank that never came."""
    import torch.distributed as dist

    if acc.num_processes > 1 and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        acc.wait_for_everyone()


@contextmanager
def main_process_first(acc, timeout_s: float):
    """``Accelerator.main_process_first`` through :func:`long_barrier`."""
    if not acc.is_main_process:
        long_barrier(acc, timeout_s)
    yield
    if acc.is_main_process:
        long_barrier(acc, timeout_s)


def rank_placement(acc) -> list[dict]:
    """Where every rank ran, gathered (a collective): global and local rank, and the machine
    rank torchrun gave its node (``GROUP_RANK``; 0 on one machine)."""
    from accelerate.utils import gather_object

    mine = {"rank": acc.process_index, "local_rank": acc.local_process_index,
            "machine": int(os.environ.get("GROUP_RANK", "0"))}
    return gather_object([mine]) if acc.num_processes > 1 else [mine]


def batch_fingerprints(acc, batch: dict) -> list[int]:
    """A checksum of each rank's batch, gathered (a collective): distinct values = sharded data."""
    ids = batch["input_ids"].long()
    weights = torch.arange(1, ids.numel() + 1, device=ids.device).view_as(ids)
    local = ((ids * weights).sum() % 2_147_483_647).view(1)
    return [int(v) for v in acc.gather(local).tolist()]


class PeerLostError(RuntimeError):
    """A collective operation failed: another process or machine of the run died or hangs."""


def peer_lost(error: BaseException, acc, timeout_s: float | None, out_dir: Path) -> Exception:
    """The error to raise when a distributed run's collective fails (``error`` as is on one
    process or when it is not a communication failure)."""
    text = str(error)
    markers = ("gloo", "Connection reset", "Connection closed", "Timed out", "timed out",
               "NCCL", "Broken pipe", "ProcessGroup")
    if acc.num_processes == 1 or not any(m in text for m in markers):
        return error
    from draftsmith.train.checkpoint import latest_checkpoint

    last = latest_checkpoint(out_dir)
    return PeerLostError(
        f"rank {acc.process_index} of {acc.num_processes}: a collective failed, so another "
        f"process or machine of this run died or stopped answering (waited up to "
        f"{timeout_s or 1800:.0f} s, train.dist_timeout_s): {text.splitlines()[0][:300]}. Relaunch "
        f"every machine with the same command: training resumes from "
        f"{last if last is not None else 'the start (no checkpoint yet)'}")


def epoch_order(lengths: list[int] | None, global_batch: int, seed: int, epoch: int,
                shuffle: bool, bucket_batches: int = 0) -> list[int]:
    """The order in which one epoch reads the sequences: a function of (seed, epoch) only.

    With ``bucket_batches`` = k > 0 the shuffled order is cut into windows of k global batches,
    each window sorted by sequence length (ties keep the shuffled order), cut into global batches,
    and the full batches shuffled: a batch holds sequences of similar length, so little of it is
    padding, and the batches still come in random order. The global batch (micro-batch x
    processes) is the unit, so N processes see the same batches as one process with N times the
    micro-batch.
    """
    n = len(lengths) if lengths is not None else 0
    if not shuffle:
        return list(range(n))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=gen).tolist()
    if bucket_batches <= 0:
        return order
    window = global_batch * bucket_batches
    order = [i for s in range(0, n, window)
             for i in sorted(order[s: s + window], key=lengths.__getitem__)]
    batches = [order[s: s + global_batch] for s in range(0, n, global_batch)]
    full = [b for b in batches if len(b) == global_batch]
    tail = [i for b in batches if len(b) < global_batch for i in b]  # stays last (drop_last)
    return [i for k in torch.randperm(len(full), generator=gen).tolist() for i in full[k]] + tail


def make_epoch_loader(dataset, batch_size: int, seed: int, epoch: int, shuffle: bool, accelerator,
                      skip: int = 0, drop_last: bool = True, bucket_batches: int = 0,
                      own_batches: int | None = None):
    """A prepared DataLoader over one epoch in a fixed order (seed, epoch) -> permutation.

    Every process computes the same order (:func:`epoch_order`; ``bucket_batches`` > 0 groups
    sequences of similar length, read from ``dataset.lengths()``); accelerate shards its batches
    across processes. ``skip`` resumes mid-epoch exactly where a checkpoint was taken.

    ``own_batches``: ``dataset`` holds this rank's own shards only (a machine-local cache,
    ``data.cache.local``): it is not sharded again, and every rank reads exactly this many
    batches (the smallest rank's count, :func:`own_batch_count`), so collectives stay in step.
    """
    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    from draftsmith.data.feature_data import collate_features

    world = 1 if own_batches is not None else accelerator.num_processes
    lengths = (dataset.lengths() if shuffle and bucket_batches > 0
               else [0] * len(dataset))
    order = epoch_order(lengths, batch_size * world, seed, epoch, shuffle, bucket_batches)
    if own_batches is not None:
        order = order[: own_batches * batch_size]
    # An own generator: creating the iterator then draws no number from the global RNG, whose
    # stream (feature noise) must continue exactly across a checkpoint and resume.
    collate = getattr(dataset, "collate", collate_features)  # online features: the target's
    loader = DataLoader(Subset(dataset, order), batch_size=batch_size, shuffle=False,
                        collate_fn=collate, drop_last=drop_last,
                        generator=torch.Generator().manual_seed(seed + epoch))
    # The module-level helpers shard without registering the loader with the Accelerator, so
    # checkpoints hold no per-loader sampler state (the data position is ours: epoch, batch).
    loader = prepare_data_loader(loader, device=accelerator.device, num_processes=world,
                                 process_index=0 if world == 1 else accelerator.process_index,
                                 put_on_device=True)
    if skip:
        loader = skip_first_batches(loader, skip)
    return loader


def own_batch_count(manifest: dict, world: int, batch_size: int, drop_last: bool) -> int:
    """Batches every rank reads from its own shards of a machine-local cache (shard k belongs
    to rank k % world): the smallest rank's count."""
    n = [sum(s["sequences"] for k, s in enumerate(manifest["shards"]) if k % world == r)
         for r in range(world)]
    return min(x // batch_size if drop_last else -(-x // batch_size) for x in n)


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Linear warm-up to the peak lr, then cosine decay to ``min_lr_ratio`` of it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return (min_lr_ratio
                + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class StepLog:
    """Rank-0 logging: ``train_log.jsonl`` always, plus the configured tracker and a progress
    bar."""

    def __init__(self, accelerator, cfg: DictConfig, out_dir: Path):
        self.acc = accelerator
        self.path = Path(out_dir) / "train_log.jsonl"
        if cfg.logging.log_with != "none":
            config = OmegaConf.to_container(cfg, resolve=True)
            flat = {k: v for k, v in _flatten(config).items()
                    if isinstance(v, (int, float, str, bool))}
            accelerator.init_trackers(cfg.logging.project, config=flat,
                                      init_kwargs={"wandb": {"name": cfg.name}})

    def progress(self, total: int, initial: int):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc="distill", unit="step",
                    disable=not self.acc.is_main_process, dynamic_ncols=True)

    def _write(self, record: dict) -> None:
        if self.acc.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def log_train(self, step: int, values: dict) -> None:
        self._write({"step": step, **values})
        self.acc.log(values, step=step)

    def log_validation(self, step: int, val: dict, tag: str = "val") -> None:
        self._write({"step": step, "tag": tag, "alpha_hat": val["alpha_hat"], "top1": val["top1"]})
        flat = {f"{tag}/alpha_hat_pos{i + 1}": a for i, a in enumerate(val["alpha_hat"])}
        flat.update({f"{tag}/top1_pos{i + 1}": a for i, a in enumerate(val["top1"])})
        self.acc.log(flat, step=step)
        if self.acc.is_main_process:
            log.info("step %d %s alpha-hat %s top-1 %s", step, tag,
                     [round(a, 3) for a in val["alpha_hat"]], [round(a, 3) for a in val["top1"]])


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
