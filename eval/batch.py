"""Batched speculative decoding: the rows of a batch share every target verification.

Each step drafts a chain for every row at once (the draft LM, or the EAGLE head), feeds the
target one ``(B, K + 1)`` block (each row's pending token and its drafts), accepts a prefix per
row with the same lossless rule as batch size one (:func:`eval.verify.verify_chain_batch`, one
accepted length per row), and commits each row under its own stop rules; rows that finish
leave the batch. ``K = 0`` is plain batched decoding through the same loop.

Rows accept different numbers of tokens, so their caches grow apart: every model keeps one
KV cache for the whole batch in which each row owns a set of valid slots (:mod:`eval.slots`).
The target's cache is ``padded`` (a cache row per batch row, blocks padded to the longest row)
or ``packed`` (all rows in one cache row, only real tokens fed); the drafters' are padded.

Per-row K: each row has its own :class:`~eval.stats.KController` (fixed K, fallback on), so a
row whose drafts keep failing stops speculating (its slots of the block are padding) while the
others go on. The block is as wide as the longest row's chain.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from eval.decoder import DecodeResult, _Stopper
from eval.proposal import Sampling
from eval.proposers import DraftLMProposer, Proposer, fit_vocab
from eval.proposers_eagle import EagleProposer
from eval.slots import SlotCache, check_layout, slot_cache
from eval.stats import DecodeStats, KController
from eval.target_model import cache_kwarg, native_gqa
from eval.verify import verify_chain_batch


def pad_rows(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged token rows -> right-padded ``(B, T)`` ids (0 as padding) and their valid mask."""
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    valid = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        valid[i, :len(r)] = True
    return ids.to(device), valid.to(device)


def last_valid(x: Tensor, valid: Tensor) -> Tensor:
    """``x (B, T, ...)`` at each row's last valid position -> ``(B, ...)``."""
    idx = valid.long().sum(1) - 1
    return x[torch.arange(x.shape[0], device=x.device), idx.to(x.device)]


class BatchTarget:
    """The target over a slot cache (:mod:`eval.slots`): feeds blocks, returns logits and
    features.

    Args:
        model: the target causal LM (``model.model`` the decoder stack, ``model.lm_head``).
        layer_ids: hidden-state layers to return as well (fused EAGLE-3 features).
        layout: the cache layout, ``padded`` or ``packed`` (:mod:`eval.slots`).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = (),
                 layout: str = "padded") -> None:
        self.model = model
        self.layer_ids = list(layer_ids)
        self.layout = layout
        self.device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model.model)
        self.slots = None

    def start(self, batch: int) -> None:
        self.slots = slot_cache(self.layout, self.model.config, batch, self.device)

    @torch.inference_mode()
    def feed(self, ids: Tensor, valid: Tensor,
             last_only: bool = False) -> tuple[Tensor, Tensor]:
        """Feed ``ids (B, T)`` (padding where ``valid`` is False).

        Returns:
            ``logits (B, T, V)`` float32 (``(B, V)`` at each row's last valid token when
            ``last_only``: a prefill needs no more) and the features ``(B, T, H)`` (final-norm
            hidden state), or ``(B, T, L * H)`` the requested layers side by side.
        """
        mask, pos = self.slots.open(valid)
        fed = self.slots.pack(ids, valid)
        # native GQA as in eval.target_model, for multi-token blocks only: on one-token steps of
        # a batch it measured slower than transformers' KV copy (115 vs 153 tokens/s, B = 16)
        with native_gqa(self.device.type == "cpu" and fed.shape[1] > 1):
            out = self.model.model(input_ids=fed, **{self._cache_kw: self.slots.cache},
                                   use_cache=True, position_ids=pos, attention_mask=mask,
                                   output_hidden_states=bool(self.layer_ids))
        hidden = self.slots.unpack(out.last_hidden_state, valid)
        logits = self.model.lm_head(last_valid(hidden, valid) if last_only else hidden).float()
        if self.layer_ids:
            hidden = torch.cat([self.slots.unpack(out.hidden_states[i], valid)
                                for i in self.layer_ids], dim=-1)
        return logits, hidden


class BatchDrafter(ABC):
    """A batched chain drafter built from a batch-one proposer (its weights and draft
    vocabulary); subclasses hold the per-row state.

    ``start`` once per batch, ``propose`` a chain of ``k`` per row, ``commit`` the accepted
    lengths, ``select`` the rows that stay.
    """

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.device = proposer.device
        self.vocab_size = proposer.vocab_size

    def _pick(self, logits: Tensor, sampling: Sampling,
              generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """``logits (B, Vd)`` -> drafted target ids ``(B,)`` and ``q (B, V)`` (None: greedy,
        point masses)."""
        if sampling.greedy:
            return self.proposer._to_target(logits.argmax(-1)), None
        q = sampling.warp(logits)
        on = q if generator is None else q.to(generator.device)
        x = torch.multinomial(on, 1, generator=generator).squeeze(-1).to(q.device)
        return self.proposer._to_target(x), self.proposer._scatter_q(q)

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
    """The draft LM of a :class:`~eval.proposers.DraftLMProposer`, batched: its cache holds each
    row's committed tokens but the last few (``missing``), fed at the next proposal."""

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
        logits = torch.nn.functional.linear(last_valid(h, valid), self.head).float()  # (B, Vd)
        return logits if self.proposer.d2t is not None else fit_vocab(logits, self.vocab_size)

    def _first(self) -> Tensor:
        ids, valid = pad_rows(self.missing, self.device)
        self.missing = [[] for _ in self.missing]
        return self._feed(ids, valid)

    def _next(self, x: Tensor) -> Tensor:
        return self._feed(x.view(-1, 1), self._one(x))

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor) -> None:
        """Row ``b`` accepted ``n[b]`` of its ``k`` drafts, then ``nxt[b]``."""
        if k == 0:
            for b, miss in enumerate(self.missing):
                miss.append(int(nxt[b]))
            return
        fed = n.clamp_max(k - 1)  # drafts 1..k-1 were fed while drafting
        self.slots.keep(self.draft_start, fed)
        for b in range(len(self.missing)):
            self.missing[b] = drafts[b, int(fed[b]):int(n[b])].tolist() + [int(nxt[b])]

    def select(self, rows: Tensor) -> None:
        self.slots.select(rows)
        self.missing = [self.missing[i] for i in rows.tolist()]


class BatchEagle(BatchDrafter):
    """The head of an :class:`~eval.proposers_eagle.EagleProposer`, batched: its cache holds the
    (true feature, next token) pairs of each row's committed tokens; pairs from the last
    verification wait in ``pending`` until the next proposal feeds them."""

    def __init__(self, proposer: EagleProposer) -> None:
        super().__init__(proposer)
        self.head = proposer.head
        self.layer_ids = proposer.layer_ids

    def start(self, tokens: list[list[int]], features: Tensor, valid: Tensor) -> None:
        """``features (B, T, kH)``: the target's prefill features of each row's prompt (its
        first ``len(tokens[b]) - 1`` valid positions)."""
        self.slots = SlotCache(self.head.config, len(tokens), self.device)
        self.pending = [(features[b, :len(t) - 1], list(t[1:])) for b, t in enumerate(tokens)]

    def _feed(self, feats: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
        mask, pos = self.slots.open(valid)
        return self.head(feats, ids, past_key_values=self.slots.cache, position_ids=pos,
                         attention_mask=mask)

    def _first(self) -> Tensor:
        ids, valid = pad_rows([tok for _, tok in self.pending], self.device)
        width = self.pending[0][0].shape[-1]
        feats = torch.zeros(*ids.shape, width, dtype=self.pending[0][0].dtype,
                            device=self.device)
        for b, (f, _) in enumerate(self.pending):
            feats[b, :f.shape[0]] = f.to(self.device)
        self.pending = [(f[:0], []) for f, _ in self.pending]
        self._last = last_valid(self._feed(feats, ids, valid), valid).unsqueeze(1)  # (B, 1, H)
        return self._logits()

    def _next(self, x: Tensor) -> Tensor:
        self._last = self._feed(self._last, x.view(-1, 1), self._one(x))
        return self._logits()

    def _logits(self) -> Tensor:
        return self.proposer._logits(self._last.contiguous())[:, -1]

    def commit(self, k: int, n: Tensor, drafts: Tensor, nxt: Tensor, features: Tensor) -> None:
        """``features (B, k + 1, kH)``: the target's features of the verified block."""
        if k > 0:  # drafted pairs carry predicted features: never kept
            self.slots.keep(self.draft_start, torch.zeros_like(n))
        for b, (f, tok) in enumerate(self.pending):
            m = int(n[b])
            self.pending[b] = (torch.cat([f, features[b, :m + 1].to(f.dtype)]),
                               tok + drafts[b, :m].tolist() + [int(nxt[b])])

    def select(self, rows: Tensor) -> None:
        self.slots.select(rows)
        self.pending = [self.pending[i] for i in rows.tolist()]


class BatchDecoder:
    """Speculative decoding of a batch of prompts; lossless per row.

    Args:
        target: the target causal LM.
        proposer: the draft (a chain :class:`~eval.proposers.DraftLMProposer` or
            :class:`~eval.proposers_eagle.EagleProposer`), or a plain proposer.
        k: draft length per step (0 = plain batched decoding).
        fallback: per-row fallback to plain decoding (each row's own K controller).
        layout: the target's cache layout (:data:`eval.slots.LAYOUTS`): ``packed`` feeds only
            each row's real tokens (a fallen-back row adds one token to a verification),
            ``padded`` pads every row to the longest chain.
    """

    def __init__(self, target: nn.Module, proposer: Proposer, k: int = 3,
                 fallback: bool = True, layout: str = "padded") -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0 (0 = plain decoding), got {k}")
        self.drafter = proposer.batched()
        self.k = k if self.drafter is not None else 0
        self.target = BatchTarget(target, proposer.layer_ids, check_layout(layout))
        self.fallback = fallback
        self.lossless = proposer.lossless

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop_sequences: Sequence[Sequence[int]] = (),
                 generator: torch.Generator | None = None,
                 seed: int | None = None) -> list[DecodeResult]:
        """Decode every prompt; one :class:`~eval.decoder.DecodeResult` per prompt, in order.

        Each row's ``wall_time_s`` runs from the start of the batch to the step it finished
        in; the batch's time is shared by its rows (``draft_time_s`` / ``verify_time_s`` of a
        step are counted in every row that took part).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        sampling = Sampling(temperature, top_k, top_p)
        sampling.warp(torch.zeros(2))
        if generator is None:
            generator = torch.Generator(device=self.target.device)
            if seed is not None:
                generator.manual_seed(seed)
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int)
                                               else list(eos_token_id))
        b = len(prompts)
        rows = list(range(b))  # live rows -> prompt index
        stoppers = [_Stopper(eos, stop_sequences, max_new_tokens) for _ in range(b)]
        generated: list[list[int]] = [[] for _ in range(b)]
        stats = [DecodeStats() for _ in range(b)]
        ctrls = [KController(self.k, adaptive=False, fallback=self.fallback) for _ in range(b)]
        t_start = time.perf_counter()
        dev = self.target.device

        # prefill: every prompt in one right-padded block
        self.target.start(b)
        ids, valid = pad_rows(prompts, dev)
        logits, feats = self.target.feed(ids, valid, last_only=True)
        first = self._sample(logits, sampling, generator)
        t_prefill = time.perf_counter() - t_start
        done = [stoppers[i].push(generated[i], int(first[i])) for i in range(b)]
        for st in stats:
            st.verify_time_s += t_prefill
            st.target_forwards += 1
        if self.drafter is not None:
            t0 = time.perf_counter()
            self.drafter.start([list(p) + [int(first[i])] for i, p in enumerate(prompts)],
                               feats, valid)
            for st in stats:
                st.draft_time_s += time.perf_counter() - t0
        rows, pending = self._leave(rows, done, first, stats, t_start)
        while rows:
            # 1. propose: each row its own K (0 = fallen back), the batch drafts the longest
            ks = torch.tensor([min(ctrls[r].next_k(), max_new_tokens - len(generated[r]) - 1)
                               for r in rows])
            k = int(ks.max())
            t0 = time.perf_counter()
            if k > 0:
                drafts, q = self.drafter.propose(k, sampling, generator)
            else:
                drafts, q = torch.zeros(len(rows), 0, dtype=torch.long, device=dev), None
            t1 = time.perf_counter()
            # 2. verify: pending + drafts per row in one block; padding beyond each row's K
            start = self.target.slots.width
            block = torch.cat([pending.view(-1, 1).to(dev), drafts.to(dev)], dim=1)
            real = torch.arange(k + 1, device=dev) <= ks.to(dev).unsqueeze(1)
            logits, feats = self.target.feed(block, real)
            n, nxt = self._verify(logits, q, drafts.to(dev), ks.to(dev), sampling, generator)
            self.target.slots.keep(start, n + 1)
            t2 = time.perf_counter()
            if self.drafter is not None:
                self.drafter.commit(k, n, drafts, nxt, feats)
            t3 = time.perf_counter()
            # 3. commit under each row's stop rules; 4. record; 5. rows that finished leave
            done = []
            for i, r in enumerate(rows):
                new = drafts[i, :int(n[i])].tolist() + [int(nxt[i])]
                fin = False
                for tok in new:
                    fin = stoppers[r].push(generated[r], tok)
                    if fin:
                        break
                done.append(fin)
                kr = int(ks[i])
                st = stats[r]
                st.record_step(kr, int(n[i]))
                st.target_forwards += 1
                st.draft_time_s += (t1 - t0) + (t3 - t2)
                st.verify_time_s += t2 - t1
                if kr:
                    ctrls[r].record(kr, kr, int(n[i]), len(new), (t1 - t0) + (t3 - t2), t2 - t1)
                elif k == 0:  # a plain step of the whole batch (a row's padding costs the same)
                    ctrls[r].record_plain(t3 - t0)
            rows, pending = self._leave(rows, done, nxt, stats, t_start)
        return [DecodeResult(generated[i], self._final(stats[i], stoppers[i], generated[i]))
                for i in range(b)]

    @staticmethod
    def _final(st: DecodeStats, stopper: _Stopper, generated: list[int]) -> DecodeStats:
        st.tokens_generated = len(generated)
        st.stop_reason = stopper.reason
        return st.finalize()

    def _leave(self, rows: list[int], done: list[bool], pending: Tensor,
               stats: list[DecodeStats], t_start: float) -> tuple[list[int], Tensor]:
        """Rows that finished leave the batch (their wall time is set, their cache rows
        dropped); returns the rows still running and their pending tokens."""
        now = time.perf_counter() - t_start
        for r, d in zip(rows, done):
            if d:
                stats[r].wall_time_s = now
        keep = [i for i, d in enumerate(done) if not d]
        if keep and len(keep) < len(rows):
            idx = torch.tensor(keep, device=self.target.device)
            self.target.slots.select(idx)
            if self.drafter is not None:
                self.drafter.select(idx)
            pending = pending[idx]
        elif keep:
            self.target.slots.compact()
        return [rows[i] for i in keep], pending

    @staticmethod
    def _sample(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
        """One token per row of ``logits (B, V)``."""
        if sampling.greedy:
            return logits.argmax(-1)
        return torch.multinomial(sampling.warp(logits), 1, generator=generator).squeeze(-1)

    def _verify(self, logits: Tensor, q: Tensor | None, drafts: Tensor, ks: Tensor,
                sampling: Sampling, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """Accepted drafts per row (at most ``ks[b]``) and the next token, as
        :func:`~eval.verify.verify_chain_batch` (greedy: argmax matching)."""
        k = drafts.shape[1]
        if sampling.greedy:
            best = logits.argmax(-1)  # (B, K+1)
            real = torch.arange(k, device=best.device) < ks.unsqueeze(1)
            n = ((drafts == best[:, :k]) & real).long().cumprod(-1).sum(-1)
            return n, best[torch.arange(best.shape[0], device=best.device), n]
        p = sampling.warp(logits)
        if q is None:
            q = torch.zeros(p.shape[0], k, p.shape[-1], device=p.device)
        return verify_chain_batch(p, q.to(p.device), drafts, generator, lengths=ks)
