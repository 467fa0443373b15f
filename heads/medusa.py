"""Draft family 2: Medusa-1 heads on the target's final hidden state.

Head i (0-based) reads ``hidden_t`` (tokens <= t) and predicts token ``t+2+i``; its teacher is
``p_{t+1+i}``. Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` followed by its
own LM head. The block linears start at zero, so every head starts as the identity on the
hidden state and, with its LM head copied from the target, outputs the target's ``p_t``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from heads.blocks import (
    DistillTarget,
    master_dtype,
    pack_rows,
    shift_left,
    shifted_labels,
    teacher_mask,
    teacher_rows,
)


@dataclass
class MedusaConfig:
    """Medusa heads.

    Attributes:
        num_heads: number of heads (draft positions k = 1..num_heads).
        num_layers: residual blocks per head.
        loss_decay: head i's loss weight is ``loss_decay ** i``.
    """

    num_heads: int = 4
    num_layers: int = 1
    loss_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"MedusaConfig.num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"MedusaConfig.num_layers must be >= 0, got {self.num_layers}")
        if not 0.0 < self.loss_decay <= 1.0:
            raise ValueError(f"MedusaConfig.loss_decay must be in (0, 1], got {self.loss_decay}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MedusaConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown MedusaConfig keys {sorted(unknown)}; "
                             f"allowed: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def loss_weights(self) -> list[float]:
        """Per-head loss weights ``[decay**0, decay**1, ...]``."""
        return [self.loss_decay ** i for i in range(self.num_heads)]


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))`` with the linear zero-initialised (identity at start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:  # (..., H) -> (..., H)
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    """One head: residual blocks then an LM head."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, H) -> (B, T, V)
        return self.lm_head(self.blocks(hidden))


class MedusaHeads(nn.Module):
    """All Medusa heads; each is its own module instance with its own parameters."""

    def __init__(self, cfg: MedusaConfig, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.heads = nn.ModuleList(
            [MedusaHead(hidden_size, vocab_size, cfg.num_layers) for _ in range(cfg.num_heads)])

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits of every head.

        Args:
            hidden: (B, T, H) target final hidden states.

        Returns:
            (B, T, N, V) logits; ``[:, t, i]`` predicts token t+2+i.
        """
        hidden = hidden.to(self.heads[0].lm_head.weight.dtype)
        return torch.stack([head(hidden) for head in self.heads], dim=2)

    def head_logits(self, hidden: Tensor, i: int) -> Tensor:
        """(B, T, V) logits of head ``i`` only (saves memory when heads are used one by one)."""
        return self.heads[i](hidden.to(self.heads[i].lm_head.weight.dtype))

    @torch.no_grad()
    def init_lm_heads(self, lm_head_weight: Tensor) -> None:
        """Copy the target's LM head (V, H) into every head's LM head."""
        if tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"target LM head has shape {tuple(lm_head_weight.shape)}, expected "
                             f"({self.vocab_size}, {self.hidden_size})")
        for head in self.heads:
            head.lm_head.weight.copy_(lm_head_weight)


def build_medusa(cfg: MedusaConfig, target_model: PreTrainedModel) -> MedusaHeads:
    """Medusa heads for ``target_model`` with LM heads copied from the target (its dtype)."""
    w = target_model.get_output_embeddings().weight
    heads = MedusaHeads(cfg, hidden_size=w.shape[1],
                        vocab_size=w.shape[0]).to(master_dtype(w.dtype))
    heads.init_lm_heads(w)
    return heads


def distill_targets(heads: MedusaHeads, input_ids: Tensor, hidden: Tensor, loss_mask: Tensor,
                    attention_mask: Tensor | None = None) -> list[DistillTarget]:
    """Training pairs for every head (draft position k = i+1 for head i), packed.

    Alignment: head i's logits at t (from ``hidden[:, t]``) predict token t+2+i and are compared
    with the teacher ``p_{t+1+i}`` from ``hidden[:, t+1+i]``; counted iff token t+2+i exists, is
    not padding and has ``loss_mask`` set. Only head i's N_i counted entries are returned, in
    (b, t) order, shaped (1, N_i, ...) (``pack_rows``): each head runs on those rows only.

    Args:
        heads: the Medusa heads.
        input_ids: (B, T) token ids (for the data labels).
        hidden: (B, T, H) target final hidden states (the heads' input and the teacher).
        loss_mask: (B, T) bool, tokens to learn to predict.
        attention_mask: (B, T) 0/1 padding mask or None.

    Returns:
        list over heads of ``DistillTarget(logits (1,N_i,V), teacher_hidden (1,N_i,H),
        mask (1,N_i) all True, labels (1,N_i), teacher_index (1,N_i))``.
    """
    out = []
    for i in range(len(heads.heads)):
        shift = 1 + i
        mask = teacher_mask(loss_mask, attention_mask, shift)
        labels = shifted_labels(input_ids, shift)
        rows = teacher_rows(*input_ids.shape, shift, input_ids.device)
        inputs, teacher, labels, rows, mask = pack_rows(
            mask, hidden, shift_left(hidden, shift, 0.0), labels, rows)
        out.append(DistillTarget(heads.head_logits(inputs, i), teacher, mask, labels,
                                 teacher_index=rows))
    return out
