"""Peak training memory per process, estimated before the first step.

A run whose draft, optimizer state and vocabulary-wide logits cannot fit is otherwise killed by
the kernel's OOM killer a step in, with nothing printed. :func:`check_training_memory` (called by
the recipe once the draft is built, before the optimizer and the first step) estimates the peak
from the shapes alone, logs it in one line and, when it exceeds the memory this process can use,
raises :class:`~train.config.ConfigError` with the breakdown and the overrides that would fit
(each estimated the same way). ``train.memory_check=false`` skips it.

What the estimate counts (bytes, per process), following the recipe's code paths:

* the target's resident weights, and draft tensors that are not the target's own;
* trainable draft parameters: weights, gradients, AdamW's two moments and the optimizer step's
  temporaries (one tensor at a time on a CPU, all at once with CUDA's foreach kernels);
* the student logits of every draft position for ``rows = micro_batch_size x data.max_length``
  packed rows (an upper bound: only counted tokens are packed), plus one position's gradient;
* the teacher: one (rows, V_draft) log-probability table when ``train.teacher_per_token``
  shares it (``shared_teacher_fits``), else one position's logits, else chunks;
* the loss's vocabulary-wide tensors kept for backward: every chunk's when the student logits
  fit ``train.teacher_logits_budget``, else one chunk's (``recompute_loss``: chunks recomputed
  in backward, ``DistillLoss(..., recompute=True)``). Past the budget the teacher and the loss
  are counted at the budget's worth anyway: an upper bound, so that a larger batch, sequence
  or vocabulary never estimates less;
* activations, roughly: rows x positions x the draft's Linear widths, and the batch's features;
* a fixed allowance for the interpreter, libraries and allocator slack.

The estimate must stay within ``MARGIN`` of the memory this process can use
(:func:`train.host_memory.usable_memory`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from draftsmith.heads.family import get_family
from draftsmith.train.config import ConfigError
from draftsmith.train.host_memory import size_text, usable_memory
from draftsmith.train.teacher_probs import TEACHER_CHUNK_ELEMENTS

log = logging.getLogger("draftsmith.distill")

GiB = 1024 ** 3
MARGIN = 0.85  # the estimate must stay within this share of the usable memory
RUNTIME_BYTES = GiB  # interpreter, torch, tokenizer, data loader and allocator slack
# per row and Linear feature (in + out), on top of the logits' element size: a SmolLM2-shaped
# draft LM measured 4.6 (bf16 autocast) and 6.3 (fp32) bytes, forward and backward
ACTIVATION_BYTES = 4
LOSS_CHUNK_TENSORS = 4  # fp32 (chunk, V) tensors of one loss chunk: q, p, log p, the gradient
REDUCED_VOCAB = 32768  # the reduced draft vocabulary suggested for full-vocabulary heads
_F32 = 4


# ----------------------------------------------------------------------------- the recipe's policy
def shared_teacher_fits(rows: int, vocab: int, budget: int) -> bool:
    """Whether one (rows, vocab) teacher table for all positions fits ``budget`` elements."""
    return rows * vocab <= budget


def recompute_loss(student_elements: int, budget: int) -> bool:
    """Whether the loss recomputes its chunks in backward: when the positions' student logits
    (sum of rows x V_draft) exceed ``budget`` elements, keeping every chunk's fp32 tensors for
    backward would hold several times that."""
    return student_elements > budget


# ----------------------------------------------------------------------------- shapes and estimate
@dataclass(frozen=True)
class TrainShapes:
    """What the estimate reads: sizes of the run, not its tensors.

    Attributes:
        micro_batch_size: sequences per process per micro-step.
        max_length: tokens per sequence at most (``data.max_length``).
        grad_accum: micro-steps per optimizer step (only for suggesting options).
        positions: draft positions trained per token.
        vocab_size: the target's vocabulary (the teacher's width).
        draft_vocab: the student logits' width (V_draft).
        hidden_size: the target's hidden size.
        trainable_params: draft parameters that train.
        largest_trainable: elements of the largest trainable tensor.
        param_bytes: bytes per trainable element (4: fp32 master weights).
        frozen_draft_bytes: frozen draft tensors that are not the target's own storage.
        target_bytes: the target's weights resident in this memory.
        activation_width: sum of in + out features of the draft's Linear layers below the
            vocabulary (per row and position).
        feature_width: floats per token of a batch's cached features (hidden + fused layers).
        logits_bytes: bytes per student logit (2 under bf16 / fp16 autocast).
        teacher_budget: ``train.teacher_logits_budget``.
        teacher_per_token: ``train.teacher_per_token``.
        teacher_draft_rows: the teacher needs only the draft vocabulary's LM-head rows (the
            cache's log-normaliser path): its transient logits are V_draft wide.
        fused_fkl_only: the loss is the fused forward KL alone (2 fp32 tensors kept per chunk).
        loss_chunk: rows per loss chunk (``loss.chunk_size``).
        cuda: the run is on a CUDA device (optimizer temporaries for all tensors at once).
        own_lm_head_params: trainable LM-head parameters ``draft.config.lm_head=shared`` would
            remove (Medusa heads with their own LM heads), else 0.
        reducible_vocab: the head predicts the full vocabulary and
            ``draft.config.draft_vocab_size`` could reduce it (EAGLE).
        mixed_precision: ``train.mixed_precision``.
    """

    micro_batch_size: int
    max_length: int
    positions: int
    vocab_size: int
    draft_vocab: int
    hidden_size: int
    trainable_params: int
    target_bytes: int
    grad_accum: int = 1
    largest_trainable: int = 0
    param_bytes: int = 4
    frozen_draft_bytes: int = 0
    activation_width: int = 0
    feature_width: int = 0
    logits_bytes: int = 4
    teacher_budget: int = 1 << 28
    teacher_per_token: bool = True
    teacher_draft_rows: bool = False
    fused_fkl_only: bool = True
    loss_chunk: int = 256
    cuda: bool = False
    own_lm_head_params: int = 0
    reducible_vocab: bool = False
    mixed_precision: str = "no"

    @property
    def rows(self) -> int:
        """Packed rows per position at most: every token of every sequence of the batch."""
        return self.micro_batch_size * self.max_length


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes per process, by part."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size_text(b)}" for name, b in self.parts.items() if b)


def estimate(s: TrainShapes) -> MemoryEstimate:
    """The peak training memory of one process for the shapes ``s`` (see the module doc)."""
    rows, pos, vocab, vd = s.rows, s.positions, s.vocab_size, s.draft_vocab
    budget, chunk = s.teacher_budget, min(s.loss_chunk, rows)
    train_bytes = s.trainable_params * s.param_bytes
    parts = {"target weights": s.target_bytes,
             "draft weights": train_bytes + s.frozen_draft_bytes,
             "gradients": train_bytes,
             "AdamW moments": 2 * train_bytes,
             "optimizer temporaries": (train_bytes if s.cuda
                                       else 2 * s.largest_trainable * s.param_bytes)}
    student = pos * rows * vd
    parts["student logits"] = (student + rows * vd) * s.logits_bytes  # + one position's gradient
    # Past the budget the recipe switches to chunks (the teacher from hidden states, the loss
    # recomputing its chunks in backward); the estimate then keeps the budget's worth, an upper
    # bound that never makes a larger batch, sequence or vocabulary estimate less.
    table = rows * vd if s.teacher_per_token else rows * vocab
    width = vd if s.teacher_draft_rows else vocab  # the teacher's transient logits
    t_chunk = min(rows, max(1, TEACHER_CHUNK_ELEMENTS // vocab))
    parts["teacher"] = (min(table, budget) * _F32
                        + t_chunk * width * (2 * _F32 + s.logits_bytes))
    kept = 2 if s.fused_fkl_only else 3  # fp32 (rows, V) tensors a chunk keeps for backward
    parts["loss state"] = (kept * min(student, budget) + LOSS_CHUNK_TENSORS * chunk * vd) * _F32
    parts["activations"] = (rows * pos * s.activation_width * (ACTIVATION_BYTES + s.logits_bytes)
                            + 2 * rows * s.feature_width * _F32)
    parts["runtime"] = RUNTIME_BYTES
    return MemoryEstimate(parts)


# ----------------------------------------------------------------------------- options
def _halvings(n: int, floor: int) -> list[int]:
    out, n = [], n // 2
    while n >= floor:
        out.append(n)
        n //= 2
    return out


def _family_options(s: TrainShapes) -> list[tuple[str, TrainShapes]]:
    """Head settings that shrink the run: shared LM heads, a reduced draft vocabulary."""
    out = []
    h = s.hidden_size
    if s.own_lm_head_params:
        out.append(("draft.config.lm_head=shared", dataclasses.replace(
            s, trainable_params=s.trainable_params - s.own_lm_head_params,
            largest_trainable=h * h, own_lm_head_params=0)))
    if s.reducible_vocab and s.draft_vocab > REDUCED_VOCAB:
        out.append((f"draft.config.draft_vocab_size={REDUCED_VOCAB}", dataclasses.replace(
            s, draft_vocab=REDUCED_VOCAB, trainable_params=s.trainable_params + REDUCED_VOCAB * h,
            largest_trainable=max(s.largest_trainable, REDUCED_VOCAB * h),
            reducible_vocab=False)))
    return out


def _run_options(s: TrainShapes, fits: Callable[[TrainShapes], bool]
                 ) -> list[tuple[str, TrainShapes]]:
    """The largest micro-batch that fits (grad_accum raised to keep at least the batch), the
    longest data.max_length that fits, and bf16 autocast where logits are fp32."""
    out = []
    for mb in range(s.micro_batch_size - 1, 0, -1):
        cand = dataclasses.replace(s, micro_batch_size=mb)
        if fits(cand):
            accum = math.ceil(s.micro_batch_size * s.grad_accum / mb)
            out.append((f"train.micro_batch_size={mb} train.grad_accum={accum}", cand))
            break
    for length in _halvings(s.max_length, 64):
        cand = dataclasses.replace(s, max_length=length)
        if fits(cand):
            out.append((f"data.max_length={length}", cand))
            break
    if s.logits_bytes == 4 and s.mixed_precision == "no":
        out.append(("train.mixed_precision=bf16", dataclasses.replace(
            s, logits_bytes=2, mixed_precision="bf16")))
    return out


def fitting_options(s: TrainShapes, limit: int) -> list[tuple[str, MemoryEstimate]]:
    """Overrides (space-separated ``key=value``) whose estimate fits ``limit`` bytes: each head
    setting alone, or with the largest batch / longest sequences that then fit, and the run's
    own sizes alone."""
    def fits(x: TrainShapes) -> bool:
        return estimate(x).total <= limit

    found = []
    for name, x in _family_options(s):
        if fits(x):
            found.append((name, estimate(x)))
        else:
            found += [(f"{name} {more}", estimate(y)) for more, y in _run_options(x, fits)
                      if fits(y)]
    return found + [(name, estimate(x)) for name, x in _run_options(s, fits) if fits(x)]


# ----------------------------------------------------------------------------- from a run
def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
            if not t.is_meta}


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.is_meta:  # not allocated (a shared LM head not yet attached)
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def run_shapes(cfg: DictConfig, target_model: nn.Module, draft: Any,
               device: torch.device) -> TrainShapes:
    """The shapes of this run: the config's sizes, the target's, the built draft's parameters.

    Args:
        cfg: the resolved training config.
        target_model: the loaded target (its LM head is the teacher's).
        draft: the ``train.trainable.TrainableDraft`` (not yet prepared by accelerate).
        device: the training device.
    """
    lm_head = target_model.get_output_embeddings().weight
    vocab, hidden = int(lm_head.shape[0]), int(lm_head.shape[1])
    d2t = draft.draft_to_target
    vd = vocab if d2t is None else int(d2t.numel())
    cuda = device.type == "cuda"
    target_tensors = [*target_model.parameters(), *target_model.buffers()]
    if cuda:  # only the teacher's LM head moves to the device
        target_bytes = _nbytes(t for t in target_tensors if t.device.type == "cuda")
        target_bytes += 0 if lm_head.device.type == "cuda" else lm_head.nbytes
    else:
        target_bytes = _nbytes(target_tensors)
    own = set() if cuda else _storages(target_model)  # on a CPU, shared storage is not copied
    params = list(draft.module.parameters())
    trainable = [p for p in params if p.requires_grad]
    frozen = _nbytes(p for p in params if not p.requires_grad
                     and (p.is_meta or p.untyped_storage().data_ptr() not in own))
    width = sum(m.in_features + m.out_features for m in draft.module.modules()
                if isinstance(m, nn.Linear) and m.out_features not in (vocab, vd))
    shape = get_family(draft.kind).memory_shape(draft.head_config)
    loss = cfg.loss
    weights = {k for k, w in (OmegaConf.select(cfg, "loss.weights") or {}).items() if w}
    temperature = float(OmegaConf.select(cfg, "loss.temperature", default=1.0))
    mp = str(cfg.train.mixed_precision)
    return TrainShapes(
        micro_batch_size=int(cfg.train.micro_batch_size), max_length=int(cfg.data.max_length),
        grad_accum=int(cfg.train.grad_accum), positions=int(draft.num_positions),
        vocab_size=vocab, draft_vocab=vd, hidden_size=hidden,
        trainable_params=sum(p.numel() for p in trainable),
        largest_trainable=max((p.numel() for p in trainable), default=0),
        param_bytes=max((p.element_size() for p in trainable), default=4),
        frozen_draft_bytes=frozen, target_bytes=target_bytes, activation_width=width,
        feature_width=hidden * (1 + shape.fused_layers),
        logits_bytes=2 if mp in ("bf16", "fp16") else 4,
        teacher_budget=int(cfg.train.teacher_logits_budget),
        teacher_per_token=bool(cfg.train.teacher_per_token),
        teacher_draft_rows=(d2t is not None and bool(cfg.train.teacher_lse)
                            and temperature == 1.0 and not loss.get("renormalize", False)),
        fused_fkl_only=weights == {"fkl"} and bool(loss.get("fused", True)),
        loss_chunk=int(loss.get("chunk_size", 256)), cuda=cuda,
        own_lm_head_params=shape.own_lm_heads * vocab * hidden,
        reducible_vocab=d2t is None and shape.reducible_vocab,
        mixed_precision=mp)


def check_memory(shapes: TrainShapes, usable: int, source: str = "") -> MemoryEstimate:
    """Log the estimate; raise ConfigError when it exceeds ``MARGIN`` of ``usable`` bytes."""
    est = estimate(shapes)
    limit = int(usable * MARGIN)
    log.info("memory estimate: %s peak per process (%s) of %s usable (%s)", size_text(est.total),
             est.describe(), size_text(usable), source or "given")
    if est.total <= limit:
        return est
    options = fitting_options(shapes, limit)
    lines = [f"  {name}  (estimated {size_text(e.total)})" for name, e in options]
    advice = ("Overrides that would fit:\n" + "\n".join(lines) if lines else
              "No override found that fits: use a machine with more memory, or combine a "
              "smaller train.micro_batch_size with a shorter data.max_length.")
    raise ConfigError(
        f"training would need about {size_text(est.total)} per process but "
        f"{size_text(limit)} is usable ({MARGIN:.0%} of {size_text(usable)}: "
        f"{source or 'given'}); the kernel would likely kill it for lack of memory in its "
        f"first steps.\nEstimate: {est.describe()} "
        f"({shapes.rows} rows = train.micro_batch_size {shapes.micro_batch_size} x data.max_length "
        f"{shapes.max_length}; {shapes.positions} positions x vocabulary {shapes.draft_vocab}; "
        f"{shapes.trainable_params:,} trainable parameters).\n{advice}\n"
        "train.memory_check=false skips this check.")


def check_training_memory(cfg: DictConfig, target_model: nn.Module, draft: Any,
                          device: torch.device, usable: tuple[int, str] | None = None
                          ) -> MemoryEstimate | None:
    """The recipe's check before its first step (``train.memory_check``; None when skipped).

    Raises:
        ConfigError: the estimate does not fit, naming the overrides that would.
    """
    if not bool(OmegaConf.select(cfg, "train.memory_check", default=True)):
        log.info("memory estimate skipped (train.memory_check=false)")
        return None
    shapes = run_shapes(cfg, target_model, draft, device)
    size, source = usable if usable is not None else usable_memory(device)
    return check_memory(shapes, size, source)


def check_memory_on_all_ranks(cfg: Any, target_model: Any, draft: Any, accelerator: Any) -> None:
    """:func:`check_training_memory` on every process; all refuse together (each measures its
    own usable memory, and a lone refusal would leave the others waiting)."""
    import torch

    from draftsmith.train.config import ConfigError

    error = None
    try:
        check_training_memory(cfg, target_model, draft, accelerator.device)
    except ConfigError as e:
        error = e
    if accelerator.num_processes > 1:
        flag = torch.tensor([float(error is not None)], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0 and error is None:
            error = ConfigError("another process estimated that training would not fit in its "
                                "memory: its log names the overrides that would fit "
                                "(train.memory_check=false skips the check)")
    if error is not None:
        raise error


def check_deepspeed_clipping(accelerator: Any, cfg: Any) -> None:
    """DeepSpeed's JSON ``gradient_clipping`` must equal ``train.max_grad_norm``."""
    from draftsmith.train.config import ConfigError

    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    clip = plugin.deepspeed_config.get("gradient_clipping", 1.0)
    if float(clip) != float(cfg.train.max_grad_norm):
        raise ConfigError(
            f"DeepSpeed clips gradients at {clip} (its JSON 'gradient_clipping') but "
            f"train.max_grad_norm={cfg.train.max_grad_norm}; set both to the same value")
