"""The DFlash drafter's decoding as plain tensor ops over a preallocated context cache.

:class:`~draftsmith.heads.dflash.DFlashDrafter` runs a block through its modules, and its
proposer used to keep the context's keys and values as tensors grown by ``torch.cat``: every
accepted step copied the whole cache of every layer, every block forward copied it again to
put the block's own keys after it, RoPE was rebuilt for the block's positions, and grouped-query
attention was left to SDPA (which repeats the key/value heads where it has no native GQA).
:class:`DFlashStep` computes the same function from the same weights:

* the context's keys and values live in a :class:`~eval.decoding.kv_cache.SlabCache` (one
  buffer per layer, reserved for the prompt and the tokens to come, doubled when full): the
  rows of an accepted step are written in place;
* a block's own keys and values are written just past the context (``update``), attention
  reads ``[context; block]`` as one view of the buffer, and a crop takes them off again: the
  cache's length stays that of the committed context, and nothing is concatenated;
* q, k and v come from one matmul (:class:`~eval.decoding.eagle_step.FusedLinear`), the
  context's k and v from the rows of the same concatenated weight (a view, no second copy);
  the MLP's gate and up likewise;
* RoPE's cos and sin come from a table kept between rounds (grown geometrically), except for
  RoPE types whose angles depend on the sequence's length (``dynamic``, ``longrope``), which
  are computed per call as the modules compute them;
* each key/value head's query heads are folded into one block of rows (as
  :class:`~eval.decoding.eagle_step.EagleStep` does): no repeated cache;
* the block's input is the anchor's embedding row (indexed by a Python int) over the mask
  token's row, looked up once per decode: no host-to-device copy in a round.

A decoding block sees the whole committed context and itself (bidirectionally), so no mask is
built. Outputs equal the module path's up to rounding (``tests/eval/test_dflash_step.py``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from draftsmith.eval.decoding.eagle_step import FusedLinear
from draftsmith.eval.decoding.kv_cache import SlabCache
from draftsmith.heads.dflash import KVCache

ROPE_TABLE_MIN = 1024  # positions in the first RoPE table


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half) on ``(T, heads, d)`` with ``(T, d)`` cos and sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class _LayerStep:
    """One :class:`~draftsmith.heads.dflash.DFlashLayer` as tensor ops (its norms are its own
    modules; its linears are read, not copied, but for the concatenated q/k/v and gate/up)."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.n_heads, self.n_kv, self.head_dim = attn.heads, attn.kv_heads, attn.head_dim
        self.group = self.n_heads // self.n_kv
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.kv = self.qkv.tail(1)
        self.o_proj, self.q_norm, self.k_norm = attn.o_proj, attn.q_norm, attn.k_norm
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj])
        self.down, self.act = mlp.down_proj, mlp.act_fn

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``(m, H)`` context rows -> their keys and values ``(1, KV, m, d)``."""
        m, nkv, d = ctx.shape[0], self.n_kv, self.head_dim
        k, v = self.kv(ctx)
        k = _rope(self.k_norm(k.view(m, nkv, d)), cos, sin)
        return k.transpose(0, 1).unsqueeze(0), v.view(m, nkv, d).transpose(0, 1).unsqueeze(0)

    def block(self, x: Tensor, cos: Tensor, sin: Tensor, cache: SlabCache, idx: int) -> Tensor:
        """The layer on the block's ``(T, H)`` states over layer ``idx`` of ``cache`` (the
        block's keys and values are written after the context there; the caller crops them)."""
        t, nh, nkv, d, g = x.shape[0], self.n_heads, self.n_kv, self.head_dim, self.group
        q, k, v = self.qkv(self.input_norm(x))
        qk = _rope(torch.cat([self.q_norm(q.view(t, nh, d)), self.k_norm(k.view(t, nkv, d))], 1),
                   cos, sin)  # (T, nh + nkv, d)
        keys, values = cache.update(qk[:, nh:].transpose(0, 1).unsqueeze(0),
                                    v.view(t, nkv, d).transpose(0, 1).unsqueeze(0), idx)
        # the query heads of each key/value head as one block of g * T rows: no repeated cache
        q = qk[:, :nh].view(t, nkv, g, d).permute(1, 2, 0, 3).reshape(1, nkv, g * t, d)
        o = F.scaled_dot_product_attention(q, keys, values)  # every key: context and block
        o = o.view(nkv, g, t, d).permute(2, 0, 1, 3).reshape(t, nh * d)
        x = x + self.o_proj(o)
        gate, up = self.gate_up(self.post_norm(x))
        return x + self.down(self.act(gate) * up)


class DFlashStep:
    """A DFlash drafter's context cache and block forward for one sequence (called under the
    caller's inference mode).

    Args:
        drafter: a :class:`~draftsmith.heads.dflash.DFlashDrafter`, already in its decoding
            dtype and device.
    """

    def __init__(self, drafter: nn.Module) -> None:
        self.drafter = drafter
        self.layers = [_LayerStep(layer) for layer in drafter.layers]
        self.block_size = int(drafter.block_size)
        self.dtype = drafter.hidden_norm.weight.dtype
        self.cache = SlabCache()
        self.n_ctx = 0  # context positions in the cache
        rope_type = str(getattr(drafter.rotary_emb, "rope_type", "default"))
        self._table_ok = "dynamic" not in rope_type and rope_type != "longrope"
        self._table: tuple[Tensor, Tensor] | None = None
        self._masks: Tensor | None = None  # (B-1, H) the mask token's embedding

    def reset(self, capacity: int) -> None:
        """Empty the cache (its buffers are kept) and make room for ``capacity`` positions."""
        self.cache.reset()
        self.n_ctx = 0
        self.cache.reserve(capacity + self.block_size)  # the block's keys go past the context
        row = self.drafter.embed_tokens.weight[int(self.drafter.cfg.mask_token_id)]
        self._masks = row.to(self.dtype).expand(self.block_size - 1, -1)

    @property
    def ready(self) -> bool:
        """Whether :meth:`reset` has started a request."""
        return self._masks is not None

    def append(self, feats: Tensor) -> None:
        """Project ``(m, n*H)`` fused target layers (the next ``m`` context positions) into the
        cache, in place."""
        ctx = self.drafter.context(feats)  # (m, H)
        m = ctx.shape[0]
        cos, sin = self._rope(ctx, self.n_ctx, m)
        for i, layer in enumerate(self.layers):
            self.cache.update(*layer.context_kv(ctx, cos, sin), i)
        self.n_ctx += m

    def block(self, anchor: int) -> Tensor:
        """The final-norm states ``(B, H)`` of the block ``[anchor, MASK x (B-1)]`` at positions
        ``n_ctx .. n_ctx + B - 1`` over the cache, which is left as it was."""
        if not self.ready:
            raise RuntimeError("DFlashStep.block before reset")
        emb = self.drafter.embed_tokens.weight
        x = torch.cat([emb[anchor:anchor + 1].to(self.dtype), self._masks])  # (B, H)
        cos, sin = self._rope(x, self.n_ctx, self.block_size)
        for i, layer in enumerate(self.layers):
            x = layer.block(x, cos, sin, self.cache, i)
        self.cache.crop(-self.block_size)
        return self.drafter.norm(x)

    def context_kv(self) -> KVCache:
        """Every layer's context keys and values, views ``(1, KV, n_ctx, d)`` of the buffers (the
        ``ctx_kv`` of ``DFlashDrafter.block_hidden``)."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def _rope(self, x: Tensor, start: int, n: int) -> tuple[Tensor, Tensor]:
        """RoPE's ``(n, d)`` cos and sin at positions ``start .. start + n - 1``."""
        rotary = self.drafter.rotary_emb
        if not self._table_ok:
            cos, sin = rotary(x, torch.arange(start, start + n, device=x.device)[None])
            return cos[0], sin[0]
        table, end = self._table, start + n
        if (table is None or table[0].shape[0] < end or table[0].dtype != x.dtype
                or table[0].device != x.device):
            size = max(end, 2 * (0 if table is None else table[0].shape[0]), ROPE_TABLE_MIN)
            cos, sin = rotary(x, torch.arange(size, device=x.device)[None])
            table = self._table = (cos[0], sin[0])  # (size, d) each
        return table[0][start:end], table[1][start:end]
