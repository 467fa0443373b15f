"""Batched speculative decoding: the rows of a batch share every target verification.

Each step drafts a chain for every row at once (the draft LM, the EAGLE head or Medusa heads; or
each row's suffix match, alone or instead of the trained draft's chain where the batch's expected
tokens per second favour it: :mod:`eval.decoding.batch_suffix`), feeds the target one
``(B, K + 1)`` block (each row's pending token and its drafts), accepts a prefix per row with the
same lossless rule as batch size one (:func:`eval.decoding.verify.verify_chain_batch`, one
accepted length per row), and commits each row under its own stop rules; rows that finish leave
the batch. ``K = 0`` is plain batched decoding through the same loop.

An EAGLE head with ``tree=True`` drafts an EAGLE-2 dynamic tree per row instead (each depth of
every row's tree in one ``(B, topk)`` head forward); the target verifies each row's pending
token and tree in one ``(B, N + 1)`` block under per-row tree masks (padded layout), each row is
verified by the batch-one tree rules, and both caches keep each row's accepted path only.

Rows accept different numbers of tokens, so their caches grow apart: every model keeps one KV cache
for the whole batch in which each row owns a set of valid slots (:mod:`eval.decoding.slots`). The
target's cache is ``padded`` (a cache row per batch row, blocks padded to the longest row) or
``packed`` (all rows in one cache row, only real tokens fed); the drafters' are padded.

Per-row K: each row has its own :class:`~eval.decoding.k_controller.KController` (fixed K,
fallback on), so a row whose drafts keep failing stops speculating (its slots of the block are
padding) while the others go on. The block is as wide as the longest row's chain. Above them the
batch's own fallback (:class:`~eval.decoding.batch_judge.BatchJudge`) takes plain steps for every
row while the batch's speculative rounds commit fewer tokens per second than its plain steps; the
hybrid (:class:`~eval.decoding.batch_suffix.BatchSuffix`) makes that choice itself each round.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from draftsmith.data.attention import native_gqa
from draftsmith.eval.decoding.batch_drafters import batch_drafter_for
from draftsmith.eval.decoding.batch_judge import BatchJudge
from draftsmith.eval.decoding.batch_suffix import BatchSuffix
from draftsmith.eval.decoding.decoder import DecodeResult, _Stopper
from draftsmith.eval.decoding.k_controller import KController
from draftsmith.eval.decoding.proposal import Proposal, Sampling
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.slots import check_layout, last_valid, pad_rows, slot_cache
from draftsmith.eval.decoding.stats import DecodeStats
from draftsmith.eval.decoding.target_model import (
    cache_kwarg,
    sliding_window,
    target_logits,
    tree_ancestor_mask,
)
from draftsmith.eval.decoding.verify import (
    Verified,
    top1,
    verify_chain_batch,
    verify_greedy,
    verify_tree,
)
from draftsmith.heads.draft_config import text_config


class BatchTarget:
    """The target over a slot cache (:mod:`eval.decoding.slots`): feeds blocks, returns logits and
    features.

    Args:
        model: the target causal LM (``model.model`` the decoder stack, ``model.lm_head``).
        layer_ids: hidden-state layers to return as well (fused EAGLE-3 features).
        layout: the cache layout, ``padded`` or ``packed`` (:mod:`eval.decoding.slots`).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = (),
                 layout: str = "padded") -> None:
        self.model = model
        self.layer_ids = list(layer_ids)
        self.layout = layout
        self.device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model.model)
        self._softcap = getattr(text_config(model.config), "final_logit_softcapping", None)
        self.slots = None

    def start(self, batch: int) -> None:
        self.slots = slot_cache(self.layout, self.model.config, batch, self.device)

    @torch.inference_mode()
    def feed(self, ids: Tensor, valid: Tensor, last_only: bool = False,
             tree: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Feed ``ids (B, T)`` (padding where ``valid`` is False); a token tree when ``tree`` is
        ``(ancestors (B, T, T), depth (B, T))``: a node sees the committed slots, its ancestors
        in the block and itself, at position (committed tokens + depth) (padded layout).

        Returns:
            ``logits (B, T, V)`` float32 (``(B, V)`` at each row's last valid token when
            ``last_only``: a prefill needs no more) and the features ``(B, T, H)`` (final-norm
            hidden state), or ``(B, T, L * H)`` the requested layers side by side.
        """
        if tree is None:
            mask, pos = self.slots.open(valid)
        else:
            mask, pos = self.slots.open_tree(valid, tree[0], tree[1], self.slots.width)
        fed = self.slots.pack(ids, valid)
        # native GQA as in eval.decoding.target_model, for multi-token blocks only: on one-token
        # steps of a batch it measured slower than transformers' KV copy (115 vs 153 tokens/s,
        # B = 16)
        with native_gqa(self.device.type == "cpu" and fed.shape[1] > 1):
            out = self.model.model(input_ids=fed, **{self._cache_kw: self.slots.cache},
                                   use_cache=True, position_ids=pos, attention_mask=mask,
                                   output_hidden_states=bool(self.layer_ids))
        hidden = self.slots.unpack(out.last_hidden_state, valid)
        logits = target_logits(self.model, last_valid(hidden, valid) if last_only else hidden,
                               self._softcap).float()
        if self.layer_ids:
            hidden = torch.cat([self.slots.unpack(out.hidden_states[i], valid)
                                for i in self.layer_ids], dim=-1)
        return logits, hidden


class BatchDecoder:
    """Speculative decoding of a batch of prompts; lossless per row.

    Args:
        target: the target causal LM.
        proposer: the draft (a chain :class:`~eval.decoding.proposers.DraftLMProposer`, an
            :class:`~eval.decoding.proposers_eagle.EagleProposer`, chain or tree, a
            :class:`~eval.decoding.proposers_suffix.SuffixProposer` alone or around a chain of
            either), or a plain proposer.
        k: draft length per step, the tree's depth for a tree (0 = plain batched decoding).
        fallback: fallback to plain decoding, per row (each row's own K controller) and for the
            batch (:class:`~eval.decoding.batch_judge.BatchJudge`; a hybrid chooses itself).
        layout: the target's cache layout (:data:`eval.decoding.slots.LAYOUTS`): ``packed`` feeds
            only each row's real tokens (a fallen-back row adds one token to a verification),
            ``padded`` pads every row to the longest chain.
    """

    def __init__(self, target: nn.Module, proposer: Proposer, k: int = 3,
                 fallback: bool = True, layout: str = "padded") -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0 (0 = plain decoding), got {k}")
        self.drafter = batch_drafter_for(proposer)
        self.k = k if self.drafter is not None else 0
        if getattr(self.drafter, "max_k", None) is not None:  # Medusa: a token per head
            self.k = min(self.k, self.drafter.max_k)
        self.tree = bool(getattr(proposer, "tree", False)) and self.drafter is not None
        if self.tree and check_layout(layout) != "padded":
            raise ValueError(f"layout={layout}: batched trees use the padded layout (a tree "
                             "needs its own attention mask per row); use layout=padded")
        self.target = BatchTarget(target, proposer.layer_ids, check_layout(layout))
        self.fallback = fallback
        self.lossless = proposer.lossless
        self.judge: BatchJudge | None = None  # the batch's fallback of the last generate

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop_sequences: Sequence[Sequence[int]] = (),
                 generator: torch.Generator | None = None,
                 seed: int | None = None) -> list[DecodeResult]:
        """Decode every prompt; one :class:`~eval.decoding.decoder.DecodeResult` per prompt, in
        order.

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
        window = sliding_window(self.target.model.config)
        longest = max(len(p) for p in prompts) + max_new_tokens + self.k + 1
        if window is not None and longest > window:
            raise ValueError(
                f"batched decoding of this target's sliding-window layers (window {window}) "
                f"covers sequences up to {window} tokens, but prompts of up to "
                f"{max(len(p) for p in prompts)} tokens + max_new_tokens={max_new_tokens} reach "
                f"{longest}: a batch row's cache slots are not its positions, so a window cannot "
                "be masked there. Decode these prompts at batch_size=1, or shorten them")
        b = len(prompts)
        rows = list(range(b))  # live rows -> prompt index
        stoppers = [_Stopper(eos, stop_sequences, max_new_tokens) for _ in range(b)]
        generated: list[list[int]] = [[] for _ in range(b)]
        stats = [DecodeStats() for _ in range(b)]
        ctrls = [KController(self.k, adaptive=False, fallback=self.fallback) for _ in range(b)]
        for ctrl in ctrls:
            ctrl.tree = self.tree
        self.judge = (BatchJudge(self.k) if self.fallback and self.k > 0
                      and not isinstance(self.drafter, BatchSuffix) else None)
        t_start = time.perf_counter()
        done, first = self._prefill(prompts, sampling, generator, stoppers, generated, stats)
        rows, pending = self._leave(rows, done, first, stats, t_start)
        while rows:
            # 1.-2. propose (each row its own K, 0 = fallen back) and verify in one block
            budgets = [max_new_tokens - len(generated[r]) - 1 for r in rows]
            ks = torch.tensor([min(ctrls[r].next_k(), b) for r, b in zip(rows, budgets)])
            if self.judge is not None and not self.judge.speculates():
                ks.zero_()
            new, nodes, depths, nxt, t_draft, t_verify = self._step(ks, budgets, pending,
                                                                    sampling, generator)
            # 3. commit under each row's stop rules; 4. record; 5. rows that finished leave
            done = []
            for i, r in enumerate(rows):
                fin = False
                for tok in new[i]:
                    fin = stoppers[r].push(generated[r], tok)
                    if fin:
                        break
                done.append(fin)
                depth, n = depths[i], len(new[i]) - 1
                st = stats[r]
                st.record_step(depth, n)
                st.target_forwards += 1
                st.draft_time_s += t_draft
                st.verify_time_s += t_verify
                if depth:
                    ctrls[r].record(depth, nodes[i], n, len(new[i]), t_draft, t_verify)
                elif max(depths) == 0:  # a plain step of the batch (padding costs the same)
                    ctrls[r].record_plain(t_draft + t_verify)
            if self.judge is not None:
                self.judge.record(depths, nodes, [len(x) for x in new], t_draft, t_verify)
            rows, pending = self._leave(rows, done, nxt, stats, t_start)
        return [DecodeResult(generated[i], self._final(stats[i], stoppers[i], generated[i]))
                for i in range(b)]

    def _prefill(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 generator: torch.Generator | None, stoppers: list[_Stopper],
                 generated: list[list[int]], stats: list[DecodeStats]
                 ) -> tuple[list[bool], Tensor]:
        """Every prompt in one right-padded block: each row's first token (pushed under its stop
        rules; whether that ended it) and the drafter started on the prompts."""
        t_start = time.perf_counter()
        self.target.start(len(prompts))
        ids, valid = pad_rows(prompts, self.target.device)
        logits, feats = self.target.feed(ids, valid, last_only=True)
        first = self._sample(logits, sampling, generator)
        t_prefill = time.perf_counter() - t_start
        done = [stoppers[i].push(generated[i], int(first[i])) for i in range(len(prompts))]
        for st in stats:
            st.verify_time_s += t_prefill
            st.target_forwards += 1
        if self.drafter is not None:
            t0 = time.perf_counter()
            self.drafter.start([list(p) + [int(first[i])] for i, p in enumerate(prompts)],
                               feats, valid)
            for st in stats:
                st.draft_time_s += time.perf_counter() - t0
        return done, first

    def _step(self, ks: Tensor, budgets: list[int], pending: Tensor, sampling: Sampling,
              generator: torch.Generator | None
              ) -> tuple[list[list[int]], list[int], list[int], Tensor, float, float]:
        """One step of trees (:meth:`_tree_step`) or chains (:meth:`_chain_step`); a step in
        which no row drafts is a chain step of none (no tree masks to build)."""
        if self.tree and int(ks.max()) > 0:
            return self._tree_step(ks, pending, sampling, generator)
        return self._chain_step(ks, pending, sampling, generator, budgets)

    def _chain_step(self, ks: Tensor, pending: Tensor, sampling: Sampling,
                    generator: torch.Generator | None, budgets: list[int]
                    ) -> tuple[list[list[int]], list[int], list[int], Tensor, float, float]:
        """One step of chains: each row drafts up to ``ks[b]`` (a model drafts the longest K
        for the batch; a suffix row drafts what its match holds, up to the tokens ``budgets[b]``
        it may still add, maybe none; ``ks[b] = 0``: none), and its block is its pending token
        and the drafts it really has (padding after). Returns each row's new tokens (accepted
        drafts, then the next token), its drafted nodes and their depth (what it really
        drafted), the next tokens ``(B,)`` and the step's draft and verify seconds."""
        dev = self.target.device
        t0 = time.perf_counter()
        if int(ks.max()) > 0:
            drafts, q, ks = self.drafter.propose_chains(ks, sampling, generator, budgets)
        else:
            drafts, q = torch.zeros(len(ks), 0, dtype=torch.long, device=dev), None
        k = drafts.shape[1]
        t1 = time.perf_counter()
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
        new = [drafts[i, :int(n[i])].tolist() + [int(nxt[i])] for i in range(len(ks))]
        return new, ks.tolist(), ks.tolist(), nxt, (t1 - t0) + (t3 - t2), t2 - t1

    def _tree_step(self, ks: Tensor, pending: Tensor, sampling: Sampling,
                   generator: torch.Generator | None
                   ) -> tuple[list[list[int]], list[int], list[int], Tensor, float, float]:
        """One step of EAGLE-2 dynamic trees (``ks[b]``: the depth, 0 = fallen back): each row's
        block is its pending token and its tree (padding after), verified by the rules of batch
        one; the target and the head keep each row's accepted path. Returns as
        :meth:`_chain_step`."""
        dev = self.target.device
        b, k = len(ks), int(ks.max())
        t0 = time.perf_counter()
        props = (self.drafter.propose_tree(ks.tolist(), sampling, generator) if k > 0
                 else [Proposal.empty()] * b)
        t1 = time.perf_counter()
        sizes = [len(pr) if int(ks[i]) > 0 else 0 for i, pr in enumerate(props)]
        n = max(sizes)
        ids = torch.zeros(b, n + 1, dtype=torch.long)
        ids[:, 0] = pending.cpu()
        valid = torch.arange(n + 1) <= torch.tensor(sizes).unsqueeze(1)
        ancestors = torch.eye(n + 1, dtype=torch.bool).repeat(b, 1, 1)  # (B, N+1, N+1)
        for i, (pr, m) in enumerate(zip(props, sizes)):  # the pending token is each tree's root
            ids[i, 1:m + 1] = pr.tokens[:m]
            ancestors[i, :m + 1, :m + 1] = tree_ancestor_mask(
                torch.cat([torch.tensor([-1]), pr.parents[:m] + 1]))
        depth = ancestors.sum(-1) - 1  # (B, N+1): 0 at the root and at padding
        start = self.target.slots.width
        logits, feats = self.target.feed(ids.to(dev), valid.to(dev),
                                         tree=(ancestors.to(dev), depth.to(dev)))
        new, rows = [], []
        keep = torch.zeros(b, n + 1, dtype=torch.bool)
        keep[:, 0] = True
        for i, (path, nxt) in enumerate(self._verify_trees(logits, props, sizes, sampling,
                                                           generator)):
            keep[i, [j + 1 for j in path]] = True
            rows.append([0] + [j + 1 for j in path])
            new.append([int(props[i].tokens[j]) for j in path] + [int(nxt)])
        self.target.slots.keep_mask(start, keep.to(dev))
        t2 = time.perf_counter()
        self.drafter.commit_rows(k > 0, rows, new, feats)
        t3 = time.perf_counter()
        nxt = torch.tensor([x[-1] for x in new], device=dev)
        return new, sizes, depth.max(1).values.tolist(), nxt, (t1 - t0) + (t3 - t2), t2 - t1

    @staticmethod
    def _verify_trees(logits: Tensor, props: list[Proposal], sizes: list[int],
                      sampling: Sampling, generator: torch.Generator | None) -> list[Verified]:
        """Each row's tree (its first ``sizes[b]`` nodes) verified by the batch-one rules
        (:func:`~eval.decoding.verify.verify_greedy`, :func:`~eval.decoding.verify.verify_tree`) on
        its rows of ``logits (B, N + 1, V)``."""
        best = top1(logits).cpu() if sampling.greedy else None
        out = []
        for i, (pr, m) in enumerate(zip(props, sizes)):
            tokens, parents = pr.tokens[:m], pr.parents[:m]
            if best is not None:
                out.append(verify_greedy(best[i, :m + 1], tokens, parents))
                continue
            p = sampling.warp(logits[i, :m + 1])
            q = None if pr.q is None or m == 0 else pr.q[:m].to(p.device)
            out.append(verify_tree(p, q, tokens.to(p.device), parents.to(p.device), generator))
        return out

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
            return top1(logits)
        return torch.multinomial(sampling.warp(logits), 1, generator=generator).squeeze(-1)

    def _verify(self, logits: Tensor, q: Tensor | None, drafts: Tensor, ks: Tensor,
                sampling: Sampling, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """Accepted drafts per row (at most ``ks[b]``) and the next token, as
        :func:`~eval.decoding.verify.verify_chain_batch` (greedy: argmax matching; ``q`` None:
        the drafts are point masses)."""
        k = drafts.shape[1]
        if sampling.greedy:
            best = logits.argmax(-1)  # (B, K+1)
            real = torch.arange(k, device=best.device) < ks.unsqueeze(1)
            n = ((drafts == best[:, :k]) & real).long().cumprod(-1).sum(-1)
            return n, best[torch.arange(best.shape[0], device=best.device), n]
        p = sampling.warp(logits)
        if q is None:  # every draft a point mass (suffix chains; or none drafted)
            q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p)
        return verify_chain_batch(p, q.to(p.device), drafts, generator, lengths=ks)
