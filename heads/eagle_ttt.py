"""Training an EAGLE head: fused target features, training-time-test unrolling and the
distillation pairs of every unrolled step (the head itself: ``heads/eagle.py``)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from draftsmith.heads.blocks import (
    DistillTarget,
    causal_allowed,
    pack_rows,
    shift_left,
    shifted_labels,
    teacher_mask,
    teacher_rows,
)
from draftsmith.heads.eagle import EagleHead


def fuse_features(layers: Tensor, layer_ids: Sequence[int], fuse_layers: Sequence[int]) -> Tensor:
    """Concatenate the chosen target layers into the head's input features.

    Args:
        layers: (B, L, T, H) cached hidden states; ``layers[:, j]`` is hidden-state id
            ``layer_ids[j]``.
        layer_ids: the hidden-state id of each of the L cached layers.
        fuse_layers: the ids to fuse, in order.

    Returns:
        (B, T, k*H) with the k = len(fuse_layers) layers side by side.
    """
    ids = list(layer_ids)
    missing = [i for i in fuse_layers if i not in ids]
    if missing:
        raise ValueError(f"fuse_layers {missing} are not in the feature cache (cached layer ids "
                         f"{ids}); rebuild the cache with these layers")
    picked = [layers[:, ids.index(i)] for i in fuse_layers]  # k x (B, T, H)
    return torch.cat(picked, dim=-1)


def _ttt_allowed(seq: int, step: int, pad: Tensor | None, bsz: int,
                 device: torch.device) -> Tensor:
    """(B, 1, T, step*T) bool mask for unrolling step ``step`` (1-based); see the unrolled
    forward."""
    causal = causal_allowed(seq, 0, device)[0, 0]  # (T, T)
    blocks = [causal] + [torch.eye(seq, dtype=torch.bool, device=device)] * (step - 1)
    allowed = torch.cat(blocks, dim=-1)[None, None].expand(bsz, 1, seq, step * seq).clone()
    if pad is not None:  # step-1 keys at padding positions are never attended
        allowed[..., :seq] &= pad.bool()[:, None, None, :]
        allowed[..., torch.arange(seq), torch.arange(seq)] = True  # keep every row non-empty
    return allowed


def eagle_unrolled_forward(head: EagleHead, features: Tensor, input_ids: Tensor, steps: int,
                           attention_mask: Tensor | None = None,
                           detach_between_steps: bool = False) -> list[Tensor]:
    """Training-time-test unrolling: run the head ``steps`` times on its own predictions.

    Alignment, for step s = 1..steps and sequence index t (all steps keep length T):

    * input token: ``x_{t+s}`` (``input_ids`` shifted left by s, 0 past the end);
    * input feature: step 1 the target's ``f_t`` (plus training noise); step s > 1 the head's
      own step-(s-1) output at the same index t (its prediction of ``f_{t+s-1}``);
    * position id: ``t + s - 1``;
    * attention: step-1 keys at indices ``j <= t`` (non-padding), and for every earlier or
      current step r >= 2 only the step-r key at the same index t;
    * output at t: the prediction of ``f_{t+s}``; teacher ``p_{t+s}``, data token ``x_{t+s+1}``.

    This is exactly what drafting computes at inference after the target has produced features
    up to t: the head's cache holds the step-1 entries of positions <= t, and each further draft
    token appends one entry at the next position. Entries whose token x_{t+s} is past the end
    only influence other such entries and are masked out of the losses.

    Args:
        head: the EAGLE head.
        features: (B, T, k*H) target features (final hidden state, or fused layers).
        input_ids: (B, T) token ids.
        steps: unrolling depth (>= 1).
        attention_mask: (B, T) 0/1 padding mask or None.
        detach_between_steps: stop gradients flowing from step s into step s-1's output.

    Returns:
        list of ``steps`` tensors (B, T, H): the predicted features of each step.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    bsz, seq = input_ids.shape
    if features.shape[:2] != (bsz, seq):
        raise ValueError(f"features {tuple(features.shape)} and input_ids {(bsz, seq)} disagree "
                         "on (B, T)")
    feats = features.to(head.fc.weight.dtype)
    if head.training and head.cfg.feature_noise > 0:
        a = head.cfg.feature_noise
        feats = feats + (torch.rand_like(feats) * 2 - 1) * a
    cache = head.new_cache()
    base = torch.arange(seq, device=input_ids.device)[None].expand(bsz, -1)
    outs: list[Tensor] = []
    for s in range(1, steps + 1):
        allowed = _ttt_allowed(seq, s, attention_mask, bsz, input_ids.device)
        out = head(feats, shift_left(input_ids, s, 0), past_key_values=cache,
                   position_ids=base + (s - 1), attention_mask=allowed)
        outs.append(out)
        feats = out.detach() if detach_between_steps else out
    return outs


def distill_targets(head: EagleHead, input_ids: Tensor, hidden: Tensor, loss_mask: Tensor,
                    attention_mask: Tensor | None = None, layers: Tensor | None = None,
                    layer_ids: Sequence[int] | None = None,
                    num_steps: int | None = None) -> list[DistillTarget]:
    """Training pairs for every unrolled step (draft position k = s), packed.

    Alignment: step s output at t is compared with the teacher ``p_{t+s}`` from
    ``hidden[:, t+s]`` (also its feature-regression target); counted iff token t+s+1 exists, is
    not padding and has ``loss_mask`` set. See ``eagle_unrolled_forward`` for the inputs. Only
    step s's N_s counted entries are returned, in (b, t) order, shaped (1, N_s, ...)
    (``pack_rows``): the LM head runs on those rows only.

    Args:
        head: the EAGLE head.
        input_ids: (B, T) token ids.
        hidden: (B, T, H) target final hidden states.
        loss_mask: (B, T) bool, tokens to learn to predict.
        attention_mask: (B, T) 0/1 padding mask or None.
        layers: (B, L, T, H) cached layers (needed when the head fuses layers).
        layer_ids: hidden-state id of each cached layer; None means ``layers`` holds exactly
            ``head.cfg.fuse_layers`` in that order.
        num_steps: unrolling depth; default ``head.cfg.ttt_steps``.

    Returns:
        list over steps of ``DistillTarget(logits (1,N_s,V_draft), teacher_hidden (1,N_s,H),
        mask (1,N_s) all True, labels (1,N_s) target ids, draft_hidden (1,N_s,H),
        teacher_index (1,N_s))``.
    """
    if head.cfg.fuse_layers is None:
        features = hidden
    else:
        if layers is None:
            raise ValueError("this head fuses target layers: pass layers (B, L, T, H) from a "
                             "feature cache built with those layer ids")
        ids = list(layer_ids) if layer_ids is not None else list(head.cfg.fuse_layers)
        if layers.shape[1] != len(ids):
            raise ValueError(f"layers holds {layers.shape[1]} layers but {len(ids)} layer ids "
                             f"({ids}) describe it; pass layer_ids from the cache manifest")
        features = fuse_features(layers, ids, head.cfg.fuse_layers)
    outs = eagle_unrolled_forward(head, features, input_ids, num_steps or head.cfg.ttt_steps,
                                  attention_mask)
    result = []
    for s, o in enumerate(outs, start=1):
        mask = teacher_mask(loss_mask, attention_mask, s)
        teacher, labels = shift_left(hidden, s, 0.0), shifted_labels(input_ids, s)
        rows = teacher_rows(*input_ids.shape, s, input_ids.device)
        o, teacher, labels, rows, mask = pack_rows(mask, o, teacher, labels, rows)
        result.append(DistillTarget(head.compute_logits(o), teacher, mask, labels,
                                    draft_hidden=head.predicted_features(o), teacher_index=rows))
    return result
