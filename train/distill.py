#!/usr/bin/env python
"""Distil a target LLM's token distributions into a draft model.

    accelerate launch train/distill.py                                  # EAGLE head, defaults
    accelerate launch train/distill.py experiment=quickstart            # the `make demo` run
    accelerate launch train/distill.py draft=medusa loss=tvd optim.lr=1e-3

The recipe is one class: ``setup`` (accelerator, target, feature cache, draft, optimizer),
``train`` (the loop, validation, checkpoints), ``save_package`` and ``cleanup``. Components live in
their packages: the feature cache in ``data/``, the draft families in ``heads/``, the loss of a
micro-batch with its teacher paths in ``train/objective.py``, the losses and metrics in
``train/``.
"""
from __future__ import annotations

from draftsmith.data.malloc import restart_as_command, trim_freed_memory

restart_as_command(__name__, "draftsmith-distill")  # the tuned allocator, before torch loads

import contextlib
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from draftsmith.data.feature_data import open_features
from draftsmith.data.teacher import logit_softcap
from draftsmith.heads.manifest import write_json_atomic
from draftsmith.heads.vocab import TOKEN_FREQUENCY, frequency_record
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.config import (
    MIXED_PRECISION,
    TARGET_DTYPES,
    ConfigError,
    resolve_auto_dtypes,
    resolve_target_defaults,
    validate_against_target,
    validate_config,
)
from draftsmith.train.memory import check_deepspeed_clipping as check_clipping
from draftsmith.train.memory import check_memory_on_all_ranks as check_memory
from draftsmith.train.objective import DistillObjective
from draftsmith.train.runtime import (
    StepLog,
    batch_fingerprints,
    cosine_with_warmup,
    long_barrier,
    main_process_first,
    make_accelerator,
    make_epoch_loader,
    own_batch_count,
    peer_lost,
    rank_placement,
)
from draftsmith.train.trainable import build_trainable

log = logging.getLogger("draftsmith.distill")
CONF = Path(__file__).resolve().parents[1] / "conf"  # draftsmith/conf in a wheel
TRAIN_SPLIT_SOURCE = "training split: target ids at loss-masked positions"  # token_frequency.json


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the run stops before the optimizer touches the weights."""


class DistillRecipe:
    """One distillation run: everything it needs is built in ``setup`` from the config."""

    def __init__(self, cfg: DictConfig):
        validate_config(cfg)
        # keys this run leaves to measurement: they match what a checkpoint's run measured
        self.auto_keys = tuple(k for k in ckpt.AUTO_KEYS if OmegaConf.select(cfg, k) == "auto")
        resolve_auto_dtypes(cfg)
        self.cfg = cfg
        self.out_dir = Path(cfg.out_dir)
        # tokens_trained: position-1 tokens trained on, across resumes (checkpointed)
        self.step = self.epoch = self.batch_in_epoch = self.tokens_trained = 0
        self.rank_fingerprints: list[int] | None = None  # first batch of each rank (sharding check)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        acc = self.accelerator = make_accelerator(cfg)
        self.ranks = rank_placement(acc)  # where each rank runs (summary.json)
        self._check_ranks_agree_on_dtypes()
        torch.manual_seed(cfg.seed)
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self._check_previous_run()  # before any work: a checkpoint of another config is refused
        log.info("launcher=%s distributed_type=%s processes=%d device=%s mixed_precision=%s "
                 "torch_threads=%d malloc=%s", cfg.launcher.name, acc.distributed_type.name,
                 acc.num_processes, acc.device, acc.mixed_precision, torch.get_num_threads(),
                 os.environ.get("DRAFTSMITH_MALLOC", "default"))

        # 1. target (converted once by the main process, then read from the cache by all)
        from draftsmith.data.target import load_target
        from draftsmith.data.tiny import target_path_from_config

        with main_process_first(acc, cfg.train.cache_wait_s):
            self.target = load_target(target_path_from_config(cfg.target),
                                      dtype=getattr(torch, cfg.target.dtype),
                                      chat_template=cfg.target.get("chat_template"))
        tcfg = self.target.model.config
        resolve_target_defaults(cfg, tcfg)
        validate_against_target(cfg, tcfg.vocab_size, tcfg.hidden_size, tcfg.num_hidden_layers)

        # 2. feature cache: every rank writes its share of the shards, then all read them all
        from draftsmith.data.prepare import prepare_data

        ranks = (acc.process_index, acc.num_processes,
                 functools.partial(long_barrier, acc, cfg.train.cache_wait_s))
        layers = list(OmegaConf.select(cfg, "draft.config.fuse_layers") or [])
        train_dir, val_dir, self.data_report = prepare_data(
            cfg.data, self.target, layers=layers, ranks=ranks)
        # data.cache.local: every rank reads its own shards only (machine-local disks)
        self.local = bool(cfg.data.cache.local) and acc.num_processes > 1
        own = {"rank": acc.process_index, "world": acc.num_processes} if self.local else {}
        self.train_set, self.val_set = (open_features(d, self.target.model, **own)
                                        for d in (train_dir, val_dir))
        batches = (self._own_batches(self.train_set, True) if self.local else
                   len(self.train_set) // (cfg.train.micro_batch_size * acc.num_processes))
        if batches == 0:
            raise ConfigError(
                f"the training split has {len(self.train_set)} sequences, fewer than one global "
                f"batch (train.micro_batch_size={cfg.train.micro_batch_size} x "
                f"{acc.num_processes} processes); use more data (data.num_conversations) "
                "or a smaller batch")

        # 3. draft, frozen teacher LM head, loss (train/objective.py)
        torch.manual_seed(cfg.seed)
        self.draft = build_trainable(cfg, self.target, self.train_set)
        self.lm_head = self.target.model.get_output_embeddings().weight.detach().to(acc.device)
        self.softcap = logit_softcap(self.target.model.config)  # Gemma 2 caps its logits
        self.objective = DistillObjective(cfg, self.draft, self.lm_head, self.softcap, acc)
        check_memory(self.cfg, self.target.model, self.draft, self.accelerator)  # or refuse

        # 4. optimizer and schedule (the scheduler is stepped once per optimizer step by hand, so
        #    the schedule is the same whatever the number of processes)
        params = [p for p in self.draft.module.parameters() if p.requires_grad]
        self.optimizer = hydra.utils.instantiate(cfg.optim.optimizer)(params)
        self.scheduler = cosine_with_warmup(self.optimizer, cfg.optim.warmup_steps,
                                            cfg.train.max_steps, cfg.optim.min_lr_ratio)
        plugin = getattr(acc.state, "deepspeed_plugin", None)
        if plugin is not None:  # our loaders are not prepared by accelerate: say the batch size
            ds = plugin.deepspeed_config
            if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
                ds["train_micro_batch_size_per_gpu"] = int(cfg.train.micro_batch_size)
        self.draft.module, self.optimizer = acc.prepare(self.draft.module, self.optimizer)
        check_clipping(self.accelerator, self.cfg)

        # 5. trackers and resume
        self.steplog = StepLog(acc, cfg, self.out_dir)
        if cfg.train.resume:
            self._resume()

    def _check_ranks_agree_on_dtypes(self) -> None:
        """Every rank resolved ``auto`` dtypes on its own: refuse a run where they differ."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return
        code = torch.tensor([TARGET_DTYPES.index(self.cfg.target.dtype),
                             MIXED_PRECISION.index(self.cfg.train.mixed_precision)],
                            device=acc.device)
        codes = acc.gather(code[None]).view(-1, 2)
        if not bool((codes == codes[0]).all()):
            raise ConfigError("the processes measured different fastest dtypes for "
                              "target.dtype / train.mixed_precision=auto; set both explicitly")

    def _check_previous_run(self) -> None:
        """Resuming: the newest checkpoint's recorded config must match this run's
        (``train.checkpoint.check_resumable``, else ConfigError). Starting over (no checkpoint,
        or ``train.resume=false``): an earlier run's files are moved aside, never mixed in."""
        acc = self.accelerator
        last = ckpt.latest_checkpoint(self.out_dir) if self.cfg.train.resume else None
        branch = None if last is not None else self._branch_source()
        if last is not None or branch is not None:
            current = OmegaConf.to_container(self.cfg, resolve=True)
            ckpt.check_resumable(last or branch, current, self.auto_keys)
            if last is not None:
                return
        if acc.is_main_process:
            ckpt.move_previous_run(self.out_dir)
            if branch is not None:
                ckpt.branch_from(branch, self.out_dir)
        acc.wait_for_everyone()

    def _branch_source(self) -> Path | None:
        """``train.resume_from``: another run's checkpoint this run starts from, or None."""
        src = self.cfg.train.get("resume_from")
        if not src:
            return None
        if not self.cfg.train.resume:
            raise ConfigError(f"train.resume_from={src} with train.resume=false: resume_from "
                              "continues another run's checkpoint; drop one of the two")
        if not (Path(src) / ckpt.STATE_FILE).is_file():
            raise ConfigError(f"train.resume_from={src} is not a training checkpoint (no "
                              f"{ckpt.STATE_FILE}): give a step-NNNNNN folder under another "
                              "run's checkpoints/")
        return Path(src)

    def _resume(self) -> None:
        acc = self.accelerator
        if acc.is_main_process:
            for p in ckpt.remove_partial(self.out_dir):
                log.warning("removed a checkpoint left half-written by a killed run: %s", p)
        acc.wait_for_everyone()
        last = ckpt.latest_checkpoint(self.out_dir)
        if last is None:
            return
        state = ckpt.load_trainer_state(last)
        acc.load_state(str(last))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.tokens_trained = state.get("tokens_trained", 0)  # checkpoints before it: from 0
        log.info("resumed from %s (step %d, epoch %d, batch %d)", last, self.step, self.epoch,
                 self.batch_in_epoch)

    # ------------------------------------------------------------------ metrics
    def validate(self) -> dict:
        """Per draft position: expected acceptance sum(min(p, q)) and top-1 agreement
        (:func:`train.validation.validate_draft`)."""
        from draftsmith.train.validation import validate_draft

        return validate_draft(self.draft, self.val_set, self.accelerator,
                              self.cfg.train.micro_batch_size, self.cfg.train.eval_batches,
                              float(self.cfg.loss.temperature), self.lm_head, self.softcap,
                              own_batches=self._own_batches(self.val_set, False))

    # ------------------------------------------------------------------ the loop
    def _batches(self):
        """Yield micro-batches forever, epoch after epoch, tracking the data position."""
        cfg = self.cfg
        while True:
            loader = make_epoch_loader(self.train_set, cfg.train.micro_batch_size, seed=cfg.seed,
                                       epoch=self.epoch, shuffle=True, accelerator=self.accelerator,
                                       skip=self.batch_in_epoch,
                                       bucket_batches=cfg.train.bucket_batches,
                                       own_batches=self._own_batches(self.train_set, True))
            for batch in loader:
                self.batch_in_epoch += 1
                yield batch
            self.epoch += 1
            self.batch_in_epoch = 0

    def _own_batches(self, ds, drop_last: bool) -> int | None:
        """Batches per rank of a machine-local cache (equal on every rank), else None."""
        return own_batch_count(ds.manifest, self.accelerator.num_processes,
                               self.cfg.train.micro_batch_size, drop_last) if self.local else None

    def train(self) -> dict:
        cfg = self.cfg
        model = self.draft.module
        model.train()
        if self.step == 0:
            self.initial_validation = self.validate()
            self.steplog.log_validation(0, self.initial_validation, tag="init")
            self._write_json("validation_init.json", self.initial_validation)
        else:  # a resumed run reads what its first launch wrote (never rewritten: ranks read it)
            self.initial_validation = self._read_json("validation_init.json")
        batches = self._batches()
        progress = self.steplog.progress(total=cfg.train.max_steps, initial=self.step)
        last_val = None
        start_tokens, t0, start_step = self.tokens_trained, time.perf_counter(), self.step
        while self.step < cfg.train.max_steps:
            step_parts: dict[str, float] = {}
            # The first step can count its FLOPs (matmuls and attention, forward and backward)
            counting = cfg.train.count_flops and self.step == start_step
            counter = FlopCounterMode(display=False) if counting else contextlib.nullcontext()
            with counter:
                step_tokens = self._train_step(model, batches, step_parts)
            self.tokens_trained += step_tokens
            if counting:
                self.steplog.log_train(self.step + 1,
                                       {"flops_first_step": counter.get_total_flops(),
                                        "tokens_first_step": step_tokens})
            self.scheduler.step()
            self.step += 1
            progress.update(1)
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps:
                elapsed, tokens_seen = time.perf_counter() - t0, self.tokens_trained - start_tokens
                self.steplog.log_train(self.step, {
                    "loss": sum(step_parts.values()), **step_parts,
                    "lr": self.scheduler.get_last_lr()[0], "tokens": tokens_seen,
                    "tokens_total": self.tokens_trained, "elapsed_s": elapsed,
                    "tokens_per_s": tokens_seen / max(elapsed, 1e-9)})
            if self.step % cfg.train.eval_every == 0 or self.step == cfg.train.max_steps:
                last_val = self.validate()
                self.steplog.log_validation(self.step, last_val)
            if self.step % cfg.train.save_every == 0 or self.step == cfg.train.max_steps:
                self.save_checkpoint()
        progress.close()
        if last_val is None:
            last_val = self.validate()
        self.final_validation = {**last_val, "step": self.step}
        self._write_json("validation.json", self.final_validation)
        return self.final_validation

    def _train_step(self, model, batches, step_parts: dict[str, float]) -> int:
        """One optimizer step over ``grad_accum`` micro-batches; returns the global count of
        position-1 tokens it trained on (``step_parts`` collects the per-position losses)."""
        cfg, acc = self.cfg, self.accelerator
        tokens = 0
        for _ in range(cfg.train.grad_accum):
            batch = next(batches)
            if self.rank_fingerprints is None:
                self.rank_fingerprints = batch_fingerprints(acc, batch)
            with acc.accumulate(model):
                with acc.autocast():
                    loss, parts, n_global = self.objective(batch)
                finite = acc.reduce(torch.isfinite(loss.detach()).float(), reduction="sum")
                if finite.item() < acc.num_processes:
                    last = ckpt.latest_checkpoint(self.out_dir)
                    raise NonFiniteLossError(
                        f"loss is {loss.item()} at step {self.step + 1} (epoch {self.epoch}, "
                        f"batch {self.batch_in_epoch}); stopping before the update. The last good "
                        f"checkpoint is {last or 'none (no checkpoint saved yet)'}; lower optim.lr "
                        "or check the data, then rerun to resume from it")
                acc.backward(loss)
                if acc.sync_gradients and cfg.train.max_grad_norm > 0:
                    acc.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            tokens += int(n_global.item())
            trim_freed_memory()  # a fragmented tuned heap over half the memory: hand pages back
            for key, v in parts.items():
                step_parts[key] = step_parts.get(key, 0.0) + v / cfg.train.grad_accum
        return tokens

    # ------------------------------------------------------------------ outputs
    def save_checkpoint(self) -> Path:
        state = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                 "tokens_trained": self.tokens_trained, "scheduler": self.scheduler.state_dict(),
                 "config": OmegaConf.to_container(self.cfg, resolve=True)}
        return ckpt.save_checkpoint(self.accelerator, self.out_dir, self.step, state,
                                    keep=self.cfg.train.keep_checkpoints)

    def save_package(self) -> Path | None:
        """Write the draft package (weights, config, manifest with the target's identity)."""
        acc = self.accelerator
        module = acc.unwrap_model(self.draft.module)
        if acc.distributed_type.name == "DEEPSPEED":
            state = acc.get_state_dict(self.draft.module)  # gathers ZeRO-3 shards
            if acc.is_main_process:
                module.load_state_dict(state, strict=False)
        if not acc.is_main_process:
            acc.wait_for_everyone()
            return None
        counts = self.train_set.token_counts(int(self.target.model.config.vocab_size))
        pkg = self.draft.save_package(
            self.out_dir / "draft", module,
            extra_json={"validation.json": self.final_validation,
                        "validation_init.json": self.initial_validation,
                        "data_report.json": self.data_report,
                        TOKEN_FREQUENCY: frequency_record(counts, TRAIN_SPLIT_SOURCE)},
            train_config=OmegaConf.to_container(self.cfg, resolve=True),
            train_log=self.out_dir / "train_log.jsonl")
        acc.wait_for_everyone()
        log.info("draft package written to %s", pkg)
        return pkg

    def cleanup(self) -> None:
        self.accelerator.end_training()

    def _write_json(self, name: str, obj) -> None:
        if self.accelerator.is_main_process:  # atomic: other ranks may be reading it
            write_json_atomic(self.out_dir / name, obj)

    def _read_json(self, name: str):
        return json.loads(p.read_text()) if (p := self.out_dir / name).is_file() else None


def run(cfg: DictConfig) -> dict:
    """Run a whole job; returns a summary (used by tests and the demo)."""
    recipe = DistillRecipe(cfg)
    recipe.setup()
    try:
        final = recipe.train()
        pkg = recipe.save_package()
    except RuntimeError as e:  # a peer died or hangs: say so, and how to resume
        raise peer_lost(e, recipe.accelerator, cfg.train.dist_timeout_s, recipe.out_dir) from e
    finally:
        recipe.cleanup()
    init = recipe.initial_validation or {}
    summary = {"package": str(pkg) if pkg else None, "steps": recipe.step,
               "alpha_hat": final["alpha_hat"], "alpha_hat_init": init.get("alpha_hat"),
               "top1": final["top1"], "distributed_type": recipe.accelerator.distributed_type.name,
               "num_processes": recipe.accelerator.num_processes,
               "rank_batch_fingerprints": recipe.rank_fingerprints,
               "ranks": recipe.ranks}
    if recipe.accelerator.is_main_process:
        write_json_atomic(Path(cfg.out_dir) / "summary.json", summary)
        log.info("alpha-hat per position: init %s -> trained %s",
                 [round(a, 3) for a in summary["alpha_hat_init"] or []],
                 [round(a, 3) for a in summary["alpha_hat"]])
    return summary


@hydra.main(config_path=str(CONF), config_name="distill", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        log.error("config error: %s", err)
        sys.exit(2)


def cli() -> None:  # draftsmith-distill or python train/distill.py: one process
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()


if __name__ == "__main__":
    cli()
