"""The EAGLE head's decoding forward as plain tensor ops.

:class:`~draftsmith.heads.eagle.EagleHead` runs its layer as transformers modules: each call
dispatches a dozen modules, builds an additive mask, transposes q, k and v apart and repeats the
cache's keys and values for grouped-query attention. During decoding that fixed cost is paid
once per tree depth and drafted token, and on a 2-core CPU it was about as large as the head's
weight reads (bench/rounds). :class:`EagleStep` computes the same function from the same
weights with fewer, larger ops:

* q, k and v come from one matmul (their weights concatenated once), as do the MLP's gate and
  up projections; int8 weights (:class:`~draftsmith.heads.quantize.Int8Linear`) are
  concatenated the same way (per-output-channel scales concatenate); other quantized
  layers are called one by one;
* RoPE rotates q and k together, from the head's own kept table (``EagleHead._rope``);
* attention reads the cache's keys and values without repeating them: each key/value head's
  query heads are folded into one block of rows (the mask repeated to match), and a bool mask
  goes straight to ``scaled_dot_product_attention``;
* the cache is the caller's, extended by ``update(k, v, 0)``: the proposer's own
  (:class:`~eval.decoding.kv_cache.SlabCache`), so crops and lengths work as before, or a
  batch's slot cache (:class:`~eval.decoding.slots.SlotCache`, a ``DynamicCache`` whose rows
  are the batch's rows: ``BatchEagle`` passes its per-row positions and masks).

Outputs equal the module path's up to rounding (``tests/eval/test_eagle_step.py``); the draft
distribution is only ever a proposal, so decoding stays lossless either way.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from draftsmith.eval.decoding.kernels import PackedLinear, pack, packed_linear
from draftsmith.heads.blocks import causal_allowed
from draftsmith.heads.eagle import Eagle3Layer, EagleHead
from draftsmith.heads.quantize import Int8Linear


class FusedLinear:
    """Several linears over the same input as one matmul; ``__call__`` returns their outputs in
    order. Plain ``nn.Linear`` weights and :class:`Int8Linear` weights are concatenated once (a
    second copy of those weights, beside the modules' own); any other module (int4, dynamic
    int8) is called on its own. Where the linears are oneDNN-prepacked
    (:class:`~eval.decoding.kernels.PackedLinear`, ``apply_kernels``) the concatenated weight
    is packed too."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        self.linears = list(linears)
        self.sizes = [int(m.out_features) for m in self.linears]
        self.kind, self.bias, self.packed = "separate", None, None
        if all(type(m) in (nn.Linear, PackedLinear) for m in self.linears):
            self.kind = "dense"
            self.weight = torch.cat([m.weight.detach() for m in self.linears])
            if any(type(m) is PackedLinear for m in self.linears):
                self.packed = pack(self.weight)
        elif all(type(m) is Int8Linear for m in self.linears):
            self.kind = "int8"
            self.weight = torch.cat([m.weight_int8 for m in self.linears]).contiguous()
            self.scales = torch.cat([m.scales for m in self.linears])
        else:
            return
        if any(m.bias is not None for m in self.linears):  # a missing bias is a zero one
            like = self.weight if self.kind == "dense" else self.scales
            self.bias = torch.cat([like.new_zeros(n) if m.bias is None else m.bias.detach()
                                   for m, n in zip(self.linears, self.sizes)])

    def __call__(self, x: Tensor) -> list[Tensor]:
        if self.kind == "separate":
            return [m(x) for m in self.linears]
        if self.kind == "dense":
            y = (F.linear(x, self.weight, self.bias) if self.packed is None
                 else packed_linear(x, self.packed, self.bias))
        else:
            y = torch._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return list(y.split(self.sizes, dim=-1))

    def tail(self, start: int) -> FusedLinear:
        """The linears ``start:`` as one more :class:`FusedLinear` over the rows of this one's
        concatenated weight (views: no further copy)."""
        part = copy.copy(self)
        part.linears, part.sizes = self.linears[start:], self.sizes[start:]
        skip = sum(self.sizes[:start])
        if self.kind != "separate":
            part.weight = self.weight[skip:]
            if self.packed is not None:  # a packed weight has no row views: pack the rows
                part.packed = pack(part.weight)
            if self.kind == "int8":
                part.scales = self.scales[skip:]
            if self.bias is not None:
                part.bias = self.bias[skip:]
        return part


class EagleStep:
    """``EagleHead.forward`` during decoding (called under the caller's inference mode): one
    sequence (the proposer's), or the rows of a batch (``BatchEagle``) with their own positions
    and attention masks. The norms are the head's own modules.

    Args:
        head: an :class:`~draftsmith.heads.eagle.EagleHead` (any layout), already in its
            decoding dtype and device; its weights are read, not copied, except the
            concatenated q/k/v and gate/up weights.
    """

    @classmethod
    def of(cls, head: nn.Module) -> EagleStep | None:
        """The fused step of ``head``, or None where it is not an ``EagleHead`` with the layer
        and norms it builds (then the modules run): RMS norms everywhere, except the EAGLE-1
        layout's absent input and output norms."""
        if not isinstance(head, EagleHead) or type(head.layer) not in (Eagle3Layer,
                                                                        LlamaDecoderLayer):
            return None
        layer = head.layer
        norms = [layer.post_attention_layernorm]
        if head.eagle3:
            norms += [layer.hidden_norm, layer.input_layernorm]
        optional = [] if head.eagle3 else [layer.input_layernorm, head.norm]
        if not (all(type(n) is LlamaRMSNorm for n in norms)
                and all(type(n) in (LlamaRMSNorm, nn.Identity) for n in optional)):
            return None
        return cls(head)

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        layer, cfg = head.layer, head.config
        attn, mlp = layer.self_attn, layer.mlp
        self.eagle3 = bool(head.eagle3)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.group = self.n_heads // self.n_kv
        self.scaling = float(attn.scaling)
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj])
        self.down, self.act = mlp.down_proj, mlp.act_fn
        self.input_norm = (None if isinstance(layer.input_layernorm, nn.Identity)
                           else layer.input_layernorm)
        self.post_norm = layer.post_attention_layernorm
        self.hidden_norm = getattr(layer, "hidden_norm", None)
        self.out_norm = None if isinstance(head.norm, nn.Identity) else head.norm

    def __call__(self, features: Tensor, input_ids: Tensor, cache: object, position_ids: Tensor,
                 allowed: Tensor | None = None) -> Tensor:
        """The head's output ``(B, T, H)`` after ``T`` new pairs per row (as ``EagleHead.forward``).

        Args:
            features: ``(B, T, kH)`` target features or ``(B, T, H)`` the head's own outputs.
            input_ids: ``(B, T)`` the tokens paired with them.
            cache: the head's cache (``update(k, v, 0)`` with ``(B, KV, T, d)`` keys and values,
                returning all of them; ``get_seq_length()``), extended here.
            position_ids: ``(B, T)`` positions.
            allowed: bool attention mask (True = attend): ``(T, past + T)`` for every row, or
                ``(B, T, past + T)`` per row (a batch's padding and slots); None: causal.
        """
        head = self.head
        dtype = head.embed_tokens.weight.dtype
        b, t = input_ids.shape
        # rows and positions flattened to (B * T, .) for every op but attention
        emb = head.embed_tokens(input_ids.reshape(-1)).to(dtype)  # (BT, H)
        feats = features.reshape(b * t, -1).to(dtype)
        x = self._fuse(feats, emb)
        past = cache.get_seq_length()
        if allowed is None and t > 1:
            allowed = causal_allowed(t, past, x.device)[0, 0]
        cos, sin = head._rope(x, position_ids, past + t)  # (B, T, d) each
        if self.eagle3:
            attn_in = torch.cat([head.layer.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        else:
            attn_in = x if self.input_norm is None else self.input_norm(x)
        x = x + self._attention(attn_in, b, cache, cos.reshape(b * t, -1),
                                sin.reshape(b * t, -1), allowed)
        gate, up = self.gate_up(self.post_norm(x))
        x = x + self.down(self.act(gate) * up)
        if not self.eagle3 and self.out_norm is not None:
            x = self.out_norm(x)
        return x.view(b, t, -1)

    def _fuse(self, feats: Tensor, emb: Tensor) -> Tensor:
        """The layer's input stream from the features (and, outside EAGLE-3, the embedding)."""
        head, width = self.head, feats.shape[-1]
        if self.eagle3:
            return head.fc(feats) if width == head.fc.in_features else feats
        if width == head.fc.in_features - head.hidden_size:
            return head.fc(torch.cat([feats, emb], dim=-1))
        return head.self_fc(torch.cat([feats, emb], dim=-1))

    def _attention(self, h: Tensor, b: int, cache: object, cos: Tensor, sin: Tensor,
                   allowed: Tensor | None) -> Tensor:
        """Attention of ``h (B * T, .)``, ``b`` rows of ``T``, over the cache and itself."""
        n, nh, nkv, d, g = h.shape[0], self.n_heads, self.n_kv, self.head_dim, self.group
        t = n // b
        q, k, v = self.qkv(h)
        qk = torch.cat([q, k], dim=-1).view(n, nh + nkv, d)
        half = d // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos[:, None] + rotated * sin[:, None]
        keys, values = cache.update(qk[:, nh:].view(b, t, nkv, d).transpose(1, 2),
                                    v.view(b, t, nkv, d).transpose(1, 2), 0)
        # the query heads of each key/value head as one block of g * T rows: no repeated cache
        q = qk[:, :nh].view(b, t, nkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, nkv, g * t, d)
        if allowed is None:
            mask = None
        elif allowed.dim() == 2:  # (T, kv): every row and head alike
            mask = allowed.repeat(g, 1)
        else:  # (B, T, kv): per row, alike over heads
            mask = allowed.repeat(1, g, 1).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
        o = o.view(b, nkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(n, nh * d)
        return self.o_proj(o)
