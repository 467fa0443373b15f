"""Load speculators-format exports with speculators' own ``from_pretrained``; run inside the
speculators environment.

    <engines>/speculators/bin/python scripts/engine_runners/speculators_run.py JOB.json RESULT.json

JOB.json: ``exports`` (folders). speculators resolves the model class from the config's
``speculators_model_type``, validates the config with its own schema, loads the weights (and the
verifier's embedding and LM head from the verifier path the config names). RESULT.json per
export: whether it loaded, the class, the weights the export holds that the model lacks or
differ from the loaded values, the model's weights the export left unset (beside the ones
speculators fills from the verifier), and the config values as speculators read them; or the
error. This file imports only speculators, torch and safetensors.
"""
from __future__ import annotations

FROM_VERIFIER = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")


def run_one(job: dict, path: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(path)
    state = model.state_dict()
    stored = load_file(f"{path}/model.safetensors")
    differ = sorted(k for k, v in stored.items()
                    if k not in state or not torch.equal(state[k].to(v.dtype), v))
    unset = sorted(k for k in state if k not in stored and not k.startswith(FROM_VERIFIER))
    cfg = model.config
    return {"export": path, "ok": True, "class": type(model).__name__, "differ": differ,
            "unset": unset,
            "config": {"speculators_model_type": cfg.speculators_model_type,
                       "draft_vocab_size": getattr(cfg, "draft_vocab_size", None),
                       "norm_before_residual": getattr(cfg, "norm_before_residual", None),
                       "eagle_aux_hidden_state_layer_ids":
                           getattr(cfg, "eagle_aux_hidden_state_layer_ids", None),
                       "speculative_tokens":
                           cfg.speculators_config.proposal_methods[0].speculative_tokens}}


if __name__ == "__main__":
    from runner import main

    main("speculators", "speculators", run_one, items="exports",
         label=lambda path: {"export": path})
