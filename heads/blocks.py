"""Pieces shared by the draft families: the training-target record, shifts, attention masks
and the frozen target weights a head reads.

Position conventions used by every family (see the ``distill_targets`` helpers):

* ``hidden[:, t]`` is the target's final hidden state after reading tokens ``<= t``;
  the teacher distribution ``p_t = softmax(lm_head(hidden_t) / T)`` is the law of token ``t+1``.
* ``loss_mask[:, t]`` marks tokens the draft should learn to *predict* (assistant tokens).
  A teacher position ``t`` is counted iff token ``t+1`` exists in the sequence, is not padding
  and ``loss_mask[:, t+1]`` is set. The same token is the data label for the hard-label CE.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Self

import torch
from torch import Tensor, nn


class HeadConfig:
    """Mixin for the families' head config dataclasses: ``to_dict`` / ``from_dict`` (unknown
    keys refused with the allowed ones named), as packages store and read them."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}; "
                             f"allowed: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)


class DistillTarget(NamedTuple):
    """What a family's ``distill_targets`` returns for one draft position ``k``.

    Attributes:
        draft_logits: (B, T', V_draft) draft logits, aligned with ``teacher_hidden``.
        teacher_hidden: (B, T', H) the target's final hidden state whose LM-head output is the
            teacher distribution for the same entry (unspecified where ``mask`` is False).
        mask: (B, T') bool, True where the entry counts in losses and metrics.
        labels: (B, T') long, the data token the teacher distribution predicts (target ids;
            0 where ``mask`` is False); used by the hard-label CE on data tokens.
        draft_hidden: (B, T', H) predicted features (EAGLE only, for feature regression), else None.
        teacher_index: (B, T') long, the row of ``hidden.flatten(0, 1)`` that ``teacher_hidden``
            was taken from (``teacher_rows``). Positions share teacher rows (the teacher of
            draft position k at token t is the teacher of token t+k), so the recipe computes
            each row's teacher distribution once per batch from these indices.
    """

    draft_logits: Tensor
    teacher_hidden: Tensor
    mask: Tensor
    labels: Tensor
    draft_hidden: Tensor | None = None
    teacher_index: Tensor | None = None


def teacher_rows(batch: int, seq: int, shift: int, device: torch.device) -> Tensor:
    """(B, T) long: the flat row ``b * T + t + shift`` of ``hidden.flatten(0, 1)`` that
    ``shift_left(hidden, shift)[b, t]`` reads (clamped into the same row past the end, where
    the entry is masked out anyway)."""
    t = (torch.arange(seq, device=device) + shift).clamp(max=seq - 1)
    return (torch.arange(batch, device=device)[:, None] * seq + t[None, :])


@torch.no_grad()
def attach_target_embeddings(head: nn.Module, target_model: nn.Module, like: Tensor, what: str,
                             lm_head: bool = True) -> None:
    """Point ``head.embed_tokens`` (and with ``lm_head`` ``head.lm_head``) at the target's input
    embedding and LM head, frozen, in ``like``'s dtype and device (the EAGLE head, the DFlash
    drafter). Both target weights must be ``(head.vocab_size, head.hidden_size)``; ``what``
    names the head in the error."""
    emb = target_model.get_input_embeddings().weight
    out = target_model.get_output_embeddings().weight
    want = (head.vocab_size, head.hidden_size)
    for name, w in (("input embedding", emb), ("LM head", out)):
        if tuple(w.shape) != want:
            raise ValueError(f"target {name} has shape {tuple(w.shape)}, the {what} expects "
                             f"{want}: the {what} was built for another target")
    head.embed_tokens.weight = nn.Parameter(emb.detach().to(like), requires_grad=False)
    if lm_head:
        head.lm_head.weight = nn.Parameter(out.detach().to(like), requires_grad=False)


def require_attached(module: nn.Module, what: str) -> None:
    """Refuse a head whose frozen target weights (embedding, LM head) are still unset."""
    if not getattr(module, "target_attached", True):
        raise ValueError(f"the {what} reads the target's embedding and LM head, which are not "
                         "attached: load the draft with its target (load_package(..., "
                         "target=...)) or call attach_target(target_model) on it")


def master_dtype(target_dtype: torch.dtype) -> torch.dtype:
    """The dtype a draft's trainable weights are built in: fp32 for a 16-bit target. Adam's
    updates late in a cosine schedule are below bf16's resolution (about 0.4% of a weight) and
    would round away; bf16 compute comes from autocast (``train.mixed_precision``), and decoding
    casts the package to the decode dtype."""
    return torch.float32 if target_dtype in (torch.bfloat16, torch.float16) else target_dtype


def pack_rows(mask: Tensor, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Keep only the counted entries: each (B, T, ...) tensor becomes (1, N, ...), N = mask.sum().

    Training on packed rows skips padding and non-assistant tokens before the expensive LM-head
    matmul and the vocabulary-wide loss. Returns the packed tensors (None stays None) followed by
    the packed mask, all True, of shape (1, N).
    """
    m = mask.bool()
    out = tuple(None if x is None else x[m].unsqueeze(0) for x in tensors)
    return (*out, torch.ones(1, int(m.sum()), dtype=torch.bool, device=mask.device))


def shift_left(x: Tensor, s: int, fill: float = 0) -> Tensor:
    """Shift along dim 1 so that ``out[:, t] = x[:, t + s]``; the last ``s`` entries are ``fill``.

    Args:
        x: (B, T, ...) tensor.
        s: non-negative shift.
        fill: value for entries whose source lies past the end.

    Returns:
        (B, T, ...) tensor of the same dtype.
    """
    if s < 0:
        raise ValueError(f"shift_left needs s >= 0, got {s}")
    if s == 0:
        return x
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def teacher_mask(loss_mask: Tensor, attention_mask: Tensor | None, shift: int) -> Tensor:
    """Mask of draft entries at ``t`` whose teacher is ``p_{t+shift}`` (predicting token t+shift+1).

    Args:
        loss_mask: (B, T) bool, tokens to learn to predict.
        attention_mask: (B, T) 0/1 padding mask or None (no padding).
        shift: teacher offset (0 for the draft LM, 1+i for Medusa head i, s for EAGLE step s).

    Returns:
        (B, T) bool: ``loss_mask[t+shift+1] & attention_mask[t+shift+1]``, False past the end.
    """
    keep = loss_mask.bool()
    if attention_mask is not None:
        keep = keep & attention_mask.bool()
    return shift_left(keep, shift + 1, False)


def shifted_labels(input_ids: Tensor, shift: int) -> Tensor:
    """(B, T) data labels for teacher offset ``shift``: ``input_ids[t+shift+1]`` (0 past the
    end)."""
    return shift_left(input_ids, shift + 1, 0)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Turn a boolean attention mask (True = attend) into an additive float mask.

    Uses the dtype's most negative finite value, so a fully masked row gives finite numbers
    (such rows belong to padding and are excluded from losses) rather than NaN.

    Args:
        allowed: (B, 1, q, kv) bool.
        dtype: float dtype of the attention scores.

    Returns:
        (B, 1, q, kv) float tensor with 0 where allowed and ``finfo(dtype).min`` elsewhere.
    """
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg)


def causal_allowed(q_len: int, past_len: int, device: torch.device) -> Tensor:
    """(1, 1, q, past+q) bool causal mask for ``q_len`` new tokens after ``past_len`` cached
    ones."""
    q_pos = torch.arange(q_len, device=device)[:, None] + past_len
    k_pos = torch.arange(past_len + q_len, device=device)[None, :]
    return (k_pos <= q_pos)[None, None]
