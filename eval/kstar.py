"""K*: the draft length that maximises expected speedup, and the ``speculation.json`` record.

The cost model (``E_K``, the speedup of K drafts, K*) is :mod:`eval.decoding.cost`. Costs are
medians of repeated timings on the machine at hand; alphas come from a decoder run at a fixed ``K``
without adaptation or fallback. The record names the hardware, dtype, versions and date;
``eval/measure.py`` is its command line.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from draftsmith.eval.decoding.cost import Costs, choose_kstar
from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.kernels import kernels_in
from draftsmith.eval.decoding.proposal import DecodeContext, Sampling
from draftsmith.eval.decoding.proposers import Proposer
from draftsmith.eval.decoding.stats import DecodeStats
from draftsmith.eval.decoding.target_model import Target
from draftsmith.eval.machine import environment


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls (CUDA work is synchronised)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else None
    times = []
    for _ in range(repeats):
        if sync:
            sync(device)
        t0 = time.perf_counter()
        fn()
        if sync:
            sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def forward_costs(target: Target, widths: Sequence[int], repeats: int = 7,
                  token: int = 0) -> dict[int, float]:
    """Median seconds of one cached target forward over ``w`` new tokens, for each width ``w``.

    The target must already hold a context (after :meth:`Target.prefill`); the cache is left as
    it was. Width 1 is a plain decoding step; width ``K + 1`` verifies ``K`` drafts.
    """
    n = target.seq_len
    if n == 0:
        raise ValueError("forward_costs needs a prefilled target: the forwards attend to a context")

    def forward(w: int) -> None:
        target.extend(torch.full((w,), int(token), dtype=torch.long))
        target.crop(n)

    widths = sorted({int(w) for w in widths})
    for w in widths:  # warm-up: a packed linear's first call at a new row count builds its kernel
        forward(w)
    return {w: _median_time(lambda w=w: forward(w), repeats, target.device) for w in widths}


def _tree_parents(n: int, branching: int) -> torch.Tensor:
    """``(n,)`` parents of a full ``branching``-ary tree in breadth-first order (root's = -1)."""
    return torch.tensor([-1] + [(j - 1) // branching for j in range(1, n)], dtype=torch.long)


@torch.inference_mode()
def measure_costs(target: Target, proposer: Proposer, prompt_ids: Sequence[int], ks: Sequence[int],
                  repeats: int = 7, tree_nodes: Sequence[int] = (),
                  tree_branching: int = 4) -> dict[str, Any]:
    """Median costs on this machine with a context of ``prompt_ids``.

    Measures a plain step (target forward of 1 token with the cache), a target forward over
    ``K + 1`` tokens for each K (the pending token and K drafts), the proposer's time per drafted
    token (drafting ``max(ks)`` tokens, greedy) and, for each ``n`` in ``tree_nodes``, a target
    forward over a tree of ``n`` draft nodes plus the pending token (tree attention mask).

    Returns:
        ``{"t_ar": s, "t_draft": s, "t_verify": {K: s}, "t_verify_tree": {n: s}}``.
    """
    prompt = [int(t) for t in prompt_ids]
    out = target.prefill(torch.tensor(prompt))
    n = target.seq_len
    first = int(out.logits[-1].argmax())
    dev = target.device

    def forward_tree(nodes: int) -> None:
        parents = _tree_parents(nodes + 1, tree_branching)
        target.forward_tree(torch.full((nodes + 1,), first), parents)
        target.crop(n)

    t_fwd = forward_costs(target, [k + 1 for k in set(ks) | {0}], repeats, first)
    t_verify = {w - 1: t for w, t in t_fwd.items()}
    for m in sorted(set(tree_nodes)):  # warm-up, as for the widths
        forward_tree(m)
    t_tree = {m: _median_time(lambda m=m: forward_tree(m), repeats, dev)
              for m in sorted(set(tree_nodes))}
    k_max = max(max(ks), 1)
    ctx = DecodeContext(prompt + [first], Sampling(0.0))
    proposer.reset(list(ctx.tokens), out)
    row = out.select([out.logits.shape[0] - 1])  # stands in for the pending token's row

    def draft() -> None:
        # steady state: draft k_max, then reject everything and commit one token
        proposer.propose(ctx, k_max)
        proposer.accept([], [first], row)
        ctx.tokens.append(first)

    draft()  # warm-up, includes the proposer's own prefill
    t_draft = _median_time(draft, repeats, dev) / k_max
    return {"t_ar": t_verify[0], "t_draft": t_draft, "t_verify": t_verify, "t_verify_tree": t_tree}


def measure_speculation(target: Target, proposer: Proposer, prompts: Sequence[Sequence[int]],
                        k_max: int = 8, max_new_tokens: int = 64, temperature: float = 0.0,
                        repeats: int = 7, seed: int = 0,
                        tree_nodes: Sequence[int] = (), min_reached: int = 20) -> dict[str, Any]:
    """Measure alpha_i (decoder at fixed ``k_max``) and costs, choose K*; the ``speculation.json``.

    Args:
        target: the target wrapper (with the layers the proposer needs).
        proposer: the draft as a chain proposer (per-position alpha needs one draft per position).
        prompts: prompt token id lists.
        k_max: draft length of the measuring run and the largest K considered.
        max_new_tokens: tokens per prompt in the measuring run.
        temperature: sampling temperature of the measuring run.
        repeats: timing repetitions (medians are reported).
        seed: random seed.
        tree_nodes: tree sizes whose verify forward is also timed (``costs.t_verify_tree``).
        min_reached: a position's alpha is trusted (and K up to it considered) only when that
            position was reached at least this many times; later positions are reported in
            ``alpha_all`` with their counts but K* is not chosen from them.

    Returns:
        ``{"k_star", "alpha", "alpha_cumulative", "expected_speedup": {K: x}, "costs": {"t_ar",
        "t_draft", "t_verify": {K: s}, "t_verify_tree": {n: s}, ...}, "measured": {...},
        "proposer", "dtype", "hardware", "versions", "date"}`` (JSON-ready: keys are strings).
    """
    if not prompts:
        raise ValueError("measure_speculation needs at least one prompt")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1 to observe any acceptance, got {k_max}")
    dec = SpeculativeDecoder(target, proposer, k=k_max, adaptive=False, fallback=False)
    gen = torch.Generator().manual_seed(seed)
    runs = [dec.generate(p, max_new_tokens, temperature=temperature, generator=gen).stats
            for p in prompts]
    stats = DecodeStats.merge(runs)
    alpha_all = list(stats.alpha)
    if len(alpha_all) < k_max:
        raise ValueError(f"the measuring run reached only {len(alpha_all)} of {k_max} draft "
                         f"positions (the draft proposes at most {len(alpha_all)} tokens); use "
                         f"k_max <= {max(len(alpha_all), 1)}")
    # Conditional alphas of rarely reached positions are noise (or 0 when never reached): only
    # the prefix of positions reached often enough enters K*.
    trusted = 0
    while trusted < len(alpha_all) and stats.reached[trusted] >= min_reached:
        trusted += 1
    alpha = alpha_all[:max(trusted, 1)]
    costs = measure_costs(target, proposer, prompts[0], range(len(alpha) + 1), repeats, tree_nodes)
    k_star, speedup = choose_kstar(alpha, Costs(costs["t_ar"], costs["t_draft"], costs["t_verify"]))
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    return {"k_star": k_star, "expected_speedup": {str(k): v for k, v in speedup.items()},
            "alpha": alpha, "alpha_cumulative": stats.alpha_cumulative[:len(alpha)],
            "alpha_all": alpha_all, "alpha_min_reached": min_reached,
            "measured": {"k": k_max, "tau": stats.tau, "acceptance_rate": stats.acceptance_rate,
                         "reached": stats.reached, "tokens": stats.tokens_generated,
                         "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                         "temperature": temperature},
            "costs": {"t_ar": costs["t_ar"], "t_draft": costs["t_draft"],
                      "t_verify": {str(k): v for k, v in costs["t_verify"].items()},
                      "t_verify_tree": {str(k): v for k, v in costs["t_verify_tree"].items()},
                      "unit": "seconds", "statistic": f"median of {repeats}",
                      "context_tokens": len(prompts[0])},
            "proposer": proposer.name, "dtype": dtype, "kernels": kernels_in(target.model),
            **environment(target.device)}
