"""One proposer interface for every draft family.

A proposer drafts tokens after the committed sequence; the decoder verifies them against the
target. The protocol (all token ids are *target* vocabulary ids):

1. ``reset(tokens, target_out)`` once per request, after the target's prefill: ``tokens`` is the
   prompt plus the first generated token, ``target_out`` the prefill output (one row per prompt
   token, i.e. per ``tokens[:-1]``).
2. ``propose(ctx, k) -> Proposal``: draft up to ``k`` tokens deep after ``ctx.tokens`` (whose last
   token is the *pending* one: sampled but not yet fed to the target).
3. ``accept(path, new_tokens, target_out)``: ``path`` lists the accepted proposal node indices,
   ``new_tokens`` the committed tokens (the accepted drafts plus the next token) and ``target_out``
   the target's rows for the previous pending token and the accepted drafts
   (``len(new_tokens)`` rows; row ``i`` predicted ``new_tokens[i]``). The proposer rolls its own
   state (KV cache, features) back to the committed sequence.

This file holds the interface and the families that need no target features (plain, prompt
lookup, draft LM); EAGLE lives in :mod:`eval.decoding.proposers_eagle`, Medusa in
:mod:`eval.decoding.proposers_medusa`, what passes between decoder and proposer (``Sampling``,
``DecodeContext``, ``Proposal``) in :mod:`eval.decoding.proposal` and the dynamic tree both EAGLE
and the draft LM draft with in :mod:`eval.decoding.tree`. A batch of prompts runs a proposer's
draft through the batched drafter its family names (:func:`eval.decoding.batch_drafters.
batch_drafter_for`). A family's proposer is built by :meth:`Proposer.for_draft`.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from draftsmith.data.attention import native_gqa
from draftsmith.eval.decoding.kernels import PackedLinear, pack, packed_linear
from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.target_model import TargetOutput, cache_kwarg, layer_masks, new_cache
from draftsmith.eval.decoding.tree import DynamicTree
from draftsmith.heads.quantize import Int4Linear, Int8Linear


class Proposer:
    """Base class: the plain decoder (never drafts). Subclasses override the three calls.

    Class attributes:
        name: short name of the proposer and its mode (``lm-tree``), used in reports.
        lossless: whether the decoder's output distribution equals the target's with this proposer.
        layer_ids: target hidden-state layers the proposer needs (besides the final-norm output).
        tree: whether it drafts trees (several candidates per depth) rather than chains.
    """

    name = "plain"
    lossless = True
    layer_ids: tuple[int, ...] = ()
    tree = False

    @classmethod
    def for_draft(cls, module: nn.Module, head_config: Any, vocab_size: int, settings: Any,
                  vocab_ids: torch.Tensor | None = None) -> Proposer:
        """The proposer drafting with a family's trained ``module`` (``DraftFamily.proposer``
        names the class; ``eval.draft.build_proposer`` calls this).

        Args:
            module: the draft module, on its device and dtype, in eval mode.
            head_config: the family's head config.
            vocab_size: the target's vocabulary size.
            settings: how it drafts in this run (``eval.draft.DraftSettings``: ``k``, ``tree``,
                the tree's shape, the family's own ``options``).
            vocab_ids: sorted target ids to draft over (None: the whole vocabulary).
        """
        # plain decoding, prompt lookup and suffix matches draft from the text alone: no draft
        # family names them, and a module handed to them is a wiring error, said as such
        raise TypeError(f"{cls.__name__} drafts with no trained module: a draft family's "
                        "proposer must be one built from its module (EagleProposer, "
                        "DraftLMProposer, MedusaProposer, DFlashProposer)")

    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        """Start a request (see module docstring)."""

    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        """Draft up to ``k`` tokens deep after ``ctx.tokens``."""
        return Proposal.empty()

    def accept(self, path: list[int], new_tokens: list[int],
               target_out: TargetOutput) -> None:
        """Roll the proposer's state forward to the committed sequence."""

    def shadow_chain(self, ctx: DecodeContext, k: int) -> Proposal:
        """A chain drafted beside a plain step (eval/decoding/shadow.py): what :meth:`propose`
        drafts; :meth:`accept` then sees it rejected, as after any rejected round."""
        return self.propose(ctx, k)

    # whether the trained draft is paused (:meth:`pause`)
    paused = False

    def pause(self, paused: bool) -> bool:
        """Pause (or resume) the trained draft between rounds, where the proposer can still
        draft without it; returns whether it can (a hybrid's suffix chains). Here it cannot: the
        decoder decodes plainly instead (K = 0)."""
        return False

    def outcome(self, proposal: Proposal, path: list[int],
                new_tokens: list[int]) -> tuple[int, int] | None:
        """The round's chain of the trained draft: (drafts, accepted), None where it drafted no
        chain this round. Called after verification, before :meth:`accept`."""
        return (len(proposal), len(path)) if len(proposal) and proposal.is_chain else None


class PlainProposer(Proposer):
    """K = 0: plain autoregressive decoding through the same loop."""


class PromptLookupProposer(Proposer):
    """Drafts by n-gram matching in the context: find the latest earlier occurrence of the last
    ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) and propose what followed it.
    Candidates are deterministic, so their ``q`` is a point mass (lossless at any temperature)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        seq = ctx.tokens
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            pattern = seq[-n:]
            for start in range(n_seq - n - 1, -1, -1):  # latest match first, not the suffix itself
                if seq[start:start + n] == pattern:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return Proposal.chain(follow)
        return Proposal.empty()


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Cut or ``-inf``-pad the last dim of ``logits`` to the target's vocabulary size."""
    v = logits.shape[-1]
    if v == vocab_size:
        return logits
    if v > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def head_rows(head: nn.Module, vocab_ids: torch.Tensor, vocab_size: int,
              config: object = None) -> torch.Tensor:
    """Rows ``vocab_ids`` of an LM head, ``(N, H)``: the logits of those ids alone.

    Raises:
        ValueError: the ids are not sorted unique target ids, or the logits are not a plain
            bias-free linear map of the hidden state (``head`` with a bias, or ``config`` with a
            logit scale or soft-capping), where a row subset would change them.
    """
    ids = vocab_ids.flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"vocab_ids must be non-empty target ids in 0..{vocab_size - 1}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("vocab_ids must be sorted ascending without repeats")
    scaled = [a for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")
              if getattr(config, a, None) not in (None, 1, 1.0)]
    # an int8 / int4 LM head (heads.quantize.Int8Linear / Int4Linear, bias-free) gives its rows
    # dequantized: the same logits up to rounding, in the decoding dtype (a prepacked one, its
    # plain rows)
    if (not isinstance(head, (nn.Linear, PackedLinear, Int8Linear, Int4Linear))
            or head.bias is not None or scaled):
        raise ValueError(f"the logits are not a bias-free linear map of the hidden state "
                         f"({scaled or type(head).__name__}): a draft vocabulary cannot be cut "
                         "from this LM head; use draft_vocab=full")
    return head.weight.detach()[ids.to(head.weight.device)].contiguous()


class DraftVocabMixin:
    """For drafters whose ids may differ from the target's: ``d2t`` maps drafter id -> target id
    (a draft vocabulary: sorted target ids; None = the drafter uses target ids). Drafts go back
    through :meth:`_to_target`, sampled ``q`` rows through :meth:`_scatter_q` (zero outside)."""

    @classmethod
    def for_draft(cls, module: nn.Module, head_config: Any, vocab_size: int, settings: Any,
                  vocab_ids: torch.Tensor | None) -> Proposer:
        """The proposer drafting with ``module`` as ``settings`` (``eval.draft.DraftSettings``)
        say: a chain, or a dynamic tree of ``tree_size`` nodes from the top ``tree_topk``."""
        return cls(module, vocab_size, tree=settings.tree, topk=settings.tree_topk,
                   total_tokens=settings.tree_size, vocab_ids=vocab_ids,
                   tree_draw=settings.tree_draw)

    d2t: torch.Tensor | None = None
    vocab_size: int

    @property
    def draft_vocab(self) -> int | None:
        """Ids drafted over (None: the whole vocabulary)."""
        return None if self.d2t is None else int(self.d2t.numel())

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else self.d2t[ids]

    def _scatter_q(self, q: torch.Tensor) -> torch.Tensor:
        """Drafter-vocabulary probabilities ``(..., Vd)`` -> the target vocabulary ``(..., V)``."""
        if self.d2t is None and q.shape[-1] == self.vocab_size:
            return q
        ids = self.d2t if self.d2t is not None else torch.arange(q.shape[-1])
        return q.new_zeros(*q.shape[:-1], self.vocab_size).index_add(-1, ids.to(q.device), q)


class DraftLMProposer(DraftVocabMixin, Proposer):
    """A small causal LM drafting a chain, or an EAGLE-2 dynamic tree, with its own KV cache.

    The draft's cache holds a prefix of the committed sequence; ``propose`` feeds whatever is
    missing (the prompt on the first call, then the last accepted draft and the new pending token),
    then either samples ``k`` tokens from the warped draft distribution (chain) or builds a dynamic
    tree ``k`` deep with ``topk`` children per expanded node (:class:`DynamicTree`: the top-k
    when greedy, draws without replacement when sampling), and ``accept`` crops the cache back to
    the committed prefix.

    Args:
        model: a causal LM sharing the target's vocabulary (``logits`` of width >= ``vocab_size``).
        vocab_size: the target's vocabulary size.
        tree: draft a dynamic tree instead of a chain.
        topk: tree branching (children per expanded node and nodes expanded per depth).
        total_tokens: tree nodes kept after the final rerank.
        vocab_ids: target ids to draft over (sorted; :func:`heads.vocab.frequent_ids`): only
            these rows of the LM head are computed, and ``q`` is zero elsewhere (lossless, as any
            ``q``). None drafts over the whole vocabulary.
        tree_draw: ``"sample"`` or ``"topk"``: how a sampled decode's tree picks children
            (:data:`eval.decoding.tree.TREE_DRAWS`).
    """

    name = "lm"

    def __init__(self, model: nn.Module, vocab_size: int, tree: bool = False, topk: int = 8,
                 total_tokens: int = 60, vocab_ids: torch.Tensor | None = None,
                 tree_draw: str = "sample") -> None:
        if topk < 1 or total_tokens < 1:
            raise ValueError(f"topk and total_tokens must be >= 1, got {topk}, {total_tokens}")
        self.tree_draw = tree_draw
        self.model = model
        self.vocab_size = vocab_size
        self.tree, self.topk, self.total_tokens = tree, topk, total_tokens
        self.name = "lm-tree" if tree else "lm"
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self._base: int | None = None  # committed length when the last proposal was drafted
        self._fed_drafts = 0
        self._cache_kw = cache_kwarg(model)
        # only the last position's logits are used: skip the LM head elsewhere (the first call
        # feeds the whole prompt) where the model's forward supports it
        self._keep = ({"logits_to_keep": 1} if "logits_to_keep" in
                      inspect.signature(model.forward).parameters else {})
        if vocab_ids is not None:
            self.d2t = torch.as_tensor(vocab_ids).long().to(self.device)
            self._sub_head = head_rows(model.get_output_embeddings(), self.d2t, vocab_size,
                                       model.config)
            if isinstance(model.get_output_embeddings(), PackedLinear):
                self._sub_head = pack(self._sub_head)  # the rows packed as the model's are
            self._decoder = model.get_decoder()
            self._decoder_cache_kw = cache_kwarg(self._decoder)

    def _cached(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def _forward(self, ids: Sequence[int], last_only: bool = False, **kwargs) -> torch.Tensor:
        """Feed ``ids`` after the cache; ``(T', V')`` logits over the drafted ids (the target
        vocabulary, or ``d2t``), ``T' = 1`` when ``last_only``."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # (1, T)
        if kwargs.get("attention_mask") is not None:  # a tree block: windows for windowed layers
            kwargs["attention_mask"] = layer_masks(self.model.config, kwargs["attention_mask"],
                                                   kwargs.get("position_ids"), self._cached(),
                                                   self.model.dtype)
        with native_gqa(self.device.type == "cpu" and x.shape[1] > 1):
            if self.d2t is None:
                out = self.model(input_ids=x, **{self._cache_kw: self.cache}, use_cache=True,
                                 **(self._keep if last_only else {}), **kwargs)
                return fit_vocab(out.logits[0].float(), self.vocab_size)
            h = self._decoder(input_ids=x, **{self._decoder_cache_kw: self.cache}, use_cache=True,
                              **kwargs).last_hidden_state[0]  # (T, H)
        if last_only:
            h = h[-1:]
        return packed_linear(h, self._sub_head).float()

    def _step(self, ids: Sequence[int]) -> torch.Tensor:
        return self._forward(ids, last_only=True)[-1]  # (V',) after the last token

    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        self.cache = new_cache()
        self._base = None
        self._fed_drafts = 0

    @torch.inference_mode()
    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        seq = ctx.tokens
        logits = self._step(seq[self._cached():])
        self._base = len(seq)
        if self.tree:
            return self._propose_tree(logits, k, ctx)
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            if ctx.sampling.greedy:  # point masses: no q
                x = ctx.sampling.token(logits, ctx.generator)
            else:
                x, q_i = ctx.sampling.sample_with_q(logits, ctx.generator)
                qs.append(self._scatter_q(q_i))
            x = int(self._to_target(torch.tensor(x, device=self.device)))
            drafts.append(x)
            if i < k - 1:
                logits = self._step([x])
        self._fed_drafts = k - 1
        return Proposal.chain(drafts, None if ctx.sampling.greedy else torch.stack(qs))

    def _propose_tree(self, root_logits: torch.Tensor, depth: int,
                      ctx: DecodeContext) -> Proposal:
        """EAGLE-2 dynamic tree (:class:`DynamicTree`) from the draft LM: each depth feeds the
        expanded nodes' tokens in one forward with a tree mask; the cache is cropped back to the
        committed prefix after."""
        tree = DynamicTree(self.topk, self._to_target, ctx.sampling, ctx.generator,
                           self._scatter_q, self.tree_draw)

        def forward(nodes: list[int], mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return self._forward([tree.tokens[j] for j in nodes],
                                 position_ids=pos.view(1, -1).to(self.device),
                                 attention_mask=mask.view(1, 1, *mask.shape).to(self.device))

        tree.grow(root_logits, depth, self._base, forward)
        self._fed_drafts = 0  # tree nodes are dropped below; accepted ones are re-fed next step
        cached = self._cached()
        if cached > self._base:
            self.cache.crop(self._base - cached)
        return tree.proposal(self.total_tokens)

    def accept(self, path: list[int], new_tokens: list[int], target_out: TargetOutput) -> None:
        if self._base is None:  # plain step: the cache is still a prefix of the sequence
            return
        keep = self._base + min(len(path), self._fed_drafts)
        cached = self._cached()
        if keep < cached:
            self.cache.crop(keep - cached)
        self._base = None
