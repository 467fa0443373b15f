"""The speculative decoding loop: one loop for every proposer, plain decoding included.

Each step: (1) the proposer drafts a chain or tree after the committed tokens; (2) the target
scores the pending token and all drafts in one forward and :mod:`eval.decoding.verify` accepts a
prefix (chain) or root path (tree) losslessly and draws the next token; (3) accepted tokens are
committed under the stop rules; (4) the target's and the proposer's caches drop the rejected
drafts; (5) the K controller adapts the draft length or falls back to plain decoding.

Stop rules match the target's own ``generate``: EOS is emitted and nothing after it; a stop
sequence is emitted in full and nothing after it; never more than ``max_new_tokens``; a time
budget ends the request after the step during which it ran out.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draftsmith.eval.decoding.k_controller import KController
from draftsmith.eval.decoding.proposal import DecodeContext, Proposal, Sampling
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.shadow import Shadow
from draftsmith.eval.decoding.stats import DecodeStats, RoundTime
from draftsmith.eval.decoding.target_model import Target, TargetOutput
from draftsmith.eval.decoding.verify import (
    top1,
    verify_chain,
    verify_greedy,
    verify_tree,
    verify_tree_typical,
)

ACCEPTANCE_MODES = ("lossless", "typical")


@dataclass
class DecodeResult:
    """``output_ids``: the new tokens only; ``stats``: see :class:`DecodeStats`."""

    output_ids: list[int]
    stats: DecodeStats


class _Stopper:
    """Applies EOS / stop sequences / max_new_tokens while tokens are committed one by one."""

    def __init__(self, eos: Sequence[int], stops: Sequence[Sequence[int]], max_new: int) -> None:
        self.eos = {int(e) for e in eos}
        self.stops = [list(s) for s in stops if len(s) > 0]
        self.max_new = max_new
        self.reason = ""

    def push(self, generated: list[int], token: int) -> bool:
        """Append ``token``; return True when generation must end after it."""
        generated.append(token)
        if token in self.eos:
            self.reason = "eos"
        elif any(generated[-len(s):] == s for s in self.stops if len(generated) >= len(s)):
            self.reason = "stop_sequence"
        elif len(generated) >= self.max_new:
            self.reason = "max_new_tokens"
        return bool(self.reason)


class SpeculativeDecoder:
    """Speculative decoding with any :class:`~eval.decoding.proposers.Proposer` (batch size one).

    Args:
        target: a :class:`~eval.decoding.target_model.Target` or a HF causal LM (wrapped, with
            the layers the proposer needs).
        proposer: the draft; :class:`~eval.decoding.proposers.PlainProposer` gives plain decoding.
        k: initial draft length (chains) or tree depth.
        k_max: largest adaptive K (default ``2 * k``).
        adaptive: adapt K from recent acceptance and measured costs (chains only).
        fallback: fall back to plain decoding while speculation is measured to be a loss.
        acceptance: ``"lossless"`` (rejection sampling) or ``"typical"`` (Medusa's typical
            acceptance for trees; lossy).
        posterior_threshold: typical acceptance threshold.
        posterior_alpha: typical acceptance entropy factor.
        window: steps remembered by the K controller.
        probe_every: plain steps between probes after a fallback.
    """

    def __init__(self, target: Target | nn.Module, proposer: Proposer, k: int = 4,
                 k_max: int | None = None, adaptive: bool = True, fallback: bool = True,
                 acceptance: str = "lossless", posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, window: int = 8, probe_every: int = 32) -> None:
        if acceptance not in ACCEPTANCE_MODES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_MODES}, got {acceptance!r}")
        if k < 0:
            raise ValueError(f"k must be >= 0 (0 = plain decoding), got {k}")
        self.target = target if isinstance(target, Target) else Target(target, proposer.layer_ids)
        missing = set(proposer.layer_ids) - set(self.target.layer_ids)
        if missing:
            raise ValueError(f"the proposer needs target layers {sorted(missing)}: build the "
                             f"Target with layer_ids={list(proposer.layer_ids)}")
        self.proposer = proposer
        self.k, self.k_max = k, k_max
        self.adaptive, self.fallback = adaptive, fallback
        self.window, self.probe_every = window, probe_every
        self.acceptance = acceptance
        self.posterior = (posterior_threshold, posterior_alpha)
        # a list to collect every round's RoundTime (scripts/bench_rounds.py); None: off
        self.round_log: list[RoundTime] | None = None
        # the clock of those rounds: wall time, or the process's CPU time (time.process_time),
        # which other processes on a shared machine do not inflate
        self.round_clock = time.perf_counter
        # shadow drafts beside plain steps while K is 0 (eval/decoding/shadow.py); None: off
        self.shadow: Shadow | None = None

    @property
    def lossless(self) -> bool:
        return self.acceptance == "lossless" and self.proposer.lossless

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop_sequences: Sequence[Sequence[int]] = (), time_budget_s: float | None = None,
                 generator: torch.Generator | None = None, seed: int | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Args:
            prompt_ids: ``(T,)`` prompt token ids.
            max_new_tokens: token budget (>= 1).
            temperature: 0 = greedy; otherwise sampling from the warped target distribution.
            top_k: top-k warping (0 disables).
            top_p: nucleus warping (1.0 disables).
            eos_token_id: id or ids that end generation (emitted, nothing after them).
            stop_sequences: token-id sequences that end generation (emitted in full).
            time_budget_s: wall-clock budget for this request; ends after the current step.
            generator: random generator on the target's device (else one seeded with
                ``seed``, else a fresh one; see :meth:`generator`).
            seed: seed for a new generator when ``generator`` is None.

        Returns:
            :class:`DecodeResult` with the new tokens and statistics.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        generator = self.generator(generator, seed)
        sampling = Sampling(temperature, top_k, top_p)
        sampling.warp(torch.zeros(2))  # validates the settings before any work
        prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids)
                                   else prompt_ids)]
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int)
                                               else list(eos_token_id))
        stopper = _Stopper(eos, stop_sequences, max_new_tokens)
        stats = DecodeStats()
        ctrl = KController(self.k, self.k_max, self.adaptive, self.fallback, window=self.window,
                           probe_every=self.probe_every)
        t_start = time.perf_counter()
        generated: list[int] = []

        done = self._prefill(prompt, sampling, generator, stats, stopper, generated)
        ctx = DecodeContext(prompt + generated, sampling, generator)
        log = self.round_log is not None
        while not done:
            remaining = max_new_tokens - len(generated)
            k = min(ctrl.next_k(), remaining - 1)
            ctx.budget = remaining - 1
            # 1. propose (beside a plain step while the draft is off, perhaps a shadow chain)
            t0 = time.perf_counter()
            c0 = self.round_clock() if log else 0.0
            with self._phase("round.draft"):
                proposal = self.proposer.propose(ctx, k) if k > 0 else Proposal.empty()
                watch = (self.shadow.wants(remaining - 1) if self.shadow is not None
                         and not len(proposal) and not self._drafting(ctrl) else 0)
                watched = self.proposer.shadow_chain(ctx, watch) if watch else None
            t1 = time.perf_counter()
            c1 = self.round_clock() if log else 0.0
            # 2. verify: the target's forward, then the acceptance rules
            n_prefix = self.target.seq_len
            with self._phase("round.verify"):
                out = self._forward(proposal, ctx.tokens[-1])
            c2 = self.round_clock() if log else 0.0
            with self._phase("round.bookkeeping"):
                path, nxt, rows, rows_out = self._accept(proposal, out, sampling, generator)
                if watched is not None:
                    self._watch(watched, out, sampling, len(generated))
                # 3. accept: commit the accepted drafts and the next token under the stop rules
                new_tokens = [int(proposal.tokens[j]) for j in path] + [nxt]
                outcome = (self.proposer.outcome(proposal, path, new_tokens)
                           if self.shadow is not None and len(proposal) else None)
                for tok in new_tokens:
                    done = stopper.push(generated, tok)
                    if done:
                        break
                ctx.tokens = prompt + generated
                # 4. roll back caches to the committed sequence
                if proposal.is_chain:
                    self.target.crop(n_prefix + 1 + len(path))
                else:
                    self.target.keep_path(n_prefix, rows)
                t3 = time.perf_counter()
                if not done:
                    self.proposer.accept(path, new_tokens, rows_out)
            t4 = time.perf_counter()
            # 5. count the round, adapt K (or fall back to plain decoding)
            depth = self._record_round(stats, ctrl, proposal, len(path), len(new_tokens),
                                       ((t1 - t0) + (t4 - t3), t3 - t1, t4 - t0),
                                       t1 - t0 if watched is not None else 0.0)
            if (not done and time_budget_s is not None
                    and time.perf_counter() - t_start > time_budget_s):
                stopper.reason, done = "time_budget", True
            if self.shadow is not None:
                self._switch(ctrl, generated, done, outcome)
            if log:
                self.round_log.append(RoundTime(depth, len(proposal), len(path), len(new_tokens),
                                                c1 - c0, c2 - c1, self.round_clock() - c0))
        stats.wall_time_s = time.perf_counter() - t_start
        stats.tokens_generated, stats.target_forwards = len(generated), self.target.forwards
        stats.stop_reason = stopper.reason
        return DecodeResult(generated, stats.finalize())

    def _prefill(self, prompt: list[int], sampling: Sampling, generator: torch.Generator,
                 stats: DecodeStats, stopper: _Stopper, generated: list[int]) -> bool:
        """The prompt's forward, its first token committed and the proposer started; whether
        that token already ended the request."""
        t0 = time.perf_counter()
        out = self.target.prefill(torch.tensor(prompt))
        first = sampling.token(out.logits[-1], generator)
        stats.verify_time_s += time.perf_counter() - t0
        done = stopper.push(generated, first)
        if not done:
            t0 = time.perf_counter()
            self.proposer.reset(prompt + [first], out)
            stats.draft_time_s += time.perf_counter() - t0
        return done

    def _watch(self, chain: Proposal, out: TargetOutput, sampling: Sampling, start: int) -> None:
        """Hand a shadow ``chain`` drafted beside a plain step to the shadow: greedy chains are
        scored once their tokens are committed (from ``start`` in the request's output), a
        sampled one's first draft at once against the plain step's distribution."""
        if not len(chain) or not chain.is_chain:
            return
        if sampling.greedy:
            self.shadow.drafted(start, chain.tokens.tolist())
        else:
            q = None if chain.q is None else chain.q[0]
            self.shadow.sampled(sampling.warp(out.logits[:1])[0], q, int(chain.tokens[0]))

    def _drafting(self, ctrl: KController) -> bool:
        """Whether the trained draft drafts now (else: plain steps, or a hybrid's suffix chains
        alone), as the shadow's judgement left it."""
        return ctrl.k > 0 and not self.proposer.paused

    def _switch(self, ctrl: KController, generated: list[int], done: bool,
                outcome: tuple[int, int] | None) -> None:
        """Judge the draft on this request's tokens (:mod:`eval.decoding.shadow`). While it is
        off: score the shadow's finished chains (all of them when the request is ``done``) and,
        when the judge says a chain pays, draft it from the next round on, in this request and the
        later ones (``self.k``). While it drafts: count the round's ``outcome`` and, when the judge
        says it no longer pays, pause it (a hybrid keeps its suffix chains) or decode plainly."""
        self.shadow.score(generated, final=done)
        if self._drafting(ctrl):
            stop = outcome is not None and not self.shadow.verified(*outcome)
            if stop and not self.proposer.pause(True):  # a hybrid drafts suffix chains alone
                ctrl.k = self.k = 0
            return
        k = self.shadow.decide()
        if k > 0:
            self.proposer.pause(False)
            ctrl.k = self.k = k
            ctrl.k_max = max(ctrl.k_max, self.k_max or 2 * k)

    def _record_round(self, stats: DecodeStats, ctrl: KController, proposal: Proposal,
                      accepted: int, committed: int, times: tuple[float, float, float],
                      shadow_s: float = 0.0) -> int:
        """Count a round in ``stats`` and tell the K controller; ``times`` are the round's draft
        (with bookkeeping), verify and whole seconds, ``shadow_s`` of the draft a shadow chain's
        (a plain step's cost, as the controller knows it, leaves it out). Returns the
        proposal's depth."""
        draft_s, verify_s, round_s = times
        depth = int(proposal.depth().max()) if len(proposal) else 0
        stats.record_step(depth, accepted)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        if depth:
            # a tree drafter keeps its depth: adaptive K judges chains of one drafter only
            ctrl.tree = bool(self.proposer.tree) or not proposal.is_chain
            ctrl.record(depth, len(proposal), accepted, committed, draft_s, verify_s)
        else:
            ctrl.record_plain(round_s - shadow_s)
        return depth

    def generator(self, generator: torch.Generator | None = None,
                  seed: int | None = None) -> torch.Generator:
        """The random generator of a request: ``generator``, else a new one on the target's
        device (seeded with ``seed``), where every draw happens: the target's logits and the
        uniforms of the acceptance test live there, and CUDA refuses a CPU generator. On the CPU
        the draws are those of ``torch.Generator().manual_seed(seed)``.

        Raises:
            ValueError: ``generator`` lives on another device than the target.
        """
        device = torch.device(self.target.device)
        if generator is not None:
            if generator.device.type != device.type:
                raise ValueError(f"the generator is on {generator.device} but the target on "
                                 f"{device}: pass torch.Generator(device={str(device)!r})")
            return generator
        generator = torch.Generator(device=device)
        if seed is not None:
            generator.manual_seed(seed)
        return generator

    def _phase(self, name: str) -> Any:
        """A profiler scope named ``name`` while rounds are logged (``round_log``), else
        nothing: ``scripts/bench_rounds.py`` reads the top costs of each phase from it."""
        return nullcontext() if self.round_log is None else torch.profiler.record_function(name)

    def _forward(self, proposal: Proposal, pending: int) -> TargetOutput:
        """The target over the pending token and the drafts (row 0: after the pending token,
        row ``j + 1``: after draft node ``j``)."""
        fed = torch.cat([torch.tensor([pending]), proposal.tokens])  # (N+1,)
        if proposal.is_chain:
            return self.target.extend(fed)
        return self.target.forward_tree(fed, torch.cat([torch.tensor([-1]),
                                                        proposal.parents + 1]))

    def _accept(self, proposal: Proposal, out: TargetOutput, sampling: Sampling,
                generator: torch.Generator) -> tuple[list[int], int, list[int], TargetOutput]:
        """The acceptance rules over the target's rows ``out`` (:meth:`_forward`).

        Returns:
            ``(path, next_token, rows, rows_out)``: accepted node indices, the next token, the
            target output rows of the committed tokens (pending + accepted) and their output.
        """
        # greedy: the one-hot rules reduce to argmax matching (same result, no (N+1, V) work)
        greedy = sampling.temperature == 0 and self.acceptance == "lossless"
        p = None if greedy else sampling.warp(out.logits)  # (N+1, V)
        if greedy:
            parents = None if proposal.is_chain else proposal.parents
            path, nxt = verify_greedy(top1(out.logits), proposal.tokens, parents)
        elif proposal.is_chain:
            q = proposal.q
            if q is None:  # deterministic drafts are point masses
                q = torch.nn.functional.one_hot(proposal.tokens, p.shape[-1]).float()
            path, nxt = verify_chain(p, q.to(p.device), proposal.tokens.to(p.device), generator)
        elif self.acceptance == "typical":
            path, nxt = verify_tree_typical(p, proposal.tokens, proposal.parents,
                                            *self.posterior, generator=generator)
        else:
            q = None if proposal.q is None else proposal.q.to(p.device)
            path, nxt = verify_tree(p, q, proposal.tokens, proposal.parents, generator)
        rows = [0] + [j + 1 for j in path]
        return path, nxt, rows, out.select(rows)
