"""The teacher: the target's next-token distribution recomputed from a cached hidden state.

The LM head is linear and frozen, so ``softmax(lm_head(h_t) / T)`` is exact from the cached
final-norm hidden state ``h_t``. This is the one place the frozen LM head is applied to cached
hidden states: the training recipe, the losses and metrics (through
``train.teacher_probs.teacher_log_probs``) and the feature cache's own log-normaliser all call
it. It lives in ``data/`` because the cache defines what its rows mean and ``data/`` must not
import ``train/``.
"""
from __future__ import annotations

import torch


def teacher_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                   temperature: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Teacher logits from cached hidden states: ``lm_head(hidden) / T`` in fp32, soft-capped
    first (``cap * tanh(logits / cap)``) for a target whose forward caps them (Gemma 2's
    ``final_logit_softcapping``; :func:`logit_softcap` reads it from the config).

    The matmul runs in the LM head's dtype, as in the target's own forward (a bf16 target's
    teacher is its bf16 logits; the (V, H) weight is not copied to fp32 per call).

    Args:
        hidden: ``(..., H)`` cached final hidden states (any float dtype).
        lm_head_weight: ``(V, H)`` the target's frozen LM-head weight.
        temperature: Softmax temperature (> 0).
        softcap: the target's final logit soft-cap, or None (most targets).

    Returns:
        ``(..., V)`` fp32 logits; ``softmax`` of them is the teacher distribution of the next token.
    """
    logits = torch.nn.functional.linear(hidden.to(lm_head_weight.dtype), lm_head_weight)
    if softcap:
        logits = torch.tanh(logits.float() / softcap) * softcap
    return scale_logits(logits, temperature)


@torch.no_grad()
def teacher_log_normalizer(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                           chunk: int = 256, softcap: float | None = None) -> torch.Tensor:
    """``(T,)`` float32 ``logsumexp`` of :func:`teacher_logits` (temperature 1) per row of
    ``hidden (T, H)``, in chunks of rows (never all (T, V) logits at once)."""
    w = lm_head_weight
    parts = [torch.logsumexp(teacher_logits(h.to(w.device), w, softcap=softcap), dim=-1).cpu()
             for h in hidden.split(chunk)]
    return torch.cat(parts) if parts else torch.zeros(0)


def logit_softcap(config) -> float | None:
    """A config's final logit soft-cap (``final_logit_softcapping``, Gemma 2), or None."""
    config = getattr(config, "text_config", None) or config
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32 (no copy beyond the cast at temperature 1)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature
