"""``format=dflash``: a DFlash drafter in speculators' ``dflash`` layout, which vLLM 0.32 serves
(``speculators_model_type: dflash``; the layout and its sources: ``scripts/export_layouts.py``).

The drafter's tensors already carry vLLM's names (``fc``, ``hidden_norm``, ``norm``,
``layers.{i}.*``), so the weights are a copy, ``fc``'s column blocks put in ascending layer order
(the order vLLM concatenates the captured layers in). The embedding and LM head are the
verifier's (vLLM shares them when the file has none).

What the config must say, as vLLM reads it (``transformers_utils/configs/speculators/algos.py``
``update_dflash``, ``model_executor/models/qwen3_dflash.py``):

* ``aux_hidden_state_layer_ids``: vLLM's capture index k is the residual stream entering decoder
  layer k (k = 0: the embeddings), i.e. transformers' ``hidden_states[k]``, the id
  ``draft.config.fuse_layers`` uses: written as they are (sorted). The final id (num_layers) is
  refused: transformers' ``hidden_states[-1]`` is after the final norm, vLLM's capture before it.
* ``block_size`` and ``speculative_tokens = block_size - 1``: vLLM's block is the bonus token
  plus ``num_speculative_tokens`` mask slots, so any other count changes what the drafter sees.
* ``sliding_window_non_causal: true`` (else vLLM makes the draft layers causal) and
  ``sample_from_anchor: false`` (slot 0 is the anchor; slots 1..B-1 draft).
* ``transformer_layer_config``: a Qwen3 config (per-head q/k norms, SiLU MLP) with every value
  explicit, ``rope_parameters`` with the target's theta and scaling (vLLM falls back to theta
  1e6 without them) and ``layer_types`` all full attention.
"""
from __future__ import annotations

from typing import Any

import torch

from draftsmith.heads.exports import fc_columns
from draftsmith.heads.package import DraftPackage
from draftsmith.heads.weights import WEIGHTS
from draftsmith.scripts.export_formats import (
    _refuse,
    _save,
    _speculators_config,
    _write_json,
    fused_layer_incompatibilities,
    readable_by_older_loaders,
)

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose dflash config this writes


def dflash_incompatibilities(pkg: DraftPackage) -> list[str]:
    """Why vLLM would compute other drafts than the package's drafter (empty = exact)."""
    return fused_layer_incompatibilities(pkg, "vLLM captures")


def transformer_layer_config(pkg: DraftPackage, dtype: torch.dtype) -> dict[str, Any]:
    """The draft layers as a Qwen3 config, every value explicit (``heads.dflash``'s derived
    config: the target's widths, heads, head dim, RoPE and norm eps; SiLU; no biases)."""
    from transformers import Qwen3Config

    from draftsmith.heads.dflash import dflash_layer_config

    derived = dflash_layer_config(pkg.info["target_config"], pkg.head_config.num_layers)
    n = int(derived.num_hidden_layers)
    qwen3 = Qwen3Config(
        vocab_size=derived.vocab_size, hidden_size=derived.hidden_size,
        intermediate_size=derived.intermediate_size, num_hidden_layers=n,
        num_attention_heads=derived.num_attention_heads,
        num_key_value_heads=derived.num_key_value_heads, head_dim=derived.head_dim,
        hidden_act="silu", max_position_embeddings=derived.max_position_embeddings,
        rms_norm_eps=derived.rms_norm_eps, rope_parameters=dict(derived.rope_parameters),
        attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
        layer_types=["full_attention"] * n, tie_word_embeddings=False,
        bos_token_id=derived.bos_token_id, eos_token_id=derived.eos_token_id,
        pad_token_id=derived.pad_token_id)
    cfg = {k: v for k, v in qwen3.to_dict().items() if not k.startswith("_")}
    cfg.pop("architectures", None)  # the speculator's own (DFlashSpeculator) name the model
    cfg.update(model_type="qwen3", torch_dtype=str(dtype).removeprefix("torch."))
    return readable_by_older_loaders(cfg)


def write_dflash(pkg: DraftPackage, tmp, opts: Any) -> None:
    """Write ``config.json`` and ``model.safetensors`` of a DFlash drafter into ``tmp``."""
    import transformers

    cfg, ident = pkg.head_config, pkg.info["target"]
    _refuse(dflash_incompatibilities(pkg), "speculators 'dflash'", "DFlash drafter")
    fuse = list(cfg.fuse_layers)
    state = pkg.family.saved_state(pkg.module, cfg)
    state["fc.weight"] = fc_columns(state["fc.weight"], fuse, sorted(fuse))
    _save(state, tmp / WEIGHTS, opts.dtype)
    layer_cfg = transformer_layer_config(pkg, opts.dtype)
    _write_json(tmp / "config.json", {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer_cfg,
        "draft_vocab_size": int(ident["vocab_size"]), "block_size": int(cfg.block_size),
        "target_hidden_size": int(ident["hidden_size"]), "aux_hidden_state_layer_ids": sorted(fuse),
        "mask_token_id": int(cfg.mask_token_id), "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        "torch_dtype": str(opts.dtype).removeprefix("torch."),
        "transformers_version": transformers.__version__,
        "speculators_config": _speculators_config(pkg, opts, "dflash")})
