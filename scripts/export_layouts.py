"""What each export format must contain: file names, config keys, tensor names and shapes.

This is the written specification the exporter follows and the tests check against (the file
names and the draft family of each format, which the reader needs too, are in
``heads/exports.py``). Key names and semantics were read from these sources (versions as stored
in the public index):

* ``hf``: transformers ``LlamaForCausalLM`` (``save_pretrained``; loaded by
  ``AutoModelForCausalLM`` and used as ``assistant_model`` in ``generate``).
* ``medusa``: FasterDecoding/Medusa ``medusa/model/medusa_model.py`` (commit 11af0aa):
  ``medusa_head[i] = Sequential(ResBlock * N, Linear(H, V, bias=False))`` with
  ``ResBlock.linear = Linear(H, H)`` (bias), so the state dict keys are ``{i}.{j}.linear.weight``,
  ``{i}.{j}.linear.bias`` and ``{i}.{N}.weight``; config ``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path``. The weights file name
  ``medusa_lm_head.safetensors`` is the one Medusa's training script writes and TGI /
  TensorRT-LLM read.
* ``eagle`` (EAGLE-1/2 layout): SafeAILab/EAGLE ``eagle/model/cnets1.py`` (commit 2174a79):
  ``fc = Linear(2H, H, bias=True)`` applied to ``cat(embedding, feature)``; decoder layer 0 has no
  ``input_layernorm``; no output norm; the target's LM head. Read the same way by
  vllm-project/vllm ``vllm/model_executor/models/llama_eagle.py`` (layer 0 input norm replaced by
  identity, ``fc`` without bias, weights ``fc.weight`` and ``layers.0.*``, architectures
  ``LlamaForCausalLM`` renamed to ``EagleLlamaForCausalLM`` by ``EAGLEConfig``) and by
  sgl-project/sglang ``python/sglang/srt/models/llama_eagle.py`` (``LlamaForCausalLMEagle``,
  ``fc`` with bias). draftsmith's ``layout=eagle1`` EAGLE head has this structure with a
  bias-free ``fc``; config ``bias`` says whether ``fc.bias`` is stored, and ``engine=sglang``
  exports store an all-zero ``fc.bias`` since SGLang always builds one.
* ``speculators`` (algorithm ``eagle``): vllm-project/speculators ``src/speculators/models/
  eagle.py`` (``EagleSpeculator``: ``fusion_fc`` on ``cat(embedding, feature)``, ``transformer``
  = one ``LlamaDecoderLayer`` whose ``input_layernorm`` is identity when ``layernorms`` is false)
  and vllm ``vllm/transformers_utils/configs/speculators/base.py`` (``speculators_model_type``,
  ``speculators_config.proposal_methods[0].speculative_tokens``,
  ``speculators_config.verifier.name_or_path``, ``transformer_layer_config``).
* ``eagle3`` (EAGLE-3 layout, ``LlamaForCausalLMEagle3``): vllm ``vllm/model_executor/models/
  llama_eagle3.py`` 0.32.0 (``Eagle3LlamaForCausalLM``; ``midlayer.`` renamed to ``layers.0.``;
  ``d2t`` loaded as ``draft_id_to_target_id`` and added to the draft id; ``t2d`` skipped; no
  ``embed_tokens`` = the target's shared), SGLang ``python/sglang/srt/models/llama_eagle3.py``
  and SafeAILab/EAGLE ``eagle/model/cnets.py``: ``fc = Linear(k*H, H, bias=False)`` on the
  captured target layers (``eagle_config.eagle_aux_hidden_state_layer_ids``, concatenated in
  ascending layer order; in vLLM id i = the input of target layer i, i.e. transformers'
  ``hidden_states[i]`` for i < num_layers; SGLang's ``set_eagle3_layers_to_capture`` captures
  the input of layer id + 1, so ``engine=sglang`` exports write i - 1; both engines' defaults
  without ids are hidden_states[2, L // 2, L - 3]; SGLang's ``fc`` is fixed at 3 layers);
  ``midlayer.*`` whose attention reads
  ``cat(input_layernorm(embedding), hidden_norm(fc_out))`` (q/k/v take 2H inputs) with the fc
  output as residual (``norm_before_residual=false``); ``norm``; ``lm_head (V_draft, H)``;
  ``d2t (V_draft,)`` offsets ``target_id - i``; ``t2d (V,) bool``. The next draft step feeds the
  layer's pre-norm output back without fc.
* ``speculators`` (algorithm ``eagle3``, speculators 0.9.0 ``src/speculators/models/eagle3/``):
  the same tensors under ``layers.0.*``; config ``speculators_model_type: eagle3``,
  ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``,
  ``eagle_aux_hidden_state_layer_ids``, ``speculators_config`` (vllm ``transformers_utils/
  configs/speculators/algos.py`` maps it onto the EAGLE-3 model above).
* ``dflash`` (speculators ``dflash``, vLLM 0.32 ``model_executor/models/qwen3_dflash.py``
  ``DFlashQwen3ForCausalLM``, config mapped by ``transformers_utils/configs/speculators/algos.py``
  ``update_dflash``; speculators 0.9.0 ``src/speculators/models/dflash/``): ``fc (H, k*H)`` over
  the captured layers (``aux_hidden_state_layer_ids``, ascending; vLLM id k = the input of target
  layer k = transformers' ``hidden_states[k]``; vLLM derives z-lab's ``target_layer_ids`` as
  k - 1), ``hidden_norm``, ``norm`` and per layer ``layers.{i}.input_layernorm``,
  ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm (head_dim,)``
  and ``mlp.{gate,up,down}_proj``, no ``model.`` prefix (vLLM adds it); no ``embed_tokens`` /
  ``lm_head`` = the verifier's, shared. Config: ``speculators_model_type: dflash``,
  ``transformer_layer_config`` (a Qwen3 config), ``draft_vocab_size``, ``block_size``,
  ``target_hidden_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id`` (required by vLLM),
  ``sample_from_anchor``, ``sliding_window_non_causal`` (vLLM makes the layers causal unless
  true) and ``speculators_config`` with ``speculative_tokens = block_size - 1`` (vLLM's query
  block is the bonus token plus that many mask slots).
"""
from __future__ import annotations

from typing import Any

from draftsmith.heads.medusa import MEDUSA_WEIGHTS
from draftsmith.heads.weights import WEIGHTS

# Config keys each format's config.json must carry.
REQUIRED_CONFIG: dict[str, tuple[str, ...]] = {
    "hf": ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "intermediate_size"),
    "eagle": ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
              "bias"),
    "eagle3": ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
               "draft_vocab_size", "eagle_config"),
    "speculators": ("architectures", "speculators_model_type", "speculators_version",
                    "transformer_layer_config", "speculators_config"),
    "medusa": ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path", "hidden_size",
               "vocab_size", "architectures", "model_type"),
    "dflash": ("architectures", "speculators_model_type", "speculators_version",
               "transformer_layer_config", "speculators_config", "draft_vocab_size", "block_size",
               "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
               "sample_from_anchor", "sliding_window_non_causal"),
}
# Files each format must contain besides manifest.json.
REQUIRED_FILES: dict[str, tuple[str, ...]] = {
    "hf": ("config.json", "generation_config.json", WEIGHTS),
    "eagle": ("config.json", WEIGHTS),
    "eagle3": ("config.json", WEIGHTS),
    "speculators": ("config.json", WEIGHTS),
    "medusa": ("config.json", MEDUSA_WEIGHTS),
    "dflash": ("config.json", WEIGHTS),
}


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or n
    hd = cfg.get("head_dim") or h // n
    return h, cfg["intermediate_size"], n, kv, hd, cfg["vocab_size"]


def decoder_layer(prefix: str, cfg: dict[str, Any], input_norm: bool = True) -> dict[str, tuple]:
    """Tensor shapes of one Llama decoder layer (no biases) under ``prefix``."""
    h, inter, n, kv, hd, _ = _dims(cfg)
    out = {
        f"{prefix}self_attn.q_proj.weight": (n * hd, h),
        f"{prefix}self_attn.k_proj.weight": (kv * hd, h),
        f"{prefix}self_attn.v_proj.weight": (kv * hd, h),
        f"{prefix}self_attn.o_proj.weight": (h, n * hd),
        f"{prefix}mlp.gate_proj.weight": (inter, h),
        f"{prefix}mlp.up_proj.weight": (inter, h),
        f"{prefix}mlp.down_proj.weight": (h, inter),
        f"{prefix}post_attention_layernorm.weight": (h,),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = (h,)
    return out


def hf_tensors(cfg: dict[str, Any]) -> dict[str, tuple]:
    """``format=hf``: a full ``LlamaForCausalLM`` (``lm_head`` absent when embeddings are tied)."""
    h, *_, v = _dims(cfg)
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        out.update(decoder_layer(f"model.layers.{i}.", cfg))
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def eagle_tensors(cfg: dict[str, Any]) -> dict[str, tuple]:
    """``format=eagle``: EAGLE-1 layout (embedding and LM head come from the target)."""
    h = cfg["hidden_size"]
    out = {"fc.weight": (h, 2 * h)}
    if cfg.get("bias", True):
        out["fc.bias"] = (h,)
    out.update(decoder_layer("layers.0.", cfg, input_norm=False))
    return out


# Config keys of each speculators type besides REQUIRED_CONFIG["speculators"].
SPECULATORS_TYPE_CONFIG = {"eagle": ("layernorms", "fusion_bias"),
                           "eagle3": ("draft_vocab_size", "norm_before_residual",
                                      "eagle_aux_hidden_state_layer_ids")}


def eagle3_tensors(cfg: dict[str, Any], layer_prefix: str = "midlayer.",
                   num_fused: int | None = None) -> dict[str, tuple]:
    """``format=eagle3``: fc over the captured layers, the 2H-input layer, norm, draft LM head and
    (reduced vocabulary) d2t / t2d."""
    h, _, n, kv, hd, v = _dims(cfg)
    k = num_fused or len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    vd = cfg.get("draft_vocab_size") or v
    out = decoder_layer(layer_prefix, cfg)
    out.update({f"{layer_prefix}self_attn.q_proj.weight": (n * hd, 2 * h),
                f"{layer_prefix}self_attn.k_proj.weight": (kv * hd, 2 * h),
                f"{layer_prefix}self_attn.v_proj.weight": (kv * hd, 2 * h),
                f"{layer_prefix}hidden_norm.weight": (h,), "fc.weight": (h, k * h),
                "norm.weight": (h,), "lm_head.weight": (vd, h)})
    if vd != v:
        out.update({"d2t": (vd,), "t2d": (v,)})
    return out


def speculators_tensors(cfg: dict[str, Any]) -> dict[str, tuple]:
    """``format=speculators``: ``Eagle3Speculator`` (type ``eagle3``), or the legacy
    ``EagleSpeculator`` with ``layernorms: false`` (type ``eagle``)."""
    layer_cfg = cfg["transformer_layer_config"]
    if cfg["speculators_model_type"] == "eagle3":
        return eagle3_tensors({**layer_cfg, "draft_vocab_size": cfg["draft_vocab_size"]},
                              "layers.0.", len(cfg["eagle_aux_hidden_state_layer_ids"]))
    h = layer_cfg["hidden_size"]
    out = {"fusion_fc.weight": (h, 2 * h)}
    if cfg.get("fusion_bias", False):
        out["fusion_fc.bias"] = (h,)
    out.update(decoder_layer("transformer.", layer_cfg, input_norm=False))
    return out


def medusa_tensors(cfg: dict[str, Any]) -> dict[str, tuple]:
    """``format=medusa``: head i = ``{i}.{j}.linear`` residual blocks then ``{i}.{N}`` LM head."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n_layers = cfg["medusa_num_layers"]
    out: dict[str, tuple] = {}
    for i in range(cfg["medusa_num_heads"]):
        for j in range(n_layers):
            out[f"{i}.{j}.linear.weight"] = (h, h)
            out[f"{i}.{j}.linear.bias"] = (h,)
        out[f"{i}.{n_layers}.weight"] = (v, h)
    return out


def dflash_tensors(cfg: dict[str, Any]) -> dict[str, tuple]:
    """``format=dflash``: fc over the captured layers, hidden_norm, norm and the Qwen3-style
    layers with per-head q / k norms (embedding and LM head: the verifier's)."""
    layer_cfg = cfg["transformer_layer_config"]
    h, *_ = _dims(layer_cfg)
    hd = layer_cfg.get("head_dim") or h // layer_cfg["num_attention_heads"]
    k = len(cfg["aux_hidden_state_layer_ids"])
    out = {"fc.weight": (h, k * cfg["target_hidden_size"]), "hidden_norm.weight": (h,),
           "norm.weight": (h,)}
    for i in range(layer_cfg["num_hidden_layers"]):
        out.update(decoder_layer(f"layers.{i}.", layer_cfg))
        out.update({f"layers.{i}.self_attn.q_norm.weight": (hd,),
                    f"layers.{i}.self_attn.k_norm.weight": (hd,)})
    return out


EXPECTED_TENSORS = {"hf": hf_tensors, "eagle": eagle_tensors, "eagle3": eagle3_tensors,
                    "speculators": speculators_tensors, "medusa": medusa_tensors,
                    "dflash": dflash_tensors}


def layout_problems(fmt: str, config: dict[str, Any], shapes: dict[str, tuple]) -> list[str]:
    """Differences between an export's config/tensors and the written layout (empty = conforms).

    Args:
        fmt: one of ``heads.exports.export_formats()``.
        config: the export's ``config.json``.
        shapes: tensor name -> shape read from its weights file.
    """
    required = REQUIRED_CONFIG[fmt]
    if fmt == "speculators":
        required += SPECULATORS_TYPE_CONFIG.get(config.get("speculators_model_type"), ())
    problems = [f"config.json lacks '{k}'" for k in required if k not in config]
    if problems:
        return problems
    want = EXPECTED_TENSORS[fmt](config)
    for name in sorted(set(want) - set(shapes)):
        problems.append(f"tensor '{name}' is missing (expected shape {want[name]})")
    for name in sorted(set(shapes) - set(want)):
        problems.append(f"tensor '{name}' is not part of the {fmt} layout")
    for name in sorted(set(want) & set(shapes)):
        if tuple(shapes[name]) != tuple(want[name]):
            problems.append(f"tensor '{name}' has shape {tuple(shapes[name])}, the layout says "
                            f"{tuple(want[name])}")
    return problems
