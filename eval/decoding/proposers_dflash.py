"""The DFlash proposer: one drafter forward per step drafts a chain of up to B-1 tokens.

The drafter (``heads/dflash.py``) keeps a per-layer key/value cache of the *context*: the fused
target layers of the committed tokens, one entry per position, projected once when the target
has read them (after the prefill, and after each verification for the pending token and the
accepted drafts). A step feeds the block ``[pending token, MASK x (B-1)]`` at positions
``P .. P+B-1`` (P = the pending token's position) over that cache; the block's own keys and
values are computed inside the forward and never kept. Slot k's logits give the draft at
position P+k. The cache and the block forward are :class:`~eval.decoding.dflash_step.DFlashStep`:
preallocated buffers written in place (sized for the prompt and ``RESERVE`` more positions,
doubled when full), no copy of the cache in a round.

Greedy decoding takes each slot's argmax (point masses, no ``q``). Sampling draws each slot from
its own warped distribution, which is that draft's ``q``: the slots are drawn independently of
one another given the context, a valid proposal whatever the earlier drafts were, so the
verifier's rejection sampling stays lossless.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftsmith.eval.decoding.dflash_step import DFlashStep
from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.target_model import RESERVE, TargetOutput
from draftsmith.eval.decoding.verify import top1
from draftsmith.heads.blocks import require_attached
from draftsmith.heads.dflash import KVCache


class DFlashProposer(Proposer):
    """A DFlash drafter as a proposer (chains only).

    Args:
        drafter: a :class:`heads.dflash.DFlashDrafter` (``context``, ``context_kv``,
            ``block_ids``, ``block_hidden``, ``compute_logits``, ``cfg.fuse_layers`` /
            ``block_size``) with its target's embedding and LM head attached.
        vocab_size: the target's vocabulary size.
    """

    name = "dflash"

    @classmethod
    def for_draft(cls, module: nn.Module, head_config: Any, vocab_size: int, settings: Any,
                  vocab_ids: torch.Tensor | None = None) -> DFlashProposer:
        """The proposer drafting with ``module``: a chain (``settings.tree`` must be off; a draft
        vocabulary of frequent ids is not supported)."""
        if getattr(settings, "tree", False):
            raise ValueError("a dflash draft drafts one chain per forward, no tree: use "
                             "tree=chain or tree=auto")
        if vocab_ids is not None:
            raise ValueError("a dflash draft drafts over the target's whole vocabulary: use "
                             "draft_vocab=full")
        return cls(module, vocab_size)

    def __init__(self, drafter: nn.Module, vocab_size: int) -> None:
        require_attached(drafter, "DFlash drafter")
        if int(drafter.vocab_size) != vocab_size:
            raise ValueError(f"the drafter drafts over {drafter.vocab_size} ids, the target's "
                             f"vocabulary has {vocab_size}: it was built for another target")
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.layer_ids = tuple(drafter.cfg.fuse_layers)
        self.block_size = int(drafter.block_size)
        self.mask_token_id = int(drafter.cfg.mask_token_id)
        self.device = next(drafter.parameters()).device
        # the context cache (preallocated) and the block forward; not named ``step``: decode's
        # ``fused_draft=false`` clears a proposer's ``step`` (the EAGLE head's modules path)
        self.drafting = DFlashStep(drafter)

    @property
    def n_ctx(self) -> int:
        """Context positions in the cache: those of the committed tokens."""
        return self.drafting.n_ctx

    @property
    def cache(self) -> KVCache | None:
        """Every layer's context keys and values (views of the buffers), None before a reset."""
        return self.drafting.context_kv() if self.drafting.ready else None

    # ----- the context cache -------------------------------------------------------------------
    @torch.inference_mode()
    def _append(self, out: TargetOutput) -> None:
        """Project the target rows ``out`` (the next context positions) into the cache."""
        if out.layers is None:
            raise ValueError("a dflash draft reads target layers: build the Target with "
                             f"layer_ids={list(self.layer_ids)}")
        self.drafting.append(torch.cat(list(out.layers), dim=-1).to(self.device))  # (m, nH)

    # ----- protocol ----------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        self.drafting.reset(len(tokens) + RESERVE)
        self._append(target_out)  # the prompt's rows: positions 0 .. len(tokens) - 2

    def accept(self, path: list[int], new_tokens: list[int], target_out: TargetOutput) -> None:
        self._append(target_out)  # the previous pending token and the accepted drafts

    @torch.inference_mode()
    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        pending = len(ctx.tokens) - 1  # the anchor's position
        if not self.drafting.ready or pending != self.n_ctx:
            raise RuntimeError(f"DFlash state out of sync: the context cache holds {self.n_ctx} "
                               f"positions, the pending token is at {pending}")
        n = min(k, self.block_size - 1)
        hidden = self.drafting.block(int(ctx.tokens[-1]))  # (B, H)
        logits = self.drafter.compute_logits(hidden[1:n + 1]).float()  # (n, V); contiguous rows
        if ctx.sampling.greedy:
            return Proposal.chain(top1(logits).tolist())
        drafts, qs = [], []
        for row in logits:
            x, q = ctx.sampling.sample_with_q(row, ctx.generator)
            drafts.append(x)
            qs.append(q)
        return Proposal.chain(drafts, torch.stack(qs))
