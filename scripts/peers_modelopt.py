"""ModelOpt 0.47.0 in ``make peers``: its offline data, its EAGLE-3 config and training
arguments from the equal settings, and the run through
``scripts/engine_runners/modelopt_train.py`` (which says what it does for ModelOpt's example
script, absent from the wheel). Its export is what the evaluator reads."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from draftsmith.scripts.tooling import REPO


def modelopt_job(s: Any, prep: dict, out: Path, d2t_path: Path) -> dict:
    """The runner's JOB.json for the equal settings ``s`` (a ``peers_train.Settings``)."""
    from draftsmith.heads.draft_config import draft_layer_config, rope_parameters

    layer = draft_layer_config(prep["loaded"].model.config)
    theta = float(rope_parameters(layer)["rope_theta"])
    arch = {"num_hidden_layers": 1, "intermediate_size": layer.intermediate_size,
            "num_attention_heads": layer.num_attention_heads,
            "num_key_value_heads": layer.num_key_value_heads, "head_dim": layer.head_dim,
            "rms_norm_eps": layer.rms_norm_eps, "hidden_act": layer.hidden_act,
            "rope_theta": theta, "rope_scaling": {"rope_type": "default", "rope_theta": theta},
            "draft_vocab_size": prep["draft_vocab_size"], "use_aux_hidden_state": True,
            "use_last_layernorm": True,
            # ModelOpt names a captured layer by its output: hidden_states[i] is layer i - 1's
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in prep["fuse_layers"]]}
    eagle = {"eagle_offline": True, "eagle_decoder_type": "llama",
             "eagle_ttt_steps": s.positions, "eagle_loss_decay_factor": s.decay,
             "eagle_use_torch_compile": False, "eagle_self_logit_distillation": True,
             "eagle_mix_hidden_states": False, "eagle_export_rope_scaling": {},
             "eagle_architecture_config": arch}
    training = {"output_dir": str(out / "trainer"), "max_steps": s.steps,
                "per_device_train_batch_size": s.sequences_per_step, "learning_rate": s.lr,
                "lr_scheduler_type": "cosine", "warmup_steps": s.warmup_steps,
                "weight_decay": s.weight_decay, "adam_beta1": s.betas[0],
                "adam_beta2": s.betas[1], "max_grad_norm": 1.0, "bf16": s.precision == "bf16",
                "use_cpu": True, "logging_steps": 10, "save_strategy": "no", "report_to": [],
                "dataloader_num_workers": 0, "dataloader_drop_last": True,
                "remove_unused_columns": False, "seed": s.seed, "disable_tqdm": True}
    return {"target": str(prep["loaded"].path), "data": str(out / "data"),
            "d2t_path": str(d2t_path), "export": str(out / "export"), "threads": s.threads,
            "seed": s.seed, "eagle": eagle, "training": training}


def train_modelopt(cfg: DictConfig, s: Any, prep: dict, work: Path) -> dict:
    """Make the environment, write the data, train, export; the row (or the exact failure)."""
    from draftsmith.data.feature_data import FeatureDataset
    from draftsmith.scripts.engine_envs import engine_env
    from draftsmith.scripts.peers_data import (
        log_tail,
        peer_python,
        run_trainer,
        sequences,
        vocab_map,
        write_modelopt,
    )

    row: dict[str, Any] = {"trainer": "modelopt", "version": "0.47.0"}
    out = work / "modelopt"
    python, why = peer_python("modelopt", cfg.engines_dir)
    if python is None:
        return {**row, "error": why}
    write_modelopt(out / "data", sequences(FeatureDataset(prep["train_dir"]),
                                           prep["fuse_layers"]))
    d2t, _ = vocab_map(prep)
    d2t_path = out / "d2t.pt"
    torch.save(d2t.long() - torch.arange(d2t.numel()), d2t_path)  # offsets
    job, stats = out / "job.json", out / "stats.json"
    job.write_text(json.dumps(modelopt_job(s, prep, out, d2t_path), indent=1))
    runner = REPO / "scripts" / "engine_runners" / "modelopt_train.py"
    cmd = [str(python), str(runner), str(job), str(stats)]
    code, wall, rss = run_trainer("modelopt", cmd, work / "modelopt.log", cfg.timeout_s,
                                  s.threads, env=engine_env("modelopt", python.parents[1]))
    got = json.loads(stats.read_text()) if stats.is_file() else {}
    row.update(command=f"{runner.relative_to(REPO).as_posix()} {job} {stats}",
               peak_rss_mib=round(rss), wall_s=round(wall, 1),
               version=got.get("version") or row["version"])
    if code != 0 or not (out / "export" / "model.safetensors").is_file():
        return {**row, "error": f"exit {code}: {log_tail(work / 'modelopt.log', 20)}"}
    return {**row, "checkpoint": str(out / "export"), "trained_tokens": int(got["trained_tokens"]),
            "train_loop_s": float(got["train_loop_s"]), "steps": int(got["steps"])}
