"""SpecForge 0.2.0 in ``make peers``: its offline data, draft config and run config from the
equal settings, and its own trainer through ``scripts/engine_runners/specforge_train.py`` (the
CPU wrapper, its patches listed there), whose SGLang export is what the evaluator reads.

SpecForge's trainer takes ``specforge train --config run.yaml``; on a CPU its documented
switches are ``SPECFORGE_DEVICE=cpu`` (gloo) and ``FSDP_SHARDING=NO_SHARD``. Its environment
(``scripts/engine_envs.py``) holds it ``--no-deps``: its sglang pin is a GPU server.

Where its recipe has no knob for an equal setting it is refused by name rather than run with
another value: its AdamW has no weight decay and torch's betas, and its TTT step losses are
weighted ``0.8 ** i`` (``Eagle3TrainStrategy``'s ``ploss_decay``, not in its config).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from draftsmith.scripts.tooling import REPO

SPECFORGE_PLOSS_DECAY = 0.8  # Eagle3TrainStrategy(ploss_decay=0.8), fixed by its assembly
RUN_ID = "peers"


def draft_config(prep: dict) -> dict:
    """The draft's config for SpecForge (its default draft vocabulary is 32,000 ids): the
    layer draftsmith derives from the target, one layer, the shared draft vocabulary size, and
    the fused layers as SGLang names them (``eagle_config``; SpecForge's export carries this
    config, and SGLang's ``set_eagle3_layers_to_capture`` captures the input of layer id + 1,
    i.e. transformers' ``hidden_states[id + 1]``)."""
    from draftsmith.heads.draft_config import draft_layer_config

    cfg = draft_layer_config(prep["loaded"].model.config).to_dict()
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=prep["draft_vocab_size"],
               eagle_config={"eagle_aux_hidden_state_layer_ids":
                             [i - 1 for i in fused_layers(prep)]})
    return cfg


def fused_layers(prep: dict) -> list[int]:
    """The fused layers in the order SpecForge's data holds them: ascending, the order in which
    SGLang concatenates the layers it captures (so the trained ``fc`` serves as trained)."""
    return sorted(int(i) for i in prep["fuse_layers"])


def settings_refusals(s: Any) -> list[str]:
    """The equal settings SpecForge's recipe cannot take (empty: none)."""
    why = []
    if s.weight_decay != 0.0:
        why.append(f"weight_decay={s.weight_decay}: SpecForge's AdamW (BF16Optimizer) has none")
    if s.betas != (0.9, 0.999):
        why.append(f"betas={list(s.betas)}: SpecForge's AdamW takes torch's (0.9, 0.999)")
    if s.decay != SPECFORGE_PLOSS_DECAY:
        why.append(f"decay={s.decay}: SpecForge weights its TTT steps {SPECFORGE_PLOSS_DECAY} "
                   "** i (Eagle3TrainStrategy.ploss_decay, not in its config)")
    return why


def warmup_ratio(warmup_steps: int, steps: int) -> float:
    """SpecForge's ``warmup_ratio`` for ``warmup_steps`` of ``steps``: its scheduler warms up
    ``int(warmup_ratio * total_steps)`` steps, so the ratio sits half a step above the count
    (``warmup_steps / steps`` can floor to one step fewer)."""
    return min(1.0, (warmup_steps + 0.5) / steps) if warmup_steps else 0.0


def specforge_config(s: Any, prep: dict, data_dir: Path, vocab: Path, out: Path,
                     target: Path | None = None, train_rows: int | None = None) -> dict:
    """SpecForge's run config for the equal settings ``s`` (a ``peers_train.Settings``):
    ``target`` is the target folder as SpecForge reads it (:func:`specforge_target`),
    ``train_rows`` sets enough epochs for the steps (its loader stops at ``max_steps``).

    Raises:
        ValueError: a setting SpecForge's recipe cannot take (:func:`settings_refusals`).
    """
    why = settings_refusals(s)
    if why:
        raise ValueError("; ".join(why))
    model = prep["loaded"].model
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    epochs = math.ceil(s.steps * s.sequences_per_step / max(1, train_rows or 1)) + 1
    return {
        "run_id": RUN_ID, "output_dir": str(out),
        "model": {"target_model_path": str(target or prep["loaded"].path),
                  "draft_model_config": str(out.parent / "draft_config.json"),
                  "draft_num_hidden_layers": 1,
                  "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight",
                  "vocab_mapping_path": str(vocab),
                  # SGLang's ids: layer i captures hidden_states[i + 1]
                  "aux_hidden_state_layer_ids": [i - 1 for i in fused_layers(prep)],
                  "torch_dtype": "bfloat16" if s.precision == "bf16" else "float32"},
        "data": {"hidden_states_path": str(data_dir), "max_length": 2048,
                 "dataloader_num_workers": 0},
        "training": {"strategy": "eagle3", "max_steps": s.steps, "total_steps": s.steps,
                     "num_epochs": epochs, "batch_size": s.sequences_per_step,
                     "learning_rate": s.lr, "lr_scheduler": "cosine",
                     "warmup_ratio": warmup_ratio(s.warmup_steps, s.steps),
                     "max_grad_norm": 1.0, "ttt_length": s.positions,
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": 10, "seed": s.seed},
    }


def vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """SpecForge's ``vocab_mapping.pt``: ``d2t`` as offsets (target id = draft id + d2t) and
    ``t2d``. Its teacher takes the draft vocabulary's columns as ``logits[..., t2d]`` (ascending
    target ids), so draft id i must be the i-th smallest target id."""
    d2t = d2t.long()
    if d2t.numel() > 1 and not bool((d2t[1:] > d2t[:-1]).all()):
        raise ValueError("SpecForge needs the draft vocabulary in ascending target-id order")
    if not torch.equal(torch.nonzero(t2d.bool()).flatten(), d2t):
        raise ValueError("t2d does not mark exactly the d2t ids")
    return {"d2t": d2t - torch.arange(d2t.numel()), "t2d": t2d.bool()}


def specforge_target(target: Path, out: Path) -> Path:
    """The target folder as SpecForge's target head reads it: its ``TargetHead`` looks the LM
    head up through a ``*.index.json`` and finds none beside a single ``model.safetensors``;
    such a target is linked file by file into ``out`` with an index naming that file for every
    tensor. A target that has an index is used as it is."""
    from safetensors import safe_open

    target = Path(target)
    if list(target.glob("*.index.json")):
        return target
    weights = target / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{target} has neither a *.index.json nor a model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        link = out / f.name
        if f.is_file() and not link.exists():
            link.symlink_to(f.resolve())
    with safe_open(str(weights), framework="pt") as fh:
        keys = sorted(fh.keys())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: weights.name for k in keys}}))
    return out


def train_specforge(cfg: DictConfig, s: Any, prep: dict, work: Path) -> dict:
    """Make the environment, write the data and configs, train through the CPU wrapper; the row
    (``checkpoint``: SpecForge's SGLang export), or the exact failure (the settings', the
    environment's, or the trainer's last lines)."""
    import yaml

    from draftsmith.data.feature_data import FeatureDataset
    from draftsmith.scripts.engine_envs import engine_env
    from draftsmith.scripts.peers_data import (
        log_tail,
        peer_python,
        run_trainer,
        sequences,
        vocab_map,
        write_specforge,
    )

    row: dict[str, Any] = {"trainer": "specforge", "version": "0.2.0"}
    out = work / "specforge"
    why = settings_refusals(s)
    if why:
        return {**row, "error": "settings: " + "; ".join(why)}
    python, why_env = peer_python("specforge", cfg.engines_dir)
    if python is None:
        return {**row, "error": why_env}
    rows = write_specforge(out / "data", sequences(FeatureDataset(prep["train_dir"]),
                                                    fused_layers(prep)),
                           torch.bfloat16 if s.precision == "bf16" else torch.float32)
    vocab = out / "vocab_mapping.pt"
    torch.save(vocab_mapping(*vocab_map(prep)), vocab)
    (out / "draft_config.json").write_text(json.dumps(draft_config(prep), indent=1))
    target = specforge_target(Path(str(prep["loaded"].path)), out / "target")
    config = out / "run.yaml"
    config.write_text(yaml.safe_dump(specforge_config(
        s, prep, out / "data", vocab, out / "checkpoints", target=target, train_rows=rows)))
    stats, export = out / "stats.json", out / "export"
    runner = REPO / "scripts" / "engine_runners" / "specforge_train.py"
    cmd = [str(python), str(runner), str(stats), str(export), str(s.threads), "--",
           "train", "--config", str(config)]
    env = {**engine_env("specforge", python.parents[1]), "SPECFORGE_DEVICE": "cpu",
           "FSDP_SHARDING": "NO_SHARD"}
    code, wall, rss = run_trainer("specforge", cmd, work / "specforge.log", cfg.timeout_s,
                                  s.threads, env=env)
    got = json.loads(stats.read_text()) if stats.is_file() else {}
    row.update(command=" ".join(["SPECFORGE_DEVICE=cpu FSDP_SHARDING=NO_SHARD",
                                 runner.relative_to(REPO).as_posix(), "...", *cmd[5:]]),
               data_rows=rows, wall_s=round(wall, 1), peak_rss_mib=round(rss),
               version=got.get("version") or row["version"])
    if code != 0 or "checkpoint" not in got:
        return {**row, "error": f"exit {code}: {log_tail(work / 'specforge.log', 20)}"}
    return {**row, "checkpoint": str(got["checkpoint"]),
            "trained_tokens": int(got["trained_tokens"]),
            "loss_positions": int(got["loss_positions"]),
            "train_loop_s": float(got["train_loop_s"]), "steps": int(got["steps"])}
