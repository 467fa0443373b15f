"""EAGLE proposers: a chain, and the EAGLE-2 dynamic tree.

The head consumes pairs (feature ``f_t``, token ``x_{t+1}``) and predicts ``f_{t+1}``, whose logits
give the distribution of ``x_{t+2}``. Pairs with *true* target features (of committed tokens) are
kept in the head's KV cache; pairs with predicted features (drafted tokens) are only added while
drafting and cropped afterwards. After each verification the target's final hidden states (or the
fused layers) of the committed tokens become new true pairs.

Reduced-vocabulary heads draft in their own vocabulary; ids are mapped to target ids through
``head.to_target_ids`` (``d2t``) and draft distributions are scattered into the target vocabulary
(ids outside the draft vocabulary get ``q = 0``).
"""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.eval.decoding.eagle_step import EagleStep
from draftsmith.eval.decoding.kernels import kernels_in, pack, packed_linear
from draftsmith.eval.decoding.proposal import DecodeContext, Proposal
from draftsmith.eval.decoding.proposers import DraftVocabMixin, Proposer, head_rows
from draftsmith.eval.decoding.target_model import TargetOutput, new_cache
from draftsmith.eval.decoding.tree import DynamicTree
from draftsmith.heads.blocks import require_attached


class EagleProposer(DraftVocabMixin, Proposer):
    """EAGLE head as a proposer.

    Args:
        head: module with ``forward(features (B,T,kH), input_ids (B,T), past_key_values,
            position_ids, attention_mask (B,1,T,past+T) bool) -> (B,T,H)``, ``compute_logits`` and
            optionally ``reduced``/``d2t`` (reduced vocabulary), ``new_cache`` and
            ``cfg.fuse_layers``.
        vocab_size: the target's vocabulary size.
        tree: ``False`` drafts a chain sampled from the warped draft distribution (``q`` rows are
            returned); ``True`` builds the EAGLE-2 dynamic tree
            (:class:`~eval.decoding.tree.DynamicTree`): top-k choices when greedy, draws without
            replacement when sampling.
        topk: branching factor of the dynamic tree (children per expanded node and nodes expanded
            per depth).
        total_tokens: nodes kept after the final rerank of the dynamic tree.
        vocab_ids: target ids to draft over (sorted; :func:`heads.vocab.frequent_ids`): only
            these rows of the LM head are computed (a head with a reduced vocabulary: its own
            ids among them) and ``q`` is zero elsewhere (lossless, as any ``q``). None: the
            head's own vocabulary.
        tree_draw: ``"sample"`` or ``"topk"``: how a sampled decode's tree picks children
            (:data:`~eval.decoding.tree.TREE_DRAWS`).
        fused: run the head's layer as plain tensor ops (:class:`~eval.decoding.eagle_step.
            EagleStep`, the same function from the same weights) rather than through its
            transformers modules; heads it cannot read (not an ``EagleHead``) use the modules.
    """

    name = "eagle"

    def __init__(self, head: nn.Module, vocab_size: int, tree: bool = False, topk: int = 8,
                 total_tokens: int = 60, vocab_ids: torch.Tensor | None = None,
                 tree_draw: str = "sample", fused: bool = True) -> None:
        if topk < 1 or total_tokens < 1:
            raise ValueError(f"topk and total_tokens must be >= 1, got {topk}, {total_tokens}")
        require_attached(head, "EAGLE head")
        self.head = head
        self.vocab_size = vocab_size
        self.tree = tree
        self.tree_draw = tree_draw
        self.topk = topk
        self.total_tokens = total_tokens
        cfg = getattr(head, "cfg", None)
        fuse = getattr(cfg, "fuse_layers", None)
        self.layer_ids = tuple(fuse) if fuse else ()
        self.device = next(head.parameters()).device
        # reduced-vocabulary heads carry d2t (draft id -> target id); others draft in target ids
        d2t = getattr(head, "d2t", None) if getattr(head, "reduced", False) else None
        self.d2t = None if d2t is None else d2t.long().to(self.device)
        self._sub_head: torch.Tensor | None = None
        if vocab_ids is not None:
            ids = torch.as_tensor(vocab_ids).long().to(self.device)
            if d2t is not None:  # a subset of the head's own draft vocabulary: its rows among ids
                rows = torch.isin(self.d2t, ids).nonzero().flatten()
                self._sub_head = head_rows(head.lm_head, rows, int(d2t.numel()))
                self.d2t = self.d2t[rows]
            else:
                self._sub_head = head_rows(head.lm_head, ids, vocab_size)
                self.d2t = ids
            if kernels_in(head) == "packed":  # the rows packed as the head's linears are (an
                self._sub_head = pack(self._sub_head)  # int8 LM head's rows come dequantized)
        self.name = "eagle-tree" if tree else "eagle"
        self.step = EagleStep.of(head) if fused else None
        self.cache = None
        self.n_true = 0
        self._pending_feats: list[torch.Tensor] = []
        self._pending_tokens: list[int] = []

    def compile(self) -> None:
        """``torch.compile`` the head's forward and its LM-head call (dynamic shapes: tree depths
        and the cache grow between calls). On a 2-core CPU it did not pay (bench/rounds, rows
        ``torch.compile``), so decode.py's ``compile_draft`` is off by default. The compiled
        path is the modules' (the fused step is not compiled)."""
        self.step = None
        self.head.forward = torch.compile(self.head.forward, dynamic=True)
        self._logits = torch.compile(self._logits, dynamic=True)

    def _features(self, out: TargetOutput) -> torch.Tensor:
        """``(T, kH)`` features of the target output rows (final hidden, or fused layers)."""
        if not self.layer_ids:
            return out.hidden
        if out.layers is None:
            raise ValueError("this EAGLE head fuses target layers: build the Target with "
                             f"layer_ids={list(self.layer_ids)}")
        return torch.cat(list(out.layers), dim=-1)

    def _head(self, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The head's output ``(1, T, H)`` after pairs ``feats (1, T, .)``, ``ids (1, T)`` at
        ``pos (1, T)``, extending the cache; ``allowed (T, cached + T)`` bool, None: causal."""
        if self.step is not None:
            return self.step(feats, ids, self.cache, pos, allowed)
        mask = None if allowed is None else allowed.view(1, 1, *allowed.shape)
        return self.head(feats, ids, past_key_values=self.cache, position_ids=pos,
                         attention_mask=mask)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._sub_head is not None:
            feats = self.head.predicted_features(hidden)  # (the eagle3 layout's output norm)
            return packed_linear(feats, self._sub_head).float()
        return self.head.compute_logits(hidden).float()

    # ----- protocol --------------------------------------------------------------------------
    def reset(self, tokens: list[int], target_out: TargetOutput) -> None:
        self.cache = new_cache()  # preallocated (the head's layers are full-attention Llama)
        self.n_true = 0
        feats = self._features(target_out)
        self._pending_feats = [feats]
        self._pending_tokens = list(tokens[1:])

    def accept(self, path: list[int], new_tokens: list[int], target_out: TargetOutput) -> None:
        cached = int(self.cache.get_seq_length())
        if cached > self.n_true:
            self.cache.crop(self.n_true - cached)
        self._pending_feats.append(self._features(target_out))
        self._pending_tokens.extend(new_tokens)

    def _feed_true(self) -> torch.Tensor:
        """Feed the pending true pairs; returns the head output at the last one, ``(1, 1, H)``."""
        feats = torch.cat(self._pending_feats, dim=0).to(self.device).unsqueeze(0)  # (1, m, kH)
        ids = torch.tensor([self._pending_tokens], dtype=torch.long, device=self.device)  # (1, m)
        m = ids.shape[1]
        if feats.shape[1] != m:
            raise RuntimeError(f"EAGLE state out of sync: {feats.shape[1]} features, {m} tokens")
        pos = torch.arange(self.n_true, self.n_true + m, device=self.device).unsqueeze(0)
        out = self._head(feats, ids, pos)  # (1, m, H)
        self.n_true += m
        self._pending_feats, self._pending_tokens = [], []
        # a fresh (1, 1, H) view: the slice out[:, -1:] keeps the batch stride m * H, and torch's
        # CPU bf16 linear then takes a path ~40x slower for the LM head (90 ms instead of 2 ms)
        return out[0, -1].view(1, 1, -1)

    @torch.inference_mode()
    def propose(self, ctx: DecodeContext, k: int) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        last = self._feed_true()
        if self.tree:
            return self._propose_tree(last, k, ctx)
        return self._propose_chain(last, k, ctx)

    def _propose_chain(self, last: torch.Tensor, k: int, ctx: DecodeContext) -> Proposal:
        """A chain of ``k``, each draft fed back as a tensor: one host transfer at the end."""
        drafts: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            x_d, q_d = ctx.sampling.pick(self._logits(last)[0], ctx.generator)  # (1,)
            x = self._to_target(x_d)
            drafts.append(x)
            if q_d is not None:
                qs.append(self._scatter_q(q_d)[0])
            if i < k - 1:
                pos = torch.tensor([[self.n_true + i]], device=self.device)
                last = self._head(last, x.view(1, 1), pos)
        return Proposal.chain(torch.cat(drafts).tolist(), torch.stack(qs) if qs else None)

    def _propose_tree(self, root_hidden: torch.Tensor, depth: int,
                      ctx: DecodeContext) -> Proposal:
        """EAGLE-2 (:class:`~eval.decoding.tree.DynamicTree`): an expanded node is fed as (its
        parent's head output, its token), so its children come from the head's prediction after
        it."""
        tree = DynamicTree(self.topk, self._to_target, ctx.sampling, ctx.generator,
                           self._scatter_q, self.tree_draw)
        root = root_hidden[0, 0]  # (H,)
        outs: list[torch.Tensor] = []  # the head's outputs of the fed nodes, in feeding order

        def forward(nodes: list[int], mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            parents = [tree.parents[j] for j in nodes]
            if all(p < 0 for p in parents):  # children of the root: its output for each
                feats = root.expand(len(nodes), -1)
            else:  # (a depth's nodes all have fed parents)
                rows = torch.tensor([tree.fed_row[p] for p in parents], device=self.device)
                feats = torch.cat(outs).index_select(0, rows)
            ids = torch.tensor([[tree.tokens[j] for j in nodes]], dtype=torch.long,
                               device=self.device)
            out = self._head(feats.unsqueeze(0), ids, pos.view(1, -1).to(self.device),
                             mask.to(self.device))  # (1, n, H)
            outs.append(out[0])
            return self._logits(out)[0]  # (n, Vd), one LM-head call for all rows

        tree.grow(self._logits(root_hidden)[0, 0], depth, self.n_true, forward)
        cached = int(self.cache.get_seq_length())
        if cached > self.n_true:
            self.cache.crop(self.n_true - cached)
        return tree.proposal(self.total_tokens)
