"""Batched drafters for :mod:`eval.decoding.batch`: the draft LM's, the EAGLE head's and Medusa
heads' chains for every row of a batch at once, and the EAGLE head's dynamic trees (one tree per
row).

Each is built from a batch-one proposer (its weights and draft vocabulary) and keeps its own
:class:`~eval.decoding.slots.SlotCache` with each row's committed tokens; drafted slots are
dropped after every verification, and what each row committed is fed at its next proposal.
:func:`batch_drafter_for` finds the drafter of a proposer's family (``DraftFamily.batch_drafter``;
the proposers do not know these), and for a suffix proposer the batched suffix chains
(:mod:`eval.decoding.batch_suffix`) around its inner proposer's drafter.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from draftsmith.data.attention import native_gqa
from draftsmith.eval.decoding.batch_suffix import BatchSuffix
from draftsmith.eval.decoding.kernels import packed_linear
from draftsmith.eval.decoding.proposal import Proposal, Sampling
from draftsmith.eval.decoding.proposers import (
    DraftLMProposer,
    PlainProposer,
    Proposer,
    fit_vocab,
)
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.proposers_medusa import MedusaProposer
from draftsmith.eval.decoding.proposers_suffix import SuffixProposer
from draftsmith.eval.decoding.slots import SlotCache, last_valid, pad_rows
from draftsmith.eval.decoding.target_model import cache_kwarg
from draftsmith.eval.decoding.tree import DynamicTree
from draftsmith.heads.family import FAMILIES
from draftsmith.heads.family_base import DraftFamily, load_object


class BatchDrafter(ABC):
    """A batched chain drafter built from a batch-one proposer (its weights and draft
    vocabulary); subclasses hold the per-row state.

    ``start`` once per batch, ``propose_chains`` a chain of up to ``ks[b]`` per row (``propose``:
    ``k`` for every row), ``commit`` the accepted lengths, ``select`` the rows that stay.
    (:class:`~eval.decoding.batch_suffix.BatchSuffix` keeps the same calls.)
    """

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.device = proposer.device
        self.vocab_size = proposer.vocab_size

    def _pick(self, logits: Tensor, sampling: Sampling,
              generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """``logits (B, Vd)`` -> drafted target ids ``(B,)`` and ``q (B, V)`` (None: greedy,
        point masses)."""
        x, q = sampling.pick(logits, generator)
        return self.proposer._to_target(x), None if q is None else self.proposer._scatter_q(q)

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """A chain of ``k`` per row: drafts ``(B, k)`` (target ids) and their ``q``
        ``(B, k, V)`` (None when greedy)."""
        logits = self._first()
        self.draft_start = self.slots.width
        drafts, qs = [], []
        for i in range(k):
            x, q = self._pick(logits, sampling, generator)
            drafts.append(x)
            qs.append(q)
            if i < k - 1:
                logits = self._next(x)
        return torch.stack(drafts, 1), None if sampling.greedy else torch.stack(qs, 1)

    def propose_chains(self, ks: Tensor, sampling: Sampling, generator: torch.Generator | None,
                       budgets: list[int] | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """Chains of up to ``ks[b]`` drafts per row (0: none): drafts ``(B, K)``, their ``q``
        ``(B, K, V)`` (None: point masses, greedy or suffix tokens) and the drafts each row
        really has ``(B,)`` (the rest of its row is padding). A model drafts ``K = max(ks)``
        for every row and each row keeps its first ``ks[b]``; ``budgets`` (the tokens each row
        may still add) matter to suffix chains only
        (:meth:`~eval.decoding.batch_suffix.BatchSuffix.propose_chains`)."""
        drafts, q = self.propose(int(ks.max()), sampling, generator)
        return drafts, q, ks

    @abstractmethod
    def _first(self) -> Tensor:
        """Feed what each row has waiting; the logits ``(B, Vd)`` of its first draft."""

    @abstractmethod
    def _next(self, x: Tensor) -> Tensor:
        """Feed the drafts ``x (B,)``; the logits ``(B, Vd)`` of the next ones."""

    def _one(self, x: Tensor) -> Tensor:
        """The valid mask ``(B, 1)`` of a one-token block."""
        return torch.ones(len(x), 1, dtype=torch.bool, device=self.device)


class BatchDraftLM(BatchDrafter):
    """The draft LM of a :class:`~eval.decoding.proposers.DraftLMProposer`, batched: its cache
    holds each row's committed tokens but the last few (``missing``), fed at the next proposal.
    """

    def __init__(self, proposer: DraftLMProposer) -> None:
        super().__init__(proposer)
        self.model = proposer.model
        self.decoder = self.model.get_decoder()
        self._cache_kw = cache_kwarg(self.decoder)
        self.head = (proposer._sub_head if proposer.d2t is not None
                     else self.model.get_output_embeddings().weight)

    def start(self, tokens: list[list[int]], features: Tensor, valid: Tensor) -> None:
        self.slots = SlotCache(self.model.config, len(tokens), self.device)
        self.missing = [list(t) for t in tokens]

    def _feed(self, ids: Tensor, valid: Tensor) -> Tensor:
        mask, pos = self.slots.open(valid)
        with native_gqa(self.device.type == "cpu" and ids.shape[1] > 1):
            h = self.decoder(input_ids=ids, **{self._cache_kw: self.slots.cache}, use_cache=True,
                             position_ids=pos, attention_mask=mask).last_hidden_state
        logits = packed_linear(last_valid(h, valid), self.head).float()  # (B, Vd)
        return logits if self.proposer.d2t is not None else fit_vocab(logits, self.vocab_size)

    def _first(self) -> Tensor:
        ids, valid = pad_rows(self.missing, self.device)
        self.missing = [[] for _ in self.missing]
        return self._feed(ids, valid)

    def _next(self, x: Tensor) -> Tensor:
        return self._feed(x.view(-1, 1), self._one(x))

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor,
               own: Tensor | None = None) -> None:
        """Row ``b`` accepted the first ``n[b]`` of the verified ``drafts[b]``, then ``nxt[b]``;
        this drafter drafted ``k`` per row (0: it did not run). ``own (B,)`` bool: the rows whose
        verified drafts were its own (None: all); only those keep the drafted slots of their
        accepted drafts, the others (a hybrid's suffix rows) keep none and feed every accepted
        draft at the next proposal."""
        fed = n.clamp_max(max(k - 1, 0))  # drafts 1..k-1 were fed while drafting
        if own is not None:
            fed = fed * own.to(fed.device)
        if k > 0:
            self.slots.keep(self.draft_start, fed)
        for b, miss in enumerate(self.missing):  # emptied by the proposal that drafted
            miss += drafts[b, int(fed[b]):int(n[b])].tolist() + [int(nxt[b])]

    def select(self, rows: Tensor) -> None:
        self.slots.select(rows)
        self.missing = [self.missing[i] for i in rows.tolist()]


class BatchEagle(BatchDrafter):
    """The head of an :class:`~eval.decoding.proposers_eagle.EagleProposer`, batched: its cache
    holds the (true feature, next token) pairs of each row's committed tokens; pairs from the last
    verification wait in ``pending`` until the next proposal feeds them. The head runs as the
    proposer runs it: its fused step (``proposer.step``, :class:`~eval.decoding.eagle_step.
    EagleStep`) where it has one, else its modules."""

    def __init__(self, proposer: EagleProposer) -> None:
        super().__init__(proposer)
        self.head = proposer.head
        self.layer_ids = proposer.layer_ids

    def start(self, tokens: list[list[int]], features: Tensor, valid: Tensor) -> None:
        """``features (B, T, kH)``: the target's prefill features of each row's prompt (its
        first ``len(tokens[b]) - 1`` valid positions)."""
        self.slots = SlotCache(self.head.config, len(tokens), self.device)
        # per row: the feature blocks (concatenated once, when fed) and tokens of its pairs
        self.pending = [([features[b, :len(t) - 1]], list(t[1:])) for b, t in enumerate(tokens)]

    def _run(self, feats: Tensor, ids: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        """The head's output ``(B, T, H)`` after the block ``feats (B, T, .)``, ``ids (B, T)``
        with the slot cache's mask ``(B, 1, T, width)`` (bool) and positions ``pos (B, T)``."""
        step = self.proposer.step  # read per call: compile() turns it off
        if step is not None:
            return step(feats, ids, self.slots.cache, pos, mask[:, 0])
        return self.head(feats, ids, past_key_values=self.slots.cache, position_ids=pos,
                         attention_mask=mask)

    def _feed(self, feats: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
        mask, pos = self.slots.open(valid)
        return self._run(feats, ids, mask, pos)

    def _first(self) -> Tensor:
        ids, valid = pad_rows([tok for _, tok in self.pending], self.device)
        blocks = [torch.cat(f) for f, _ in self.pending]
        feats = torch.zeros(*ids.shape, blocks[0].shape[-1], dtype=blocks[0].dtype,
                            device=self.device)
        for b, f in enumerate(blocks):
            feats[b, :f.shape[0]] = f.to(self.device)
        self.pending = [([f[:0]], []) for f in blocks]
        self._last = last_valid(self._feed(feats, ids, valid), valid).unsqueeze(1)  # (B, 1, H)
        return self._logits()

    def _next(self, x: Tensor) -> Tensor:
        self._last = self._feed(self._last, x.view(-1, 1), self._one(x))
        return self._logits()

    def _logits(self) -> Tensor:
        return self.proposer._logits(self._last.contiguous())[:, -1]

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor,
               own: Tensor | None = None) -> None:
        """As :meth:`BatchDraftLM.commit`; ``features (B, K + 1, kH)``: the target's features of
        the verified block. Drafted slots are never kept, so ``own`` changes nothing: every row
        feeds the verified drafts it accepted (its own or a hybrid's suffix tokens)."""
        self.commit_rows(k > 0, [list(range(int(m) + 1)) for m in n],
                         [drafts[b, :int(m)].tolist() + [int(nxt[b])] for b, m in enumerate(n)],
                         features)

    def commit_rows(self, drafted: bool, rows: list[list[int]], tokens: list[list[int]],
                    features: Tensor) -> None:
        """Row ``b`` committed the block positions ``rows[b]`` (its pending token and accepted
        drafts, whose target features ``features (B, T, kH)`` become true pairs), followed by
        ``tokens[b]`` (the accepted drafts and the next token)."""
        if drafted:  # drafted pairs carry predicted features: never kept
            self.slots.keep(self.draft_start, torch.zeros(len(rows), dtype=torch.long,
                                                          device=self.device))
        for b, (f, tok) in enumerate(self.pending):
            f.append(features[b, rows[b]].to(f[0].dtype))
            tok += tokens[b]

    @torch.inference_mode()
    def propose_tree(self, depths: list[int], sampling: Sampling,
                     generator: torch.Generator | None) -> list[Proposal]:
        """An EAGLE-2 dynamic tree of depth ``depths[b]`` per row, built as batch one builds it
        (:class:`~eval.decoding.tree.DynamicTree`, ``EagleProposer._propose_tree``): each further
        depth feeds every row's best frontier nodes in one ``(B, topk)`` block, a node seeing its
        row's committed pairs, its fed ancestors and itself; a row of a lesser depth proposes
        from its tree's nodes down to that depth."""
        p = self.proposer
        depth = max(depths)
        logits = self._first()
        self.draft_start = self.slots.width
        root = self._last[:, 0]  # (B, H)
        trees = [DynamicTree(p.topk, p._to_target, sampling, generator, p._scatter_q,
                             p.tree_draw) for _ in range(len(root))]
        frontier = [t.add_children(-1, logits[b]) for b, t in enumerate(trees)]
        hidden_of: list[dict[int, Tensor]] = [{} for _ in trees]
        slot_of: list[dict[int, int]] = [{} for _ in trees]  # node -> slot after draft_start
        fed = 0
        for _ in range(2, depth + 1):
            expand = [t.expand(f) for t, f in zip(trees, frontier)]
            n = max(len(e) for e in expand)
            ids = torch.zeros(len(trees), n, dtype=torch.long)
            valid = torch.zeros(len(trees), n, dtype=torch.bool)
            offset = torch.zeros(len(trees), n, dtype=torch.long)
            tail = torch.zeros(len(trees), n, fed + n, dtype=torch.bool)
            tail[:, :, fed:] = torch.eye(n, dtype=torch.bool)
            feats = root.new_zeros(len(trees), n, root.shape[-1])
            for b, (t, nodes) in enumerate(zip(trees, expand)):
                for i, j in enumerate(nodes):
                    par = t.parents[j]
                    feats[b, i] = root[b] if par < 0 else hidden_of[b][par]
                    ids[b, i], valid[b, i], offset[b, i] = t.tokens[j], True, t.depths[j] - 1
                    while par >= 0:
                        tail[b, i, slot_of[b][par]] = True
                        par = t.parents[par]
                    slot_of[b][j] = fed + i
            mask, pos = self.slots.open_tree(valid.to(self.device), tail.to(self.device),
                                             offset.to(self.device), self.draft_start)
            out = self._run(feats, ids.to(self.device), mask, pos)  # (B, n, H)
            step_logits = self.proposer._logits(out)  # (B, n, Vd)
            fed += n
            frontier = []
            for b, (t, nodes) in enumerate(zip(trees, expand)):
                frontier.append([])
                for i, j in enumerate(nodes):
                    hidden_of[b][j] = out[b, i]
                    frontier[-1].extend(t.add_children(j, step_logits[b, i]))
        return [t.proposal(p.total_tokens, d) if d > 0 else Proposal.empty()
                for t, d in zip(trees, depths)]

    def select(self, rows: Tensor) -> None:
        self.slots.select(rows)
        self.pending = [self.pending[i] for i in rows.tolist()]


class BatchMedusa:
    """The heads of a :class:`~eval.decoding.proposers_medusa.MedusaProposer`, batched, as
    chains: head ``i`` applied to the target's final hidden state at each row's last committed
    position drafts that row's token ``i + 1`` places after its pending one, the top candidate
    of each head as batch one's chain takes it (deterministic: point masses at any temperature).
    Nothing to cache but that hidden state per row; a chain is at most :attr:`max_k` long."""

    def __init__(self, proposer: MedusaProposer) -> None:
        self.proposer = proposer
        self.heads = proposer.heads
        self.vocab_size = proposer.vocab_size
        self.max_k = int(self.heads.cfg.num_heads)

    def start(self, tokens: list[list[int]], features: Tensor, valid: Tensor) -> None:
        """``features (B, T, H)``: the target's final hidden states of the prefill."""
        self.hidden = last_valid(features, valid)  # (B, H)

    @torch.inference_mode()
    def propose(self, k: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[Tensor, None]:
        """``k`` (at most :attr:`max_k`) drafts per row ``(B, k)``; no ``q`` (point masses)."""
        if k > self.max_k:
            raise ValueError(f"Medusa heads draft at most {self.max_k} tokens, asked for {k}")
        logits = self.heads(self.hidden.unsqueeze(1))[:, 0, :k].float()  # (B, k, V)
        return fit_vocab(logits, self.vocab_size).argmax(-1), None

    def propose_chains(self, ks: Tensor, sampling: Sampling, generator: torch.Generator | None,
                       budgets: list[int] | None = None) -> tuple[Tensor, None, Tensor]:
        """As :meth:`BatchDrafter.propose_chains`."""
        drafts, q = self.propose(int(ks.max()), sampling, generator)
        return drafts, q, ks

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor,
               own: Tensor | None = None) -> None:
        """Each row's hidden state at its last accepted block position ``n[b]`` (the one that
        chose ``nxt[b]``); ``features (B, K + 1, H)``."""
        self.hidden = features[torch.arange(len(n), device=features.device), n.to(features.device)]

    def select(self, rows: Tensor) -> None:
        self.hidden = self.hidden[rows.to(self.hidden.device)]


def family_of(proposer: Proposer) -> DraftFamily | None:
    """The registered family whose proposer class ``proposer`` is (or derives from); None when
    no family drafts with it (plain decoding, prompt lookup)."""
    by_path = {f.proposer: f for f in FAMILIES.values()}
    for cls in type(proposer).__mro__:
        family = by_path.get(f"{cls.__module__}.{cls.__qualname__}")
        if family is not None:
            return family
    return None


def batch_drafter_for(proposer: Proposer) -> BatchDrafter | BatchSuffix | None:
    """The batched drafter that runs ``proposer``'s draft for every row (None: plain decoding):
    the one its family names (``DraftFamily.batch_drafter``), trees only where the family drafts
    them in batches (``DraftFamily.batched_tree``); for a suffix proposer, the batched suffix
    chains (:class:`~eval.decoding.batch_suffix.BatchSuffix`), alone or beside the batched
    drafter of its inner proposer's family (chains only).

    Raises:
        ValueError: no batched drafter runs this proposer (prompt lookup, say: the message
            names ``draft=suffix``, its batched alternative), or not its trees.
    """
    if isinstance(proposer, PlainProposer):
        return None
    if isinstance(proposer, SuffixProposer):
        if proposer.tree:
            raise ValueError(f"batched decoding drafts the suffix hybrid in chains: use "
                             f"tree=chain, or suffix=false for the {proposer.name!r} draft's "
                             "batched trees alone")
        inner = None if proposer.inner is None else batch_drafter_for(proposer.inner)
        return BatchSuffix(proposer, inner)
    family = family_of(proposer)
    if family is None or family.batch_drafter is None:
        able = [f.name for f in FAMILIES.values() if f.batch_drafter is not None]
        raise ValueError(f"no batched drafter for the {proposer.name!r} proposer: batch_size > 1 "
                         f"runs the {', '.join(able)} drafts, draft=suffix (each row's longest "
                         "earlier match: prompt lookup's batched alternative) or plain decoding; "
                         "decode it with batch_size=1")
    if proposer.tree and not family.batched_tree:
        able = [f.name for f in FAMILIES.values() if f.batched_tree]
        raise ValueError(f"batched decoding drafts trees with the {', '.join(able)} drafts only: "
                         f"use tree=chain for the {proposer.name!r} draft with batch_size > 1")
    return load_object(family.batch_drafter)(proposer)
