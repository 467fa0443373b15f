"""Draft family 3: an EAGLE feature-level head (one decoder layer of the target's architecture).

Input at position t is the pair (feature f_t, embedding of token x_{t+1}); the output is the
predicted feature f_{t+1} (the target's final-norm hidden state, i.e. the LM-head input), whose
logits predict token t+2. Teacher for output position t is p_{t+1}; regression target hidden_{t+1}.

Layout: ``fc`` fuses ``[features (k*H), embedding (H)] -> H``; ``layer`` is a transformers
``LlamaDecoderLayer`` built from a draft config derived from the target's
(``heads.draft_config.draft_layer_config``: the Llama-style layer engines serve for every target);
``lm_head`` is the frozen target LM head, or
a trainable reduced-vocabulary head (EAGLE-3 style) with buffers ``d2t`` (draft id -> target id)
and ``t2d`` (target id is in the draft vocabulary). ``EagleConfig.layout`` picks the rest:

* ``"eagle1"`` (default): what EAGLE-1 serving engines compute, so the head exports exactly
  (``scripts/export.py``): ``fc`` has no bias, the layer's ``input_layernorm`` is an
  ``nn.Identity`` (the post-attention norm stays) and there is no output norm (``norm`` is an
  ``nn.Identity``): the layer's residual output goes straight to the LM head.
* ``"normed"``: ``fc`` with a bias, the layer's own input norm, and an output RMSNorm ``norm``
  initialised from the target's final norm. No engine layout expresses it.
* ``"eagle3"``: what EAGLE-3 serving engines compute (vLLM ``llama_eagle3.py``, SGLang
  ``llama_eagle3.py``, speculators ``eagle3``), so it exports exactly (``format=eagle3`` /
  ``speculators``). ``fc: k*H -> H`` (no bias) fuses the target layers alone (k >= 2); the layer
  (:class:`Eagle3Layer`) attends over ``[input_norm(embedding), hidden_norm(x)]`` (width 2H) with
  ``x`` as the residual stream; ``forward`` returns the pre-norm output, which is also the next
  step's input feature (no fusion on the head's own predictions), and ``compute_logits`` applies
  the output RMSNorm ``norm`` (initialised from the target's final norm) before the LM head.

With several fused target layers (k > 1) the head's own predictions (width H) cannot stand in
for the k*H fused input, so in the EAGLE-1 and normed layouts a second fusion layer
``self_fc: [H, H] -> H`` handles inputs of width H; ``forward`` picks the layer by the feature
width. With k = 1 both widths are equal and ``fc`` serves both.

Training (fused features, training-time-test unrolling, ``distill_targets``):
``heads/eagle_ttt.py``, which builds on this module.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import skip_init
from transformers import DynamicCache, LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from draftsmith.heads.blocks import (
    additive_mask,
    attach_target_embeddings,
    causal_allowed,
    master_dtype,
)
from draftsmith.heads.eagle_config import EagleConfig, head_llama_config
from draftsmith.heads.vocab import build_vocab_map

log = logging.getLogger(__name__)


@torch.no_grad()
def effective_norm_weight(norm: nn.Module, hidden_size: int) -> Tensor:
    """The per-channel scale an RMS norm applies, read by probing it (a Llama norm multiplies by
    ``weight``, a Gemma norm by ``1 + weight``): the norm of a constant vector of RMS 1000."""
    w = next(norm.parameters())
    x = torch.full((1, hidden_size), 1000.0, dtype=w.dtype, device=w.device)
    return norm(x)[0]


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads ``[input_layernorm(embedding), hidden_norm(x)]``
    (width 2H); the residual stream is ``x`` itself (the engines' default
    ``norm_before_residual=False``); the MLP half is the target architecture's."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        base = LlamaDecoderLayer(config, layer_idx=0)
        h, attn = config.hidden_size, base.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.self_attn, self.mlp = attn, base.mlp
        self.input_layernorm = base.input_layernorm
        self.post_attention_layernorm = base.post_attention_layernorm
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, emb: Tensor, attention_mask: Tensor, position_ids: Tensor,
                cache: DynamicCache | None, position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
        attn_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        a, _ = self.self_attn(hidden_states=attn_in, attention_mask=attention_mask,
                              position_ids=position_ids, cache=cache, use_cache=cache is not None,
                              position_embeddings=position_embeddings)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """EAGLE head; see the module docstring for the layout and alignment."""

    def __init__(self, cfg: EagleConfig, target_config: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.config = head_llama_config(target_config, cfg.intermediate_size)
        h, v = self.config.hidden_size, self.config.vocab_size
        self.hidden_size, self.vocab_size = h, v
        n_layers = getattr(target_config, "num_hidden_layers", None)
        if n_layers is None:
            n_layers = target_config["num_hidden_layers"]
        if cfg.fuse_layers is not None:
            bad = [i for i in cfg.fuse_layers if not 0 <= i <= n_layers]
            if bad:
                raise ValueError(f"fuse_layers {bad} are not hidden-state ids of the target "
                                 f"(valid 0..{n_layers}, 0 = embeddings)")
        if cfg.init_layer is not None and not 0 <= cfg.init_layer < n_layers:
            raise ValueError(f"init_layer {cfg.init_layer} is outside the target's {n_layers} "
                             "layers")
        k = cfg.num_fused
        normed = cfg.layout == "normed"
        self.eagle3 = cfg.layout == "eagle3"
        self.layer: nn.Module
        self.norm: nn.Module
        if self.eagle3:  # fc fuses the target layers only; the embedding enters attention
            self.fc = nn.Linear(k * h, h, bias=False)
            self.self_fc = None
            self.layer = Eagle3Layer(self.config)
            self.norm = LlamaRMSNorm(h, eps=self.config.rms_norm_eps)
        else:
            self.fc = nn.Linear(k * h + h, h, bias=normed)
            self.self_fc = nn.Linear(2 * h, h, bias=normed) if k > 1 else None
            self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
            if normed:
                self.norm = LlamaRMSNorm(h, eps=self.config.rms_norm_eps)
            else:  # EAGLE-1: the fused input enters attention unnormalised; no output norm
                self.layer.input_layernorm = nn.Identity()
                self.norm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        self._rope_tables: dict[tuple, tuple[Tensor, Tensor]] = {}  # (dtype, device) -> (cos, sin)
        # the target's embedding (and full LM head): on the meta device until attach_target
        # (random values first would only cost time: seconds for a 151,936-word vocabulary)
        self.embed_tokens = nn.Embedding(v, h, device="meta")
        self.embed_tokens.weight.requires_grad_(False)
        self.reduced = cfg.draft_vocab_size is not None
        if self.reduced:
            vd = int(cfg.draft_vocab_size)
            if vd > v:
                raise ValueError(f"draft_vocab_size {vd} exceeds the target vocabulary {v}")
            # rows of the target's LM head are copied in (build_eagle) or loaded: no init first,
            # unless it starts random
            self.lm_head = (nn.Linear(h, vd, bias=False) if cfg.lm_head == "random"
                            else skip_init(nn.Linear, h, vd, bias=False))
            self.lm_head.weight.requires_grad_(cfg.lm_head != "frozen")
            self.register_buffer("d2t", torch.arange(vd, dtype=torch.long))
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[:vd] = True
            self.register_buffer("t2d", t2d)
        else:
            self.lm_head = nn.Linear(h, v, bias=False, device="meta")
            self.lm_head.weight.requires_grad_(False)

    @property
    def target_attached(self) -> bool:
        """False while the target's embedding (and full LM head) wait for :meth:`attach_target`."""
        return not self.embed_tokens.weight.is_meta

    # ----- frozen parts ------------------------------------------------------------------
    def _frozen_prefixes(self) -> tuple[str, ...]:
        return ("embed_tokens.",) if self.reduced else ("embed_tokens.", "lm_head.")

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The state dict without the frozen target parts (embedding; full-vocab LM head)."""
        return {k: v for k, v in self.state_dict().items()
                if not k.startswith(self._frozen_prefixes())}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load what ``trainable_state_dict`` saved; frozen parts come from ``attach_target``."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(self._frozen_prefixes())]
        if missing or unexpected:
            raise ValueError(f"EAGLE state dict does not match the head: missing {missing}, "
                             f"unexpected {unexpected}")

    def attach_target(self, target_model: PreTrainedModel) -> None:
        """Point the frozen embedding (and full-vocab LM head) at the target's weights."""
        attach_target_embeddings(self, target_model, self.fc.weight, "head",
                                 lm_head=not self.reduced)

    @torch.no_grad()
    def set_vocab_map(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install the draft vocabulary map (reduced-vocabulary heads only)."""
        if not self.reduced:
            raise ValueError("set_vocab_map needs EagleConfig.draft_vocab_size to be set")
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab map shapes {tuple(d2t.shape)}, {tuple(t2d.shape)} do not "
                             f"match {tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # ----- forward -----------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        """An empty cache for step-by-step drafting with ``forward(..., past_key_values=)``."""
        return DynamicCache(config=self.config)

    def forward(self, features: Tensor, input_ids: Tensor,
                past_key_values: DynamicCache | None = None, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        """Predict the next features.

        Args:
            features: (B, T, k*H) target features, or (B, T, H) the head's own predictions.
            input_ids: (B, T) the token x_{t+1} paired with each feature f_t.
            past_key_values: a ``DynamicCache`` with earlier positions (extended in place).
            position_ids: (B, T) positions; default ``past + arange(T)``.
            attention_mask: None (causal over cache + new tokens), (B, past+T) 0/1 padding
                mask combined with causal, or a 4D (B, 1, T, past+T) mask: bool (True = attend)
                or additive float.

        Returns:
            (B, T, H) predicted features f_{t+1}.
        """
        bsz, seq = input_ids.shape
        if features.shape[:2] != (bsz, seq):
            raise ValueError(f"features {tuple(features.shape)} and input_ids {(bsz, seq)} "
                             "disagree on (B, T)")
        h = self.hidden_size
        dtype = self.embed_tokens.weight.dtype  # (not fc.weight: an int8 fc has none)
        features = features.to(dtype)
        emb = self.embed_tokens(input_ids).to(dtype)  # (B, T, H)
        width = features.shape[-1]
        if self.eagle3:
            if width not in (self.fc.in_features, h):
                raise ValueError(f"features have width {width}; expected {self.fc.in_features} "
                                 f"(fused target layers) or {h} (own predictions)")
            x = self.fc(features) if width == self.fc.in_features else features
        elif width == self.fc.in_features - h:
            x = self.fc(torch.cat([features, emb], dim=-1))
        elif self.self_fc is not None and width == h:
            x = self.self_fc(torch.cat([features, emb], dim=-1))
        else:
            raise ValueError(f"features have width {width}; expected {self.fc.in_features - h}"
                             + (f" (fused target layers) or {h} (own predictions)"
                                if self.self_fc is not None else ""))
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(seq, device=x.device) + past)[None].expand(bsz, -1)
        mask = self._mask(attention_mask, bsz, seq, past, x.device, dtype)
        cos_sin = self._rope(x, position_ids, past + seq)
        if self.eagle3:  # the pre-norm output: the next step's feature; compute_logits norms it
            return self.layer(x, emb, mask, position_ids, past_key_values, cos_sin)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids,
                         cache=past_key_values, use_cache=past_key_values is not None,
                         position_embeddings=cos_sin)
        return self.norm(out)

    def _rope(self, x: Tensor, position_ids: Tensor, bound: int) -> tuple[Tensor, Tensor]:
        """RoPE's ``(cos, sin)`` at ``position_ids`` (all below ``bound``). Decoding reads them
        from a table kept between calls (the same values: each position's angles are computed
        alone); training computes them. One table per dtype and device: under autocast the
        calls of one step come in both dtypes, and a single table rebuilt at each switch with
        doubled length grew without bound (validation of a Qwen head reached 24 GB)."""
        if torch.is_grad_enabled():
            return self.rotary_emb(x, position_ids)
        key = (x.dtype, x.device)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < bound:
            n = max(bound, 2 * (0 if table is None else table[0].shape[0]), 1024)
            cos, sin = self.rotary_emb(x, torch.arange(n, device=x.device)[None])
            table = self._rope_tables[key] = (cos[0], sin[0])  # (n, d) each
        return table[0][position_ids], table[1][position_ids]

    @staticmethod
    def _mask(attention_mask: Tensor | None, bsz: int, seq: int, past: int,
              device: torch.device, dtype: torch.dtype) -> Tensor:
        kv = past + seq
        if attention_mask is None:
            allowed = causal_allowed(seq, past, device).expand(bsz, 1, seq, kv)
        elif attention_mask.dim() == 2:
            if attention_mask.shape != (bsz, kv):
                raise ValueError(f"2D attention_mask must be (B, past+T) = {(bsz, kv)}, got "
                                 f"{tuple(attention_mask.shape)}")
            allowed = causal_allowed(seq, past, device) & attention_mask.bool()[:, None, None, :]
        elif attention_mask.dim() == 4:
            if attention_mask.shape[-2:] != (seq, kv):
                raise ValueError(f"4D attention_mask must end in (T, past+T) = {(seq, kv)}, got "
                                 f"{tuple(attention_mask.shape)}")
            if attention_mask.dtype != torch.bool:
                return attention_mask.to(dtype)
            allowed = attention_mask
        else:
            raise ValueError("attention_mask must be None, 2D (B, past+T) or 4D (B, 1, T, past+T)"
                             f", got {attention_mask.dim()}D")
        return additive_mask(allowed, dtype)

    def predicted_features(self, hidden_out: Tensor) -> Tensor:
        """The LM-head input for ``forward``'s output (the eagle3 layout's output norm applied),
        comparable with the target's final-norm hidden state."""
        return self.norm(hidden_out) if self.eagle3 else hidden_out

    def compute_logits(self, hidden_out: Tensor) -> Tensor:
        """(B, T, H) ``forward`` outputs -> (B, T, V_draft) logits (V_draft = V when not
        reduced)."""
        return self.lm_head(self.predicted_features(hidden_out))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target ids (identity without a reduced vocabulary)."""
        return self.d2t[draft_ids] if self.reduced else draft_ids


def build_eagle(cfg: EagleConfig, target_model: PreTrainedModel,
                token_counts: Tensor | None = None,
                always_include: Sequence[int] = ()) -> EagleHead:
    """Build an EAGLE head for ``target_model`` (in its dtype; fp32 for a 16-bit target).

    Args:
        cfg: head options.
        target_model: the target ``LlamaForCausalLM`` (only read).
        token_counts: (V,) target-id counts; required when ``cfg.draft_vocab_size`` is set.
        always_include: ids forced into a reduced vocabulary (default: the EOS ids).

    Returns:
        The head in train mode with the frozen parts attached.
    """
    w = target_model.get_output_embeddings().weight
    head = EagleHead(cfg, target_model.config).to(master_dtype(w.dtype))
    with torch.no_grad():
        if head.reduced:
            if token_counts is None:
                raise ValueError("draft_vocab_size is set: pass token_counts (V,) from the "
                                 "training data to choose the draft vocabulary")
            eos = target_model.config.eos_token_id
            forced = list(always_include) or ([eos] if isinstance(eos, int) else list(eos or []))
            d2t, t2d = build_vocab_map(token_counts, int(cfg.draft_vocab_size), forced)
            head.set_vocab_map(d2t.to(head.d2t.device), t2d.to(head.t2d.device))
            if cfg.lm_head != "random":
                head.lm_head.weight.copy_(w[d2t.to(w.device)])
        if cfg.layout in ("normed", "eagle3"):
            head.norm.weight.copy_(effective_norm_weight(target_model.model.norm, head.hidden_size))
        if cfg.init_layer is not None:
            src = target_model.model.layers[cfg.init_layer].state_dict()
            if isinstance(head.layer.input_layernorm, nn.Identity):
                src = {k: v for k, v in src.items() if not k.startswith("input_layernorm.")}
            own = head.layer.state_dict()
            if set(src) != set(own) or any(src[k].shape != own[k].shape for k in own):
                raise ValueError(
                    f"draft.config.init_layer={cfg.init_layer} copies a target layer, but the "
                    f"target's '{target_model.config.model_type}' layers do not have the draft "
                    "layer's Llama-style weights; set draft.config.init_layer=null")
            head.layer.load_state_dict(src)
    head.attach_target(target_model)
    return head.train()
