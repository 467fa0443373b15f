"""Draft family 2: Medusa-1 heads on the target's final hidden state.

Head i (0-based) reads ``hidden_t`` (tokens <= t) and predicts token ``t+2+i``; its teacher is
``p_{t+1+i}``. Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` followed by an
LM head: with ``lm_head="own"`` each head has its own trainable copy of the target's LM head (the
original Medusa-1); with ``lm_head="shared"`` every head applies the target's frozen LM head,
which is neither trained nor stored in a package (it is attached from the target at load, as the
EAGLE head's is). ``"auto"`` picks ``own`` when the heads' LM-head training state (fp32 weights,
gradients and two AdamW moments: ``num_heads x V x H x 16`` bytes) is at most
``OWN_LM_HEAD_BYTES``, else ``shared``: a 262k-token vocabulary makes each own LM head 168M
parameters. The block linears start at zero, so every head starts as the identity on the hidden
state and outputs the target's ``p_t``.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils import skip_init
from transformers import PreTrainedModel

from draftsmith.heads.blocks import (
    DistillTarget,
    HeadConfig,
    master_dtype,
    pack_rows,
    shift_left,
    shifted_labels,
    teacher_mask,
    teacher_rows,
)

log = logging.getLogger(__name__)
LM_HEAD_MODES = ("auto", "own", "shared")
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"  # the name Medusa's training, TGI and TRT-LLM use
DEFAULT_BRANCHING = (4, 2, 2, 1)  # decode option medusa_branching: the static tree when none
# was given nor measured
OWN_LM_HEAD_BYTES = 2 * 1024 ** 3  # lm_head=auto: own LM heads while their training state fits
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + gradient + two AdamW moments


@dataclass
class MedusaConfig(HeadConfig):
    """Medusa heads.

    Attributes:
        num_heads: number of heads (draft positions k = 1..num_heads).
        num_layers: residual blocks per head.
        loss_decay: head i's loss weight is ``loss_decay ** i``.
        lm_head: ``"own"`` = each head trains its own copy of the target's LM head;
            ``"shared"`` = all heads apply the target's frozen LM head (not stored in a
            package); ``"auto"`` = resolved against the target (:func:`resolve_lm_head`) before
            the heads are built. The default is ``"own"`` so that packages written before the
            key existed load as they were trained.
    """

    num_heads: int = 4
    num_layers: int = 1
    loss_decay: float = 0.8
    lm_head: str = "own"

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"MedusaConfig.num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"MedusaConfig.num_layers must be >= 0, got {self.num_layers}")
        if not 0.0 < self.loss_decay <= 1.0:
            raise ValueError(f"MedusaConfig.loss_decay must be in (0, 1], got {self.loss_decay}")
        if self.lm_head not in LM_HEAD_MODES:
            raise ValueError(f"MedusaConfig.lm_head must be one of {LM_HEAD_MODES}, got "
                             f"{self.lm_head!r} (set draft.config.lm_head=auto to let the "
                             "target's size decide)")
        if self.lm_head == "shared" and self.num_layers == 0:
            raise ValueError("MedusaConfig.lm_head=shared with num_layers=0 leaves nothing to "
                             "train (every head would be the target's LM head): set "
                             "draft.config.num_layers >= 1 or draft.config.lm_head=own")

    @property
    def shared_lm_head(self) -> bool:
        """Whether the heads apply the target's frozen LM head (a resolved config only)."""
        if self.lm_head == "auto":
            raise ValueError("MedusaConfig.lm_head=auto is not resolved yet: resolve it against "
                             "the target first (heads.medusa.resolve_lm_head)")
        return self.lm_head == "shared"

    def loss_weights(self) -> list[float]:
        """Per-head loss weights ``[decay**0, decay**1, ...]``."""
        return [self.loss_decay ** i for i in range(self.num_heads)]


def own_lm_head_bytes(num_heads: int, vocab_size: int, hidden_size: int) -> int:
    """Training memory of ``num_heads`` own LM heads: fp32 weights, gradients, AdamW moments."""
    return int(num_heads) * int(vocab_size) * int(hidden_size) * TRAIN_BYTES_PER_PARAM


def auto_lm_head(num_heads: int, vocab_size: int, hidden_size: int) -> str:
    """What ``lm_head="auto"`` means for this target: ``"own"`` when the heads' own LM heads
    train within ``OWN_LM_HEAD_BYTES``, else ``"shared"``; logs the choice."""
    need = own_lm_head_bytes(num_heads, vocab_size, hidden_size)
    mode = "own" if need <= OWN_LM_HEAD_BYTES else "shared"
    log.info("draft.config.lm_head=auto -> %s (%d own LM heads of %d x %d would need %.2f GiB "
             "of weights, gradients and AdamW state; own up to %.0f GiB)", mode, num_heads,
             vocab_size, hidden_size, need / 1024 ** 3, OWN_LM_HEAD_BYTES / 1024 ** 3)
    return mode


def resolve_lm_head(cfg: MedusaConfig, vocab_size: int, hidden_size: int) -> MedusaConfig:
    """``cfg`` with ``lm_head="auto"`` replaced by :func:`auto_lm_head`'s choice."""
    if cfg.lm_head != "auto":
        return cfg
    return dataclasses.replace(cfg, lm_head=auto_lm_head(cfg.num_heads, vocab_size, hidden_size))


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
    """One head: residual blocks, then its own LM head (None when the heads share the
    target's)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int,
                 own_lm_head: bool = True) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
        # an own LM head is always copied from the target's (build_medusa) or loaded: no init
        self.lm_head = (skip_init(nn.Linear, hidden_size, vocab_size, bias=False) if own_lm_head
                        else None)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, H) -> (B, T, V)
        if self.lm_head is None:
            raise RuntimeError("this head shares the target's LM head: call it through "
                               "MedusaHeads.head_logits")
        return self.lm_head(self.blocks(hidden))


class MedusaHeads(nn.Module):
    """All Medusa heads; each is its own module instance with its own parameters.

    With ``cfg.lm_head="shared"`` the heads' common LM head is ``self.lm_head``: frozen, on the
    meta device until :meth:`attach_target` points it at the target's LM-head weight (the same
    tensor, in the target's dtype).
    """

    def __init__(self, cfg: MedusaConfig, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.shared = cfg.shared_lm_head
        self.heads = nn.ModuleList(
            [MedusaHead(hidden_size, vocab_size, cfg.num_layers, own_lm_head=not self.shared)
             for _ in range(cfg.num_heads)])
        self.lm_head: nn.Linear | None = None
        if self.shared:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False, device="meta")
            self.lm_head.weight.requires_grad_(False)

    @property
    def target_attached(self) -> bool:
        """False while a shared LM head still waits for :meth:`attach_target`."""
        return not self.shared or not self.lm_head.weight.is_meta

    def out_head(self, i: int) -> nn.Module:
        """The LM head that head ``i`` applies (its own, or the shared target one)."""
        if not self.shared:
            return self.heads[i].lm_head
        if not self.target_attached:
            raise RuntimeError("these Medusa heads share the target's LM head, which is not "
                               "attached: load the package with its target (target=...) or call "
                               "heads.attach_target(target_model)")
        return self.lm_head

    @torch.no_grad()
    def attach_target(self, target_model: PreTrainedModel) -> None:
        """Point the shared LM head at the target's LM-head weight (frozen, never copied);
        nothing to do for own LM heads."""
        if not self.shared:
            return
        w = target_model.get_output_embeddings().weight
        want = (self.vocab_size, self.hidden_size)
        if tuple(w.shape) != want:
            raise ValueError(f"target LM head has shape {tuple(w.shape)}, the heads expect {want}:"
                             " they were built for another target")
        self.lm_head.weight = nn.Parameter(w.detach(), requires_grad=False)  # the same storage

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits of every head.

        Args:
            hidden: (B, T, H) target final hidden states.

        Returns:
            (B, T, N, V) logits; ``[:, t, i]`` predicts token t+2+i.
        """
        return torch.stack([self.head_logits(hidden, i) for i in range(len(self.heads))], dim=2)

    def head_logits(self, hidden: Tensor, i: int) -> Tensor:
        """(B, T, V) logits of head ``i`` only (saves memory when heads are used one by one).

        The blocks run in their own dtype and the LM head in its own: a shared LM head keeps the
        target's dtype (it is the target's tensor) while the blocks train in fp32."""
        out = self.out_head(i)
        blocks = self.heads[i].blocks
        dtype = next((t.dtype for t in (*blocks.parameters(), *blocks.buffers())
                      if t.is_floating_point()), out.weight.dtype)
        x = blocks(hidden.to(dtype))
        return out(x.to(out.weight.dtype))

    @torch.no_grad()
    def init_lm_heads(self, lm_head_weight: Tensor) -> None:
        """Copy the target's LM head (V, H) into every head's own LM head."""
        if self.shared:
            raise ValueError("these heads share the target's LM head: use attach_target")
        if tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"target LM head has shape {tuple(lm_head_weight.shape)}, expected "
                             f"({self.vocab_size}, {self.hidden_size})")
        for head in self.heads:
            head.lm_head.weight.copy_(lm_head_weight)

    def per_head_state_dict(self) -> dict[str, Tensor]:
        """The state in the own-LM-head layout (``heads.{i}.blocks.*``,
        ``heads.{i}.lm_head.weight``) whatever the mode: a shared LM head appears once per head
        (the same tensor), as the Medusa export layout stores it."""
        state = {k: v for k, v in self.state_dict().items() if k.startswith("heads.")}
        if self.shared:
            w = self.out_head(0).weight
            state.update({f"heads.{i}.lm_head.weight": w for i in range(len(self.heads))})
        return state


def build_medusa(cfg: MedusaConfig, target_model: PreTrainedModel) -> MedusaHeads:
    """Medusa heads for ``target_model`` (``lm_head="auto"`` resolved against it) in the target's
    dtype (fp32 for a 16-bit target): own LM heads copied from the target, or the target's
    attached as the shared one (its tensor, in its dtype)."""
    w = target_model.get_output_embeddings().weight
    vocab, hidden = w.shape
    cfg = resolve_lm_head(cfg, vocab, hidden)
    heads = MedusaHeads(cfg, hidden_size=hidden, vocab_size=vocab).to(master_dtype(w.dtype))
    if heads.shared:
        heads.attach_target(target_model)
    else:
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


def static_tree_size(branching: list[int] | tuple[int, ...]) -> int:
    """Nodes of the static tree ``branching`` drafts: the top ``branching[d-1]`` tokens of head
    ``d-1`` under every node of the depth above (a Cartesian product), summed over depths."""
    total, width = 0, 1
    for b in branching:
        width *= int(b)
        total += width
    return total
