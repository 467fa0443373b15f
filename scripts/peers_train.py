"""The same EAGLE-3 draft trained by draftsmith and by the peers' own trainers on the same data,
with equal settings, every checkpoint scored by one evaluator (``make peers``).

    python scripts/peers_train.py                                   # make peers
    python scripts/peers_train.py steps=20 eval.limit=2 eval.max_new_tokens=16

1. **Data** (timed apart, ``feature_s``): draftsmith's ``experiment`` preset (the quickstart:
   ShareGPT conversations whose replies the target regenerates, their token ids and loss masks)
   and the target's hidden states for them, cached once with the final-norm state
   (``data.features=offline``); the draft vocabulary is chosen from the training split's token
   counts as draftsmith's head chooses it. The peers' offline formats are written from this
   cache (``scripts/peers_data.py``).
2. **Training**, each trainer in its own environment with the settings of
   :func:`equal_settings`: one Llama-style layer shaped like the target (width, heads, MLP,
   RoPE), fused layers ``[2, L // 2, L - 3]``, the same draft vocabulary map, ``positions``
   unrolled steps with loss weights ``decay ** i``, AdamW (lr, betas, weight decay), linear
   warm-up then cosine decay to 0, ``steps`` optimizer steps of ``sequences_per_step``
   sequences (speculators packs sequences into a token budget: the same mean number of tokens
   per step), gradients clipped at 1, ``precision`` and ``threads``.

   * draftsmith: ``train/distill.py`` as a subprocess (its recipe otherwise: forward KL, the
     feature noise of the preset, and ``recipe``'s overrides: the reduced LM head trained from
     a fresh start), validation and checkpoints only at the last step.
   * speculators 0.9.0: its trainer (``speculators.train``) through
     ``scripts/engine_runners/speculators_train.py`` (the CPU wrapper, its patches listed
     there), with ``--loss-implementation eager --draft-attn-impl sdpa --num-workers 0``,
     forward KL (``--loss-fn kl_div``), AdamW, full attention in the layer, and none of its
     optional norms (``--no-norm-before-residual --no-norm-before-fc --no-norm-output``), so
     that it trains the layout engines serve and draftsmith's head reads.
   * ModelOpt 0.47.0: its EAGLE-3 model code (``mtsp.convert``, offline, its own TTT loss)
     in Hugging Face's ``Trainer`` through ``scripts/engine_runners/modelopt_train.py`` (what
     its example script, absent from the wheel, does), the layer shaped like the target, then
     its own EAGLE-3 export.
   * SpecForge 0.2.0: installed ``--no-deps`` in its own environment, its trainer
     (``specforge train``, offline, its own TTT loss) through
     ``scripts/engine_runners/specforge_train.py`` (the CPU wrapper, its patches listed there:
     the ``triton`` wheel so that its loss module imports, and its Triton EAGLE-3 loss routed to
     plain torch computing its reference loss) with ``SPECFORGE_DEVICE=cpu
     FSDP_SHARDING=NO_SHARD``, the layer shaped like the target, then its own SGLang export
     (``scripts/peers_specforge.py``).

   ``trained_tokens`` counts the loss-masked positions of the first draft position over the
   training steps, ``tokens_per_s`` divides them by the training loop's wall time (data loading,
   forward, backward, optimizer; feature caching, checkpoints and validation excluded).
3. **One evaluator** (``scripts/peers_report.py``): each checkpoint is read with
   ``eval/draft.py``'s ``load_draft`` (a peer's as an unsigned import), scored with draftsmith's
   validation (alpha-hat per position on the held-back split, fp32) and decoded by
   ``eval/decode.py`` on the MT-bench questions against plain decoding in the same run.

Writes ``<out_dir>/results.json`` (one row per trainer) and ``<out_dir>/README.md``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.eval import CONF_DIR
from draftsmith.scripts.peers_data import log_tail, run_trainer, vocab_map
from draftsmith.scripts.tooling import REPO, note, repo_path

TOOL = "peers"
TRAINERS = ("draftsmith", "speculators", "modelopt", "specforge")
PRECISIONS = {"bf16": ("bf16", "bfloat16"), "fp32": ("no", "float32")}  # ours, the peers'


@dataclass(frozen=True)
class Settings:
    """The settings every trainer gets (``conf/eval/peers.yaml``)."""

    steps: int
    sequences_per_step: int
    lr: float
    warmup_steps: int
    weight_decay: float
    betas: tuple[float, float]
    positions: int
    decay: float
    precision: str
    threads: int
    seed: int

    @property
    def position_weights(self) -> list[float]:
        return [self.decay ** i for i in range(self.positions)]


def equal_settings(cfg: Any) -> Settings:
    """The equal settings from ``cfg``, checked; raises ValueError naming the key."""
    s = Settings(steps=int(cfg.steps), sequences_per_step=int(cfg.sequences_per_step),
                 lr=float(cfg.lr), warmup_steps=int(cfg.warmup_steps),
                 weight_decay=float(cfg.weight_decay),
                 betas=(float(cfg.betas[0]), float(cfg.betas[1])), positions=int(cfg.positions),
                 decay=float(cfg.decay), precision=str(cfg.precision), threads=int(cfg.threads),
                 seed=int(cfg.seed))
    for key in ("steps", "sequences_per_step", "positions", "threads"):
        if getattr(s, key) < 1:
            raise ValueError(f"{key}={getattr(s, key)}: must be >= 1")
    if not 0 <= s.warmup_steps < s.steps:
        raise ValueError(f"warmup_steps={s.warmup_steps}: must be in 0..steps-1 ({s.steps - 1})")
    if s.lr <= 0 or not 0 < s.decay <= 1 or s.weight_decay < 0:
        raise ValueError(f"lr={s.lr}, decay={s.decay}, weight_decay={s.weight_decay}: need lr > 0,"
                         " 0 < decay <= 1, weight_decay >= 0")
    if s.precision not in PRECISIONS:
        raise ValueError(f"precision={s.precision!r}: allowed {sorted(PRECISIONS)}")
    bad = [t for t in cfg.trainers if t not in TRAINERS]
    if bad or not cfg.trainers:
        raise ValueError(f"trainers={list(cfg.trainers)}: choose from {TRAINERS}")
    return s


def draftsmith_overrides(s: Settings, experiment: str, out_dir: Path,
                         target_dtype: str, recipe: Sequence[str] = ()) -> list[str]:
    """``train/distill.py`` overrides that train the head with the equal settings, then
    draftsmith's own ``recipe`` overrides (choices the trainers do not share)."""
    mixed, _ = PRECISIONS[s.precision]
    return [f"experiment={experiment}", f"out_dir={out_dir}", f"seed={s.seed}",
            f"target.dtype={target_dtype}", "data.features=offline",
            f"train.max_steps={s.steps}", f"train.micro_batch_size={s.sequences_per_step}",
            "train.grad_accum=1", "train.max_grad_norm=1.0", f"train.mixed_precision={mixed}",
            f"train.cpu_threads={s.threads}", f"train.eval_every={s.steps}",
            f"train.save_every={s.steps}", "train.resume=false", "logging=none",
            f"optim.lr={s.lr}", f"optim.warmup_steps={s.warmup_steps}", "optim.min_lr_ratio=0.0",
            f"optim.optimizer.weight_decay={s.weight_decay}",
            f"optim.optimizer.betas=[{s.betas[0]},{s.betas[1]}]",
            f"draft.num_positions={s.positions}",
            f"draft.position_weights=[{','.join(f'{w:g}' for w in s.position_weights)}]",
            *recipe]


def speculators_args(s: Settings, data: dict, verifier: Path, save_path: Path,
                     fuse_layers: list[int], budget: int | None = None) -> list[str]:
    """speculators' train arguments for the equal settings (``data``: what
    ``peers_data.write_speculators`` returned; ``budget``: its tokens per step, see
    :func:`speculators_budget`)."""
    if s.betas != (0.9, 0.999):
        raise ValueError(f"betas={list(s.betas)}: speculators' AdamW takes torch's defaults "
                         "(0.9, 0.999); set betas=[0.9,0.999] for an equal comparison")
    _, dtype = PRECISIONS[s.precision]
    # without a calibrated budget: the mean number of tokens of sequences_per_step sequences,
    # and room for the longest one; epochs enough for the steps (the wrapper stops there)
    budget = budget or max(int(data["max_length"]),
                           round(s.sequences_per_step * data["mean_length"]))
    epochs = math.ceil(s.steps * budget / max(1, data["train_tokens"])) * 2 + 2
    return ["--verifier-name-or-path", str(verifier), "--data-path", data["data_path"],
            "--save-path", str(save_path), "--speculator-type", "eagle3",
            "--num-layers", "1", "--draft-arch", "llama",
            "--target-layer-ids", *map(str, fuse_layers),
            "--d2t-path", data["d2t_path"], "--t2d-path", data["t2d_path"],
            "--full-attention-indices", "0",
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
            "--ttt-steps", str(s.positions), "--ttt-step-loss-decay", str(s.decay),
            "--loss-fn", "kl_div", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
            "--optimizer", "adamw", "--lr", str(s.lr), "--weight-decay", str(s.weight_decay),
            "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(s.warmup_steps),
            "--max-steps", str(s.steps), "--epochs", str(epochs),
            "--total-seq-len", str(budget), "--train-data-ratio",
            f"{data['train_data_ratio']:.6f}", "--hidden-states-dtype", dtype,
            "--num-workers", "0", "--seed", str(s.seed), "--log-freq", "10",
            "--log-dir", str(save_path.parent / "logs"),
            "--on-missing", "raise", "--no-resume-from-checkpoint"]


# ----------------------------------------------------------------------------- stages
def prepare(cfg: DictConfig, s: Settings) -> dict[str, Any]:
    """Build (or reuse) draftsmith's feature cache for the preset; returns the loaded target,
    the distill config, the split folders, the fused layer ids, the draft vocabulary map and
    the seconds it took."""
    from hydra import compose, initialize_config_dir

    from draftsmith.data.prepare import prepare_data
    from draftsmith.data.target import load_target
    from draftsmith.data.tiny import target_path_from_config
    from draftsmith.eval.sweep import outside_hydra
    from draftsmith.train.config import resolve_auto_dtypes, resolve_target_defaults

    t0 = time.perf_counter()
    with outside_hydra(), initialize_config_dir(config_dir=str(REPO / "conf"),
                                                version_base="1.3"):
        dcfg = compose(config_name="distill", overrides=[
            f"experiment={cfg.experiment}", "data.features=offline",
            f"train.mixed_precision={PRECISIONS[s.precision][0]}", *cfg.data_overrides])
    resolve_auto_dtypes(dcfg)
    target_path = target_path_from_config(dcfg.target)
    loaded = load_target(target_path,
                         dtype=getattr(torch, dcfg.target.dtype),
                         chat_template=dcfg.target.get("chat_template"))
    resolve_target_defaults(dcfg, loaded.model.config)
    fuse = [int(i) for i in dcfg.draft.config.fuse_layers]
    train_dir, val_dir, report = prepare_data(dcfg.data, loaded, layers=fuse)
    return {"loaded": loaded, "target_path": target_path, "dcfg": dcfg,
            "train_dir": train_dir, "val_dir": val_dir,
            "fuse_layers": fuse, "feature_s": time.perf_counter() - t0, "data_report": report,
            "draft_vocab_size": int(dcfg.draft.config.draft_vocab_size)}


def train_draftsmith(cfg: DictConfig, s: Settings, prep: dict, work: Path) -> dict:
    out = work / "draftsmith"
    cmd = [sys.executable, str(REPO / "train" / "distill.py"),
           *draftsmith_overrides(s, str(cfg.experiment), out, str(prep["dcfg"].target.dtype),
                                 cfg.recipe),
           *cfg.data_overrides]
    code, wall, rss = run_trainer("draftsmith", cmd, work / "draftsmith.log", cfg.timeout_s,
                                  s.threads)
    row = {"trainer": "draftsmith", "version": _own_version(),
           "command": " ".join(cmd[1:]).replace(f"{REPO}/", ""),
           "peak_rss_mib": round(rss), "wall_s": round(wall, 1)}
    if code != 0:
        return {**row, "error": f"exit {code}: {log_tail(work / 'draftsmith.log')}"}
    records = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if x]
    last = [r for r in records if "elapsed_s" in r][-1]
    return {**row, "checkpoint": str(out / "draft"), "trained_tokens": int(last["tokens"]),
            "train_loop_s": float(last["elapsed_s"]), "steps": int(last["step"])}


def train_speculators(cfg: DictConfig, s: Settings, prep: dict, work: Path) -> dict:
    from draftsmith.data.feature_data import FeatureDataset
    from draftsmith.heads.eagle import effective_norm_weight
    from draftsmith.scripts.engine_envs import engine_env
    from draftsmith.scripts.peers_data import peer_python, sequences, write_speculators

    out, model = work / "speculators", prep["loaded"].model
    row: dict[str, Any] = {"trainer": "speculators"}
    python, why = peer_python("speculators", cfg.engines_dir)
    if python is None:
        return {**row, "error": why}
    d2t, t2d = vocab_map(prep)
    fuse = prep["fuse_layers"]
    data = write_speculators(out, sequences(FeatureDataset(prep["train_dir"]), fuse),
                             sequences(FeatureDataset(prep["val_dir"]), fuse),
                             effective_norm_weight(model.model.norm, model.config.hidden_size),
                             d2t, t2d, getattr(torch, PRECISIONS[s.precision][1]))
    lengths, masked = data.pop("train_lengths"), data.pop("train_masked")
    target = prep.get("reference_tokens") or round(
        s.steps * s.sequences_per_step * sum(masked) / len(masked))
    budget = speculators_budget(python, out, s, lengths, masked, target)
    data["budget"] = budget
    args = speculators_args(s, data, Path(str(prep["loaded"].path)), out / "checkpoints", fuse,
                            budget["budget"])
    stats = out / "stats.json"
    runner = REPO / "scripts" / "engine_runners" / "speculators_train.py"
    cmd = [str(python), str(runner), str(stats), str(s.threads), "--", *args]
    code, wall, rss = run_trainer("speculators", cmd, work / "speculators.log", cfg.timeout_s,
                                  s.threads, env=engine_env("speculators", python.parents[1]))
    row.update(command=" ".join([Path(runner).relative_to(REPO).as_posix(), "...", *args]),
               peak_rss_mib=round(rss), wall_s=round(wall, 1), data=data)
    got = json.loads(stats.read_text()) if stats.is_file() else {}
    row["version"] = got.get("version") or "0.9.0"
    if code != 0 or "checkpoint_epoch" not in got:
        return {**row, "error": f"exit {code}: {log_tail(work / 'speculators.log')}"}
    return {**row, "checkpoint": str(out / "checkpoints" / str(got["checkpoint_epoch"])),
            "trained_tokens": int(got["trained_tokens"]),
            "train_loop_s": float(got["train_loop_s"]), "steps": int(got["steps"])}


def speculators_budget(python: Path, out: Path, s: Settings, lengths: list[int],
                       masked: list[int], target: int) -> dict:
    """The token budget per step at which speculators' own packing sampler trains ``target``
    loss-masked tokens in ``s.steps`` steps (``scripts/engine_runners/speculators_budget.py``):
    a budget of ``sequences_per_step`` mean lengths packs fewer tokens than that many rows (the
    first full run here: 79,191 tokens against draftsmith's 91,657), and the comparison is at
    equal trained tokens. Returns ``{"budget", "tokens", "target"}``."""
    import subprocess

    from draftsmith.scripts.engine_envs import engine_env

    job, got = out / "budget_job.json", out / "budget.json"
    per_step = s.sequences_per_step * sum(lengths) / len(lengths)
    job.write_text(json.dumps({"lengths": lengths, "masked": masked, "steps": s.steps,
                               "seed": s.seed, "target": int(target), "low": max(lengths),
                               "high": max(max(lengths), round(2 * per_step)), "stride": 8}))
    runner = REPO / "scripts" / "engine_runners" / "speculators_budget.py"
    subprocess.run([str(python), str(runner), str(job), str(got)], check=True,
                   env=engine_env("speculators", python.parents[1]), timeout=600)
    return json.loads(got.read_text())


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftsmith")
    except PackageNotFoundError:
        return "checkout"


def run(cfg: DictConfig, command: str) -> dict:
    """The whole comparison; returns the results (also written to ``out_dir``)."""
    from draftsmith.scripts import peers_report
    from draftsmith.scripts.peers_modelopt import train_modelopt
    from draftsmith.scripts.peers_specforge import train_specforge

    s = equal_settings(cfg)
    work, out = repo_path(cfg.work_dir), repo_path(cfg.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(s.threads)
    prep = prepare(cfg, s)
    note(TOOL, f"data ready in {prep['feature_s']:.0f} s: {prep['train_dir'].parent}")
    trainers = {"draftsmith": train_draftsmith, "speculators": train_speculators,
                "modelopt": train_modelopt, "specforge": train_specforge}
    rows = []
    for name in cfg.trainers:
        row = trainers[name](cfg, s, prep, work)
        if name == "draftsmith" and "trained_tokens" in row:
            prep["reference_tokens"] = row["trained_tokens"]  # the others match it
        if "train_loop_s" in row:
            row["tokens_per_s"] = row["trained_tokens"] / max(row["train_loop_s"], 1e-9)
        note(TOOL, f"{name}: " + (row.get("error") or f"{row.get('trained_tokens')} tokens in "
                                  f"{row.get('train_loop_s', 0):.0f} s"))
        rows.append(row)
    rows = peers_report.score_all(cfg, prep, rows, work)
    meta = {"settings": asdict(s), "experiment": str(cfg.experiment),
            "fuse_layers": prep["fuse_layers"], "draft_vocab_size": prep["draft_vocab_size"],
            "feature_s": round(prep["feature_s"], 1), "data": prep["data_report"].get("train"),
            "command": command, "threads_env": os.environ.get("OMP_NUM_THREADS")}
    return peers_report.write_results(out, rows, meta)


@hydra.main(config_path=str(CONF_DIR), config_name="peers", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Command line: Hydra overrides of ``conf/eval/peers.yaml``."""
    OmegaConf.resolve(cfg)
    run(cfg, command="python scripts/peers_train.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
