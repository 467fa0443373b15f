"""The final-norm hidden state recomputed from a cached layer (``data.features: recompute_final``),
for any decoder stack with full and sliding-window attention layers."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask


def layer_types(config: Any) -> list[str]:
    """The attention type of each decoder layer: ``config.layer_types`` (Gemma 2/3, Qwen 2/3,
    ...), else every layer ``"sliding_attention"`` when the config has a ``sliding_window``
    (Mistral, Phi-3) and ``"full_attention"`` otherwise (Llama)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[:n]
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * n


@torch.no_grad()
def final_from_layer(model: torch.nn.Module, h: torch.Tensor, layer: int) -> torch.Tensor:
    """The final-norm hidden state ``(B, T, H)`` from ``hidden_states[layer]`` ``h (B, T, H)`` of
    right-padded rows: the target's decoder layers ``layer..num_layers-1`` (causal attention,
    positions from 0), then its final norm, in the model's dtype. Padding sits after each row's
    tokens, so causal attention keeps it out of their results.

    As the decoder stacks of transformers do, each layer gets the mask of its attention type
    (:func:`layer_types`: full causal, or causal within the sliding window) and the rotary
    embedding of its type where the model has one per type (Gemma 3: local and global RoPE
    bases)."""
    config, body = model.config, model.model
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("final_from_layer recomputes causal decoder layers; this model attends "
                         "bidirectionally (use_bidirectional_attention), so it is no target")
    x = h.to(device=next(model.parameters()).device, dtype=next(model.parameters()).dtype)
    pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
    types = layer_types(config)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or not hasattr(body, "rotary_emb"):
        raise ValueError(
            f"final_from_layer recomputes decoder stacks of full / sliding-window attention with "
            f"rotary positions; this {config.model_type} model has "
            + (f"layer types {unknown}" if unknown else "no rotary embedding module")
            + ": cache the final hidden state instead (data.features=offline)")
    kw = {"config": config, "inputs_embeds": x, "attention_mask": None, "cache": None,
          "position_ids": pos}
    masks = {t: (create_sliding_window_causal_mask(**kw) if t == "sliding_attention"
                 else create_causal_mask(**kw)) for t in set(types)}
    rotary = body.rotary_emb
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        emb = {t: rotary(x, pos, t) for t in set(types)}
    else:
        shared = rotary(x, position_ids=pos)
        emb = dict.fromkeys(set(types), shared)
    for i in range(layer, config.num_hidden_layers):
        x = body.layers[i](x, attention_mask=masks[types[i]], position_embeddings=emb[types[i]],
                           position_ids=pos, use_cache=False)
        x = x[0] if isinstance(x, tuple) else x
    return body.norm(x)
