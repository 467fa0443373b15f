"""SpecForge 0.2.0 in ``make peers``: its offline data and config from the equal settings, and
one try of its trainer on this CPU, whose exact failure is recorded when it does not train.

SpecForge's trainer takes ``specforge train --config run.yaml``; on a CPU its documented
switches are ``SPECFORGE_DEVICE=cpu`` (gloo) and ``FSDP_SHARDING=NO_SHARD``. Its environment
(``scripts/engine_envs.py``) holds it ``--no-deps``: its sglang pin is a GPU server.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from draftsmith.scripts.tooling import REPO


def draft_config(prep: dict) -> dict:
    """The draft's config for SpecForge (its default draft vocabulary is 32,000 ids): the
    layer draftsmith derives from the target, one layer, the shared draft vocabulary size."""
    from draftsmith.heads.draft_config import draft_layer_config

    cfg = draft_layer_config(prep["loaded"].model.config).to_dict()
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=prep["draft_vocab_size"])
    return cfg


def specforge_config(s: Any, prep: dict, data_dir: Path, vocab: Path, out: Path) -> dict:
    """SpecForge's run config for the equal settings ``s`` (a ``peers_train.Settings``)."""
    model = prep["loaded"].model
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {
        "run_id": "peers", "output_dir": str(out),
        "model": {"target_model_path": str(prep["loaded"].path),
                  "draft_model_config": str(out.parent / "draft_config.json"),
                  "draft_num_hidden_layers": 1,
                  "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight",
                  "vocab_mapping_path": str(vocab),
                  # SGLang's ids: layer i captures hidden_states[i + 1]
                  "aux_hidden_state_layer_ids": [i - 1 for i in prep["fuse_layers"]],
                  "torch_dtype": "bfloat16" if s.precision == "bf16" else "float32"},
        "data": {"hidden_states_path": str(data_dir), "max_length": 2048,
                 "dataloader_num_workers": 0},
        "training": {"strategy": "eagle3", "max_steps": s.steps, "total_steps": s.steps,
                     "batch_size": s.sequences_per_step, "learning_rate": s.lr,
                     "lr_scheduler": "cosine", "warmup_ratio": s.warmup_steps / s.steps,
                     "max_grad_norm": 1.0, "ttt_length": s.positions, "kl_decay": s.decay,
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": 10},
    }


def train_specforge(cfg: DictConfig, s: Any, prep: dict, work: Path) -> dict:
    """Make the environment, write the data and config, run the trainer once; the row records
    the exact failure (the environment's, or the trainer's last lines) when it does not train."""
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
    python, why = peer_python("specforge", cfg.engines_dir)
    if python is None:
        return {**row, "error": why}
    rows = write_specforge(out / "data", sequences(FeatureDataset(prep["train_dir"]),
                                                    prep["fuse_layers"]))
    d2t, t2d = vocab_map(prep)
    vocab = out / "vocab_mapping.pt"
    torch.save({"d2t": d2t - torch.arange(d2t.numel()), "t2d": t2d}, vocab)
    (out / "draft_config.json").write_text(json.dumps(draft_config(prep), indent=1))
    config = out / "run.yaml"
    config.write_text(yaml.safe_dump(specforge_config(s, prep, out / "data", vocab,
                                                      out / "checkpoints")))
    cmd = [str(python), "-m", "specforge.cli", "train", "--config", str(config)]
    env = {**engine_env("specforge", python.parents[1]), "SPECFORGE_DEVICE": "cpu",
           "FSDP_SHARDING": "NO_SHARD"}
    code, wall, rss = run_trainer("specforge", cmd, work / "specforge.log", cfg.timeout_s,
                                  s.threads, env=env)
    row.update(command=" ".join(["SPECFORGE_DEVICE=cpu FSDP_SHARDING=NO_SHARD",
                                 *cmd[1:]]).replace(str(REPO) + "/", ""),
               data_rows=rows, wall_s=round(wall, 1), peak_rss_mib=round(rss))
    if code != 0:
        return {**row, "error": f"exit {code}: {log_tail(work / 'specforge.log', 20)}"}
    return {**row, "error": "SpecForge exited 0; its checkpoint is not read by this comparison "
                            "yet (no importer for its layout)"}
