"""Draft configs derived from the target's, never the target's config object itself.

A draft layer must not be built from the target's own config: a Gemma 3 config has no
``mlp_bias``, a Qwen 2 config asks for attention biases, a Gemma config keys its RoPE parameters
by layer type. :func:`draft_layer_config` reads what a draft layer needs from any causal LM's
config (hidden size, heads, KV heads, head dim, MLP width, RoPE type / theta / scaling, norm eps,
activation, vocabulary, special ids) and writes it into an explicit ``LlamaConfig``: the layer
type EAGLE serving engines use for every target (vLLM's and SGLang's ``llama_eagle3`` and
``llama_eagle``, speculators' ``eagle3``). The result is stored in every package and export.

:func:`draft_model_config` does the same for a whole draft LM of the target's own architecture
(so target layers can seed it), with fewer layers and the layer types of the layers it copies.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import LlamaConfig, PretrainedConfig

# RoPE keys a Llama layer understands; others (e.g. partial_rotary_factor) are dropped
_ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings",
              "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
              "attention_factor", "mscale", "mscale_all_dim", "short_factor", "long_factor")
# layer types a draft's decoder (or the decoder's target side) knows how to mask
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedTargetError(ValueError):
    """The target's architecture has a part the draft families or the decoder cannot serve."""


def text_config(config: Any) -> PretrainedConfig:
    """The text decoder's config (``get_text_config`` of a multimodal config; else itself)."""
    if isinstance(config, dict):
        config = _config_from_dict(config)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _config_from_dict(d: dict) -> PretrainedConfig:
    from transformers import AutoConfig

    d = {k: v for k, v in d.items() if not k.startswith("_")}
    model_type = d.pop("model_type", "llama")
    return AutoConfig.for_model(model_type, **d)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of the target's full-attention layers, as one flat dict.

    transformers 5 keys them by layer type where layer types differ (Gemma 3:
    ``{"full_attention": {...}, "sliding_attention": {...}}``); older configs carry
    ``rope_theta`` and ``rope_scaling``. A draft layer attends over the whole context, so it takes
    the full-attention layers' parameters.
    """
    tc = text_config(config)
    rope = getattr(tc, "rope_parameters", None) or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(tc, "rope_theta", None) or 10000.0)
    scaling = getattr(tc, "rope_scaling", None)
    if isinstance(scaling, dict):
        rope = {**scaling, **rope}
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return {k: rope[k] for k in _ROPE_KEYS if rope.get(k) is not None}


def _first(tc: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(tc, name, None)
        if value is not None:
            return value
    return default


def draft_layer_config(target_config: Any, num_layers: int = 1) -> LlamaConfig:
    """An explicit Llama-style config for a draft decoder layer serving ``target_config``.

    Works for any causal LM config that names its widths the transformers way (Llama, Qwen 2/3,
    Mistral, Gemma 2/3, Phi-3, ...) and is idempotent: deriving from a derived config gives it
    back. The layer has no biases (what engines' EAGLE layers load), the target's activation,
    norm eps, head dim and full-attention RoPE.

    Args:
        target_config: the target's model config (``PretrainedConfig`` or its dict).
        num_layers: decoder layers of the draft (1 for an EAGLE head).

    Returns:
        A ``LlamaConfig`` with every field a draft layer reads set explicitly.
    """
    tc = text_config(target_config)
    hidden = int(tc.hidden_size)
    heads = int(tc.num_attention_heads)
    kv_heads = int(_first(tc, "num_key_value_heads", default=heads))
    head_dim = int(_first(tc, "head_dim", default=hidden // heads))
    cfg = LlamaConfig(
        vocab_size=int(tc.vocab_size), hidden_size=hidden,
        intermediate_size=int(tc.intermediate_size), num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_act=str(_first(tc, "hidden_activation", "hidden_act", default="silu")),
        max_position_embeddings=int(_first(tc, "max_position_embeddings", default=4096)),
        rms_norm_eps=float(_first(tc, "rms_norm_eps", "layer_norm_eps", "norm_eps",
                                  default=1e-6)),
        rope_parameters=rope_parameters(tc), attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None))
    cfg._attn_implementation = "sdpa"
    return cfg


def draft_model_config(target_config: Any, num_layers: int, hidden_size: int,
                       intermediate_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int | None, source_layers: Sequence[int] = ()
                       ) -> PretrainedConfig:
    """The config of a draft LM of the target's own architecture with the given sizes.

    The target's config is copied field by field into a new config of its class (quantization
    settings dropped); sizes are replaced; ``layer_types`` (sliding / full attention) follow the
    target layers the draft copies (``source_layers``), or the target's first ``num_layers``.

    Args:
        target_config: the target's model config.
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads: draft sizes.
        head_dim: attention head width; None = the target's when the widths are the target's,
            else ``hidden_size // num_heads``.
        source_layers: target layer ids the draft's layers are copied from (same length as
            ``num_layers``) or empty.

    Returns:
        A config of the target's class, ready for ``AutoModelForCausalLM.from_config``.
    """
    tc = text_config(target_config)
    d = {k: v for k, v in tc.to_dict().items() if not k.startswith("_")}
    d.pop("quantization_config", None)
    same = (hidden_size, num_heads) == (tc.hidden_size, tc.num_attention_heads)
    if head_dim is None:
        head_dim = int(_first(tc, "head_dim", default=hidden_size // num_heads)) if same \
            else hidden_size // num_heads
    d.update(num_hidden_layers=num_layers, hidden_size=hidden_size,
             intermediate_size=intermediate_size, num_attention_heads=num_heads,
             num_key_value_heads=num_kv_heads, head_dim=head_dim)
    types = d.get("layer_types")
    if types:
        src = list(source_layers) or list(range(num_layers))
        d["layer_types"] = [types[i] for i in src]
    for key in ("max_window_layers",):  # Qwen 2: windowed layers counted from the bottom
        if key in d and d[key] is not None:
            d[key] = min(int(d[key]), num_layers)
    cfg = type(tc)(**{k: v for k, v in d.items() if k != "model_type"})
    cfg._attn_implementation = getattr(tc, "_attn_implementation", None)  # Gemma 2: eager
    return cfg


def check_attention_layers(config: Any) -> None:
    """Refuse a target whose layers keep state the decoder cannot crop (recurrent, linear
    attention, chunked attention): speculative decoding rolls the cache back after each
    verification, which only key/value caches of (sliding-window) attention allow."""
    tc = text_config(config)
    types = getattr(tc, "layer_types", None) or []
    bad = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
    if bad:
        raise UnsupportedTargetError(
            f"the target '{tc.model_type}' has layers of type {bad}; draftsmith drafts for "
            f"targets whose layers are {list(ATTENTION_LAYER_TYPES)} only (the decoder rolls "
            "each layer's key/value cache back after verification, which recurrent or chunked "
            "layers do not allow). Use a transformer target with full or sliding-window "
            "attention.")
