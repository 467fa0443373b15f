"""Training a DFlash drafter: anchor sampling and the distillation pairs of every block slot
(the drafter itself and the blocks' attention mask: ``heads/dflash.py``).

Alignment, for an anchor at position a of a sequence of T tokens (``heads/blocks.py``
conventions: ``hidden[:, t]`` is the target's state after reading tokens <= t, its LM-head
distribution the law of token t+1):

* the block is ``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1``;
* it sees the context (fused target layers) at positions ``< a`` of its own row (not padding),
  and its own block, bidirectionally; never another block, never the context at or after a;
* slot k (1..B-1) predicts token ``x_{a+k}``: teacher ``p_{a+k-1}`` (row ``b*T + a+k-1`` of
  ``hidden.flatten(0, 1)``), label ``x_{a+k}``, counted iff ``a+k < T``, it is not padding and
  ``loss_mask[a+k]`` is set.

This is what decoding computes: after the target has read tokens ``< P`` the pending token x_P
is the anchor and the cached context holds the features of positions ``< P``.

Anchors are positions a >= 1 (a block always has context, as at decode time) whose next token
a+1 is counted; up to ``max_anchors`` per row are drawn without replacement. In training the
draw uses torch's global RNG (seeded by the recipe, saved in checkpoints); in eval mode
(validation) a generator seeded from the batch's tokens, so every validation of a run scores the
same blocks and alpha-hat moves only with the weights.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from draftsmith.heads.blocks import DistillTarget, pack_rows
from draftsmith.heads.dflash import DFlashDrafter
from draftsmith.heads.eagle_ttt import fuse_features


def _data_generator(input_ids: Tensor) -> torch.Generator:
    """A CPU generator seeded from the tokens (the same batch draws the same anchors)."""
    digest = hashlib.sha256(input_ids.detach().to("cpu", torch.int64).numpy().tobytes())
    return torch.Generator().manual_seed(int(digest.hexdigest()[:15], 16))


def sample_anchors(input_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor | None,
                   max_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[Tensor, Tensor]:
    """Up to ``max_anchors`` anchors per row, without replacement, among positions a >= 1
    whose next token is counted (``loss_mask`` and not padding).

    Args:
        input_ids: (B, T) tokens (shape and device only).
        loss_mask: (B, T) bool, tokens to learn to predict.
        attention_mask: (B, T) 0/1 padding mask or None.
        max_anchors: the most anchors per row.
        generator: a CPU generator (uniform scores drawn there, then moved); None = torch's
            global RNG on the tokens' device.

    Returns:
        ``(anchors, valid)``, both (B, N) with N = min(max_anchors, most candidates of a row)
        (at least 1): ascending anchor positions, distinct within a row, and False where a row
        has fewer candidates (filler anchors, never counted).
    """
    bsz, seq = input_ids.shape
    keep = loss_mask.bool()
    if attention_mask is not None:
        keep = keep & attention_mask.bool()
    cand = torch.zeros_like(keep)
    cand[:, 1:seq - 1] = keep[:, 2:]  # a in 1..T-2 with token a+1 counted
    n = max(1, min(int(max_anchors), int(cand.sum(1).max()) if seq else 0))
    if generator is None:
        scores = torch.rand(bsz, seq, device=input_ids.device)
    else:
        scores = torch.rand(bsz, seq, generator=generator).to(input_ids.device)
    scores = torch.where(cand, scores, torch.full_like(scores, -1.0))
    top, anchors = scores.topk(n, dim=1)
    order = anchors.argsort(dim=1)
    return anchors.gather(1, order), top.gather(1, order) >= 0


def distill_targets(draft: DFlashDrafter, input_ids: Tensor, hidden: Tensor, loss_mask: Tensor,
                    attention_mask: Tensor | None = None, layers: Tensor | None = None,
                    layer_ids: Sequence[int] | None = None,
                    num_steps: int | None = None) -> list[DistillTarget]:
    """Training pairs of every block slot k = 1..n, packed (see the module docstring).

    Args:
        draft: the DFlash drafter.
        input_ids: (B, T) token ids.
        hidden: (B, T, H) target final hidden states (teachers).
        loss_mask: (B, T) bool, tokens to learn to predict.
        attention_mask: (B, T) 0/1 padding mask or None.
        layers: (B, L, T, H) cached target layers holding ``draft.cfg.fuse_layers``.
        layer_ids: hidden-state id of each cached layer; None = exactly ``fuse_layers``.
        num_steps: slots returned (default and at most B-1).

    Returns:
        list over slots of ``DistillTarget(logits (1, N_k, V), teacher_hidden (1, N_k, H),
        mask (1, N_k) all True, labels (1, N_k), None, teacher_index (1, N_k))``, entries in
        (row, anchor) order.
    """
    fuse = list(draft.cfg.fuse_layers)
    if layers is None:
        raise ValueError(f"a DFlash drafter reads target layers {fuse}: pass layers (B, L, T, H) "
                         "from a feature cache built with draft.config.fuse_layers")
    ids = list(layer_ids) if layer_ids is not None else fuse
    if layers.shape[1] != len(ids):
        raise ValueError(f"layers holds {layers.shape[1]} layers but {len(ids)} layer ids "
                         f"({ids}) describe it; pass layer_ids from the cache manifest")
    features = fuse_features(layers, ids, fuse)
    bsz, seq = input_ids.shape
    generator = None if draft.training else _data_generator(input_ids)
    anchors, valid = sample_anchors(input_ids, loss_mask, attention_mask, draft.cfg.max_anchors,
                                    generator)
    out = draft(features, input_ids, anchors, valid, attention_mask)  # (B, N, B_s, H)
    keep = loss_mask.bool()
    if attention_mask is not None:
        keep = keep & attention_mask.bool()
    base = torch.arange(bsz, device=input_ids.device)[:, None] * seq
    flat_hidden = hidden.flatten(0, 1)
    n = draft.block_size - 1 if num_steps is None else min(int(num_steps), draft.block_size - 1)
    result = []
    for k in range(1, n + 1):
        pos = anchors + k  # (B, N): the token slot k predicts
        at = pos.clamp(max=seq - 1)
        counted = valid & (pos < seq) & keep.gather(1, at)
        rows = base + at - 1  # the teacher p_{a+k-1}
        labels = input_ids.gather(1, at)
        o, teacher, labels, rows, mask = pack_rows(counted, out[:, :, k], flat_hidden[rows],
                                                   labels, rows)
        result.append(DistillTarget(draft.compute_logits(o), teacher, mask, labels,
                                    draft_hidden=None, teacher_index=rows))
    return result
