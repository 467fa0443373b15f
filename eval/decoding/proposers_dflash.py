"""The DFlash proposer: one drafter forward per step drafts a chain of up to B-1 tokens.

The drafter (``heads/dflash.py``) keeps a per-layer key/value cache of the *context*: the fused
target layers of the committed tokens, one entry per position, projected once when the target
has read them (after the prefill, and after each verification for the pending token and the
accepted drafts). A step feeds the block ``[pending token, MASK x (B-1)]`` at positions
``P .. P+B-1`` (P = the pending token's position) over that cache; the block's own keys and
values are computed inside the forward and never kept. Slot k's logits give the draft at
position P+k.

Greedy decoding takes each slot's argmax (point masses, no ``q``). Sampling draws each slot from
its own warped distribution, which is that draft's ``q``: the slots are drawn independently of
one another given the context, a valid proposal whatever the earlier drafts were, so the
verifier's rejection sampling stays lossless.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.target_model import TargetOutput
from draftsmith.eval.decoding.verify import top1


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
        if int(drafter.vocab_size) != vocab_size:
            raise ValueError(f"the drafter drafts over {drafter.vocab_size} ids, the target's "
                             f"vocabulary has {vocab_size}: it was built for another target")
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.layer_ids = tuple(drafter.cfg.fuse_layers)
        self.block_size = int(drafter.block_size)
        self.mask_token_id = int(drafter.cfg.mask_token_id)
        self.device = next(drafter.parameters()).device
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.n_ctx = 0  # context positions in the cache: those of the committed tokens

    # ----- the context cache -------------------------------------------------------------------
    @torch.inference_mode()
    def _append(self, out: TargetOutput) -> None:
        """Project the target rows ``out`` (the next context positions) into the cache."""
        if out.layers is None:
            raise ValueError("a dflash draft reads target layers: build the Target with "
                             f"layer_ids={list(self.layer_ids)}")
        feats = torch.cat(list(out.layers), dim=-1).to(self.device).unsqueeze(0)  # (1, m, nH)
        m = feats.shape[1]
        pos = torch.arange(self.n_ctx, self.n_ctx + m, device=self.device).unsqueeze(0)
        new = self.drafter.context_kv(self.drafter.context(feats), pos)
        if self.cache is None:
            self.cache = new
        else:
            self.cache = [(torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2))
                          for (k, v), (k2, v2) in zip(self.cache, new)]
        self.n_ctx += m

    # ----- protocol ----------------------------------------------------------------------------
    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        self.cache, self.n_ctx = None, 0
        self._append(target_out)  # the prompt's rows: positions 0 .. len(tokens) - 2

    def accept(self, path: list[int], new_tokens: list[int], target_out: TargetOutput) -> None:
        self._append(target_out)  # the previous pending token and the accepted drafts

    @torch.inference_mode()
    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        pending = len(ctx.tokens) - 1  # the anchor's position
        if self.cache is None or pending != self.n_ctx:
            raise RuntimeError(f"DFlash state out of sync: the context cache holds {self.n_ctx} "
                               f"positions, the pending token is at {pending}")
        n = min(k, self.block_size - 1)
        anchor = torch.tensor([[ctx.tokens[-1]]], dtype=torch.long, device=self.device)
        ids = self.drafter.block_ids(anchor)  # (1, B)
        pos = torch.arange(pending, pending + self.block_size, device=self.device).unsqueeze(0)
        hidden = self.drafter.block_hidden(ids, pos, self.cache)  # (1, B, H)
        # a fresh (n, H) copy of the slots' rows before the LM head (a strided view takes
        # torch's slow CPU bf16 path, as in the EAGLE proposer)
        logits = self.drafter.compute_logits(hidden[0, 1:n + 1].contiguous()).float()  # (n, V)
        if ctx.sampling.greedy:
            return Proposal.chain(top1(logits).tolist())
        drafts, qs = [], []
        for row in logits:
            x, q = ctx.sampling.sample_with_q(row, ctx.generator)
            drafts.append(x)
            qs.append(q)
        return Proposal.chain(drafts, torch.stack(qs))
