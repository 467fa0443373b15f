"""Draft family 4: a DFlash block drafter (block diffusion drafting, arXiv 2602.06036).

One forward drafts a whole block. The block is ``[anchor, MASK x (B-1)]`` at absolute positions
``a .. a+B-1``, where the anchor is the last committed token (the pending one at decode time) and
MASK is ``mask_token_id``; slot k (1..B-1) predicts the token at position a+k (no EAGLE-style
shift), so one forward gives a chain of B-1 draft tokens. Attention inside the block is
bidirectional; the block also sees the *context*: the fused target hidden states of every
position strictly before the anchor (the context feature at position t is the target's state
after reading token t).

Layout (parameter names are vLLM's / speculators' ``dflash`` names, so an export is a copy):

* ``fc: Linear(n*H -> H, bias=False)`` and the RMSNorm ``hidden_norm`` turn the n fused target
  layers into the context ``ctx = hidden_norm(fc(cat(layers)))``;
* ``layers[i]``: Qwen3-style decoder layers of the target's width (per-head ``q_norm`` /
  ``k_norm``, SiLU MLP, no biases) whose attention reads ``ctx`` as extra keys and values:
  ``K = k_norm(Wk [ctx; x])``, ``V = Wv [ctx; x]``, ``Q = q_norm(Wq x)`` with ``x`` the block's
  normed hidden states; RoPE at absolute positions on both; ``ctx`` never runs through a layer;
* the output RMSNorm ``norm``, then the target's LM head.

The embedding (which embeds the anchor and the mask token) and the LM head are the target's,
frozen and attached on load (never stored in a package, like EAGLE's). Widths, heads, head dim,
RoPE and norm eps come from ``heads.draft_config.draft_layer_config``; the activation is SiLU
whatever the target's (what the engines' DFlash layers compute). The embedding is looked up
unscaled, as the engines do (a Gemma target scales its own embeddings inside its forward).

Training (``heads/dflash_train.py``): anchors sampled among assistant positions, all blocks of a
batch in one forward under one boolean mask (:func:`block_attention_mask`, here), one
``DistillTarget`` per slot.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)

from draftsmith.heads.blocks import HeadConfig, attach_target_embeddings, master_dtype
from draftsmith.heads.draft_config import draft_layer_config, text_config
from draftsmith.heads.eagle import effective_norm_weight

# per draft layer, the context's keys (B, KV, T, D) after k_norm and RoPE, and its values
KVCache = list[tuple[Tensor, Tensor]]


@dataclass
class DFlashConfig(HeadConfig):
    """DFlash drafter options.

    Attributes:
        block_size: B, the block's length: the anchor and B-1 mask slots (B-1 drafts a forward).
        num_layers: draft decoder layers (1 trains fastest; the paper uses up to 5).
        fuse_layers: hidden-state ids of the target (0 = embeddings .. num_layers, as
            ``out.hidden_states``) fused into the context, or ``"auto"``: EAGLE-3's low / middle /
            high layers, resolved by the family from the target's depth.
        mask_token_id: the id whose (frozen, target) embedding fills the mask slots; ``"auto"``
            (or null) = the target's pad id, else its EOS id (resolved by the family and recorded
            resolved). An id whose embedding row is all zeros (an untrained padding row) is
            refused: every slot would read the same zero vector.
        max_anchors: blocks trained per sequence (anchors sampled without replacement).
        loss_decay_gamma: slot k's default loss weight is ``exp(-(k-1)/gamma)``; null =
            ``1 + 3B/8`` (the published 4 for B = 8 and 7 for B = 16).
        draft_vocab_size: must be null (the target's LM head, frozen): a reduced draft
            vocabulary is not implemented for this family yet.
    """

    block_size: int = 8
    num_layers: int = 1
    fuse_layers: list[int] | str = "auto"
    mask_token_id: int | str | None = "auto"
    max_anchors: int = 64
    loss_decay_gamma: float | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        for key, low in (("block_size", 2), ("num_layers", 1), ("max_anchors", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"draft.config.{key}={value!r} must be an integer >= {low}")
        if self.draft_vocab_size is not None:
            raise ValueError(f"draft.config.draft_vocab_size={self.draft_vocab_size!r}: a reduced "
                             "draft vocabulary is not implemented for dflash drafts; set "
                             "draft.config.draft_vocab_size=null (the target's frozen LM head)")
        if self.fuse_layers != "auto":
            if isinstance(self.fuse_layers, str) or not self.fuse_layers:
                raise ValueError(f"draft.config.fuse_layers={self.fuse_layers!r} must be 'auto' or "
                                 "a non-empty list of target hidden-state ids, e.g. [2, 15, 27]")
            self.fuse_layers = [int(i) for i in self.fuse_layers]
        mask = self.mask_token_id
        if mask not in (None, "auto") and (isinstance(mask, (bool, str)) or int(mask) < 0):
            raise ValueError(f"draft.config.mask_token_id={mask!r} must be auto (or null) or a "
                             "token id >= 0")
        gamma = self.loss_decay_gamma
        if gamma is not None and not (math.isfinite(float(gamma)) and float(gamma) > 0):
            raise ValueError(f"draft.config.loss_decay_gamma={gamma!r} must be null or a positive "
                             "number")

    @property
    def gamma(self) -> float:
        """The loss decay ``gamma`` (``loss_decay_gamma``, or ``1 + 3B/8``)."""
        if self.loss_decay_gamma is not None:
            return float(self.loss_decay_gamma)
        return 1.0 + 3.0 * self.block_size / 8.0

    def position_weights(self, n: int) -> list[float]:
        """Default loss weight of slots 1..n: ``exp(-(k-1)/gamma)``."""
        return [math.exp(-(k - 1) / self.gamma) for k in range(1, n + 1)]


def default_mask_token_id(target_config: Any) -> int:
    """The mask id for ``mask_token_id: auto``: the target's pad id, else its (first) EOS id.

    A small target such as SmolLM2 has no spare embedding row, and the mask token is embedded by
    the target's frozen table, so an id of a token that never starts a block is used.
    """
    tc = text_config(target_config)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tc, name, None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return int(value)
    raise ValueError("draft.config.mask_token_id=auto takes the target's pad id, else its EOS id, "
                     "but the target's config names neither: set draft.config.mask_token_id to "
                     "an id of the target's vocabulary")


def dflash_layer_config(target_config: Any, num_layers: int) -> LlamaConfig:
    """The draft layers' config: ``draft_layer_config`` (the target's widths, heads, head dim,
    RoPE, norm eps; every field explicit) with ``num_layers`` layers and a SiLU MLP."""
    cfg = draft_layer_config(target_config, num_layers=num_layers)
    cfg.hidden_act = "silu"
    return cfg


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half, as transformers and vLLM's neox style) on (B, heads, T, D)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Attention of a block over ``[context; block]``: context keys/values come from ``ctx``
    through this layer's own ``k_proj`` / ``k_norm`` / ``v_proj`` (:meth:`context_kv`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, self.heads = config.hidden_size, config.num_attention_heads
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def context_kv(self, ctx: Tensor, cos_sin: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """(B, T, H) context -> keys and values (B, KV, T, D) at the context's positions."""
        return self._kv(ctx, *cos_sin)

    def forward(self, x: Tensor, cos_sin: tuple[Tensor, Tensor], ctx_kv: tuple[Tensor, Tensor],
                allowed: Tensor | None) -> Tensor:
        """(B, Q, H) normed block states -> (B, Q, H); ``allowed`` (B, 1, Q, T+Q) bool (True =
        attend) over ``[context; block]``, None = everything."""
        b, q_len, _ = x.shape
        cos, sin = cos_sin
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k, v = self._kv(x, cos, sin)
        keys = torch.cat([ctx_kv[0].to(k.dtype), k], dim=2)
        values = torch.cat([ctx_kv[1].to(v.dtype), v], dim=2)
        # a boolean mask goes to SDPA as a boolean mask: True = attend (never added as numbers)
        out = F.scaled_dot_product_attention(_rope(q, cos, sin), keys, values, attn_mask=allowed,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer whose attention also reads the context (Qwen3 style)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos_sin: tuple[Tensor, Tensor], ctx_kv: tuple[Tensor, Tensor],
                allowed: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx_kv, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_attention_mask(anchors: Tensor, valid: Tensor, seq: int, block_size: int,
                         attention_mask: Tensor | None = None) -> Tensor:
    """Which keys each block slot attends to, over ``[context (T); blocks (N*B_s)]``.

    Compares positions, never block numbers: a query of the block at anchor a sees a context
    key at position t iff ``t < a`` (and t is not padding, and the block is a real one), and a
    block key iff that key's block has the same anchor position (anchors are distinct within a
    row, so that is its own block, every slot of it: bidirectional).

    Args:
        anchors: (B, N) anchor positions, distinct within a row.
        valid: (B, N) bool; a filler block (False) sees only itself.
        seq: T, the context length.
        block_size: B_s.
        attention_mask: (B, T) 0/1 padding mask or None.

    Returns:
        (B, 1, N*B_s, T + N*B_s) bool, True = attend.
    """
    t = torch.arange(seq, device=anchors.device)
    ctx = (t[None, None, :] < anchors[..., None]) & valid[..., None]  # (B, N, T)
    if attention_mask is not None:
        ctx = ctx & attention_mask.bool()[:, None, :]
    own = anchors[:, :, None] == anchors[:, None, :]  # (B, N, N): same anchor position
    ctx = ctx.repeat_interleave(block_size, dim=1)
    own = own.repeat_interleave(block_size, dim=1).repeat_interleave(block_size, dim=2)
    return torch.cat([ctx, own], dim=-1)[:, None]


class DFlashDrafter(nn.Module):
    """The DFlash drafter; see the module docstring for the layout and the alignment."""

    def __init__(self, cfg: DFlashConfig, target_config: Any) -> None:
        super().__init__()
        if cfg.fuse_layers == "auto" or cfg.mask_token_id in (None, "auto"):
            raise ValueError("a DFlash drafter needs resolved fuse_layers and mask_token_id: build "
                             "its config with heads.family.get_family('dflash').head_config(raw, "
                             f"target_config) (got fuse_layers={cfg.fuse_layers!r}, "
                             f"mask_token_id={cfg.mask_token_id!r})")
        self.cfg = cfg
        self.config = dflash_layer_config(target_config, cfg.num_layers)
        h, v = self.config.hidden_size, self.config.vocab_size
        self.hidden_size, self.vocab_size = h, v
        n_layers = int(text_config(target_config).num_hidden_layers)
        bad = [i for i in cfg.fuse_layers if not 0 <= i <= n_layers]
        if bad:
            raise ValueError(f"draft.config.fuse_layers {bad} are not hidden-state ids of the "
                             f"target (valid 0..{n_layers}, 0 = embeddings)")
        if not 0 <= cfg.mask_token_id < v:
            raise ValueError(f"draft.config.mask_token_id={cfg.mask_token_id} is outside the "
                             f"target's vocabulary (0..{v - 1})")
        self.fc = nn.Linear(len(cfg.fuse_layers) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=self.config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(self.config) for _ in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(h, eps=self.config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)  # the target's RoPE scaling too
        # the target's embedding and LM head: on the meta device until attach_target
        self.embed_tokens = nn.Embedding(v, h, device="meta")
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head = nn.Linear(h, v, bias=False, device="meta")
        self.lm_head.weight.requires_grad_(False)

    @property
    def target_attached(self) -> bool:
        """False while the target's embedding and LM head wait for :meth:`attach_target`."""
        return not self.embed_tokens.weight.is_meta

    @property
    def block_size(self) -> int:
        return int(self.cfg.block_size)

    def attach_target(self, target_model: PreTrainedModel) -> None:
        """Point the frozen embedding and LM head at the target's weights."""
        attach_target_embeddings(self, target_model, self.hidden_norm.weight, "drafter")

    # ----- the pieces training and decoding share ------------------------------------------
    def context(self, features: Tensor) -> Tensor:
        """(B, T, n*H) fused target layers -> (B, T, H) ``hidden_norm(fc(features))``."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(f"features have width {features.shape[-1]}; the drafter fuses "
                             f"{len(self.cfg.fuse_layers)} target layers of width "
                             f"{self.hidden_size} ({self.fc.in_features})")
        return self.hidden_norm(self.fc(features.to(self.hidden_norm.weight.dtype)))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> KVCache:
        """Every layer's context keys (k_norm, RoPE at ``positions`` (B, T)) and values."""
        cos_sin = self.rotary_emb(ctx, positions)
        return [layer.self_attn.context_kv(ctx, cos_sin) for layer in self.layers]

    def block_ids(self, anchor_ids: Tensor) -> Tensor:
        """(B, N) anchor tokens -> (B, N*B_s) block tokens ``[anchor, MASK x (B_s - 1)]``."""
        ids = anchor_ids.new_full((*anchor_ids.shape, self.block_size), self.cfg.mask_token_id)
        ids[..., 0] = anchor_ids
        return ids.flatten(1)

    def block_hidden(self, ids: Tensor, positions: Tensor, ctx_kv: KVCache,
                     allowed: Tensor | None = None) -> Tensor:
        """Run the layers on block tokens.

        Args:
            ids: (B, Q) block tokens (anchors and mask ids).
            positions: (B, Q) their absolute positions.
            ctx_kv: :meth:`context_kv` of the context (T positions).
            allowed: (B, 1, Q, T+Q) bool (True = attend), None = every key.

        Returns:
            (B, Q, H) final-norm hidden states (the LM head's input).
        """
        x = self.embed_tokens(ids).to(self.hidden_norm.weight.dtype)
        cos_sin = self.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, cos_sin, kv, allowed)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(..., H) final-norm hidden states -> (..., V) logits over the target's vocabulary."""
        return self.lm_head(hidden)

    def forward(self, features: Tensor, input_ids: Tensor, anchors: Tensor,
                valid: Tensor | None = None, attention_mask: Tensor | None = None) -> Tensor:
        """All blocks of a batch in one forward (training and tests).

        Args:
            features: (B, T, n*H) fused target layers of every position.
            input_ids: (B, T) tokens.
            anchors: (B, N) anchor positions, distinct within a row.
            valid: (B, N) bool, False for filler anchors (their blocks see no context); None =
                all valid.
            attention_mask: (B, T) 0/1 padding mask or None.

        Returns:
            (B, N, B_s, H) final-norm hidden states of every block slot.
        """
        bsz, seq = input_ids.shape
        n, bs = anchors.shape[1], self.block_size
        valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else valid.bool()
        ctx = self.context(features)
        ctx_pos = torch.arange(seq, device=input_ids.device)[None].expand(bsz, -1)
        ctx_kv = self.context_kv(ctx, ctx_pos)
        ids = self.block_ids(input_ids.gather(1, anchors))
        positions = (anchors[..., None] + torch.arange(bs, device=anchors.device)).flatten(1)
        allowed = block_attention_mask(anchors, valid, seq, bs, attention_mask)
        return self.block_hidden(ids, positions, ctx_kv, allowed).view(bsz, n, bs, -1)


def zero_embedding_rows(embedding: Tensor, ids: Sequence[int]) -> list[int]:
    """The ids among ``ids`` whose embedding row is all zeros."""
    return [i for i in ids if not bool(embedding[i].detach().any())]


def build_dflash(cfg: DFlashConfig, target_model: PreTrainedModel) -> DFlashDrafter:
    """A fresh DFlash drafter for ``target_model`` (fp32 for a 16-bit target), frozen parts
    attached, ``hidden_norm`` and ``norm`` initialised to the scale of the target's final norm.

    Raises:
        ValueError: the mask token's embedding row is all zeros (a padding row).
    """
    emb = target_model.get_input_embeddings().weight
    if isinstance(cfg.mask_token_id, int) and zero_embedding_rows(emb, [cfg.mask_token_id]):
        tc, hint = text_config(target_model.config), ""
        for name in ("eos_token_id", "bos_token_id"):
            other = getattr(tc, name, None)
            other = other[0] if isinstance(other, (list, tuple)) and other else other
            if (isinstance(other, int) and 0 <= other < emb.shape[0]
                    and not zero_embedding_rows(emb, [other])):
                hint = f" (e.g. {other}, the target's {name.split('_')[0].upper()} id)"
                break
        raise ValueError(
            f"draft.config.mask_token_id={cfg.mask_token_id} has an all-zero embedding row in the "
            "target (an untrained padding row): every mask slot would enter the drafter as the "
            "same zero vector and could not tell its position apart; set "
            f"draft.config.mask_token_id to an id with a trained embedding{hint}")
    w = target_model.get_output_embeddings().weight
    drafter = DFlashDrafter(cfg, target_model.config).to(master_dtype(w.dtype))
    norm = getattr(getattr(target_model, "model", None), "norm", None)
    if norm is not None:
        with torch.no_grad():
            scale = effective_norm_weight(norm, drafter.hidden_size).to(drafter.norm.weight)
            drafter.norm.weight.copy_(scale)
            drafter.hidden_norm.weight.copy_(scale)
    drafter.attach_target(target_model)
    return drafter.train()
