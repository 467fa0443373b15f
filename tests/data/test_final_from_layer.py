"""final_from_layer on the decoder stacks of several families: per-layer-type masks (full and
sliding-window attention) and per-layer-type rotary embeddings, as transformers' own forward."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import create_causal_mask

from draftsmith.data.final_layer import final_from_layer, layer_types

SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}
WINDOW = 4  # shorter than the sequences below, so sliding layers see less than full ones
T = 13


def _gemma3() -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(**SHAPE, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention", "sliding_attention"],
                           rope_parameters={
                               "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 1e4}})
    return Gemma3ForCausalLM(cfg)


MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=3)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        **SHAPE, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, num_hidden_layers=3, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, num_hidden_layers=3,
                                                        sliding_window=WINDOW)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SHAPE, num_hidden_layers=4, head_dim=16,
                                                     sliding_window=WINDOW)),
    "gemma3": _gemma3,
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**SHAPE, num_hidden_layers=2,
                                               pad_token_id=0)),
}


def _run(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    with torch.no_grad():  # larger weights than the init: layers that matter, visible errors
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(1, 128, (2, T))
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return model, out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_final_from_every_layer_is_the_models_own_final_hidden_state(name):
    model, out = _run(name)
    n = model.config.num_hidden_layers
    for layer in range(n):
        got = final_from_layer(model, out.hidden_states[layer], layer)
        torch.testing.assert_close(got, out.last_hidden_state, atol=1e-5, rtol=1e-5,
                                   msg=f"{name}: recomputed from layer {layer}")


def test_layer_types_of_configs_without_the_key():
    assert set(layer_types(MODELS["llama"]().config)) == {"full_attention"}
    assert set(layer_types(MODELS["mistral"]().config)) == {"sliding_attention"}
    assert layer_types(_gemma3().config)[2] == "full_attention"


def _single_mask_final(model, h, layer):
    """The Llama-only recomputation: one causal mask and one rotary embedding for all layers."""
    body = model.model
    pos = torch.arange(h.shape[1]).unsqueeze(0).expand(h.shape[0], -1)
    emb = body.rotary_emb(h, pos, "full_attention")
    mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None,
                              cache=None, position_ids=pos)
    x = h
    for block in body.layers[layer:]:
        x = block(x, attention_mask=mask, position_embeddings=emb, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
    return body.norm(x)


def test_one_mask_for_every_layer_is_wrong_for_gemma3_with_a_short_window():
    """The twin: with a window shorter than the sequence, the single causal mask (and the one
    rotary base) of the Llama recipe gives another final hidden state."""
    model, out = _run("gemma3")
    with torch.no_grad():
        wrong = _single_mask_final(model, out.hidden_states[0], 0)
    assert (wrong - out.last_hidden_state).abs().max() > 1e-2
