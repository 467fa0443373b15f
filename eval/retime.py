"""Re-time a ``speculation.json`` record measured on another machine (or dtype) before decoding.

A record carries two kinds of fact. Acceptance (alpha per position, tau of each tree shape) belongs
to the draft and the target and travels between machines; costs (a plain step, a verify forward
of ``n`` tokens, a drafted token) belong to the machine. They differ a great deal: a 16-token
verify of SmolLM2-135M costs 1.17 plain steps in bf16 on a CPU with AMX, 2.0-2.5 in fp32 and
7.5 in bf16 on a 2-core AVX2 CPU without bf16 instructions, where the release's measured depth-4
tree decoded at 0.36x of plain (bench/retime/). So unless the record proves it was measured here
(same CPU model, core and thread count, instruction-set features, device type and dtype),
:func:`replan` times this machine's costs on the first prompt (:func:`eval.kstar.measure_costs`,
a few seconds) and chooses again among the shapes the record measured:

- a chain of K drafts yields ``E_K`` tokens (from the record's alphas, :mod:`eval.decoding.cost`);
- a tree of depth ``d`` and ``n`` nodes yields the tau the record measured for it;
- a round costs its verify forward and ``K`` (or ``d``) drafted tokens timed here, plus the
  record's own measured per-round remainder (bookkeeping: measured round time less its modelled
  parts, in seconds); a plain step costs the forward timed here plus the record's remainder.

The shape with the highest predicted speedup wins; when none is predicted at least
:data:`MARGIN` times as fast as plain decoding, the run decodes plainly (K = 0) and drafts shadow
chains beside its plain steps (:mod:`eval.decoding.shadow`, :func:`shadow_for`): the draft's
acceptance on the prompts at hand, with the costs timed here, may still predict a chain at
:data:`MEASURED_MARGIN` or more, which is then drafted. A chain it drafts is judged the same
way on its verified rounds, and stops below 1.0x. ``retime=false`` keeps the record's choice.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from draftsmith.eval.decoding.cost import expected_tokens
from draftsmith.eval.decoding.shadow import Judge, Shadow
from draftsmith.eval.machine import environment

RETIME_MODES = ("auto", "true", "false")
# a shape must be predicted this much faster than plain decoding to be drafted. The cost side
# predicts well (SmolLM2 release, fp32, 2-core AVX2 CPU: a round 121 ms predicted, 119 measured),
# but tau comes from the record's own prompts: 2.62 there against 1.74 on MT-bench here, so that
# 1.29x predicted decoded at 0.89x. Where unsure, decode plainly.
MARGIN = 1.3
KEEP = 0.95  # the record's own shape stays while predicted within this fraction of the best
# with the acceptance measured on the prompts at hand (shadow drafts), only the costs are
# predicted, and they predict well: 1.18x predicted, 1.17x decoded (Qwen2.5-Coder release,
# MT-bench, fp32, bench/kernels/)
MEASURED_MARGIN = 1.1
# what must match for a record's costs to stand for this machine's
SAME_MACHINE_KEYS = ("cpu", "cpu_count", "torch_threads", "isa", "gpu")


class Shape(NamedTuple):
    """One drafting shape with its predicted speedup here: a chain (``nodes`` None) of ``k``
    drafts or a tree of depth ``k`` keeping ``nodes`` nodes."""

    k: int
    nodes: int | None
    tokens: float  # expected tokens a round commits (E_K, or the measured tau)
    speedup: float


def check_retime(value: Any) -> str:
    """``retime`` as one of :data:`RETIME_MODES` (YAML booleans allowed)."""
    text = str(value).lower()
    if text not in RETIME_MODES:
        raise ValueError(f"retime={value!r}: allowed auto (re-time a record measured on another "
                         "machine or dtype), true (always) or false (trust the record)")
    return text


def measured_here(record: Mapping, dtype: str, device: str,
                  kernels: str | None = None) -> bool:
    """Whether ``record`` was measured in ``dtype`` on this machine: same device, dtype,
    :data:`SAME_MACHINE_KEYS` and, given ``kernels``, the same target kernels (records older than
    prepacked kernels were measured with the default ones). A record without instruction-set
    features (older than them) cannot show it: CPU model names are shared by very different
    chips ("AMD EPYC")."""
    hw = record.get("hardware") or {}
    here = environment(device)["hardware"]
    if record.get("dtype") != dtype or "isa" not in hw:
        return False
    if kernels is not None and record.get("kernels", "default") != kernels:
        return False
    if torch.device(str(hw.get("device", "cpu"))) != torch.device(str(device)):
        return False
    return all(hw.get(key) == here.get(key) for key in SAME_MACHINE_KEYS)


def _remainders(record: Mapping) -> tuple[float, float]:
    """The record's seconds a round and a plain step cost beyond their modelled parts (verify
    forward and drafted tokens; the forward): medians over its measured tree grid, 0 without one."""
    costs, tree = record.get("costs") or {}, record.get("tree") or {}
    t_tree = {int(n): float(t) for n, t in (costs.get("t_verify_tree") or {}).items()}
    t_draft, t_ar = float(costs.get("t_draft", 0.0)), float(costs.get("t_ar", 0.0))
    rounds = [g["tau"] / g["tokens_per_s"] - t_tree[int(g["total_tokens"])]
              - int(g["depth"]) * t_draft for g in tree.get("grid") or ()
              if g.get("tokens_per_s") and int(g.get("total_tokens", -1)) in t_tree]
    base = tree.get("baseline_tokens_per_s")
    plain = 1.0 / base - t_ar if base and t_ar else 0.0
    return max(statistics.median(rounds), 0.0) if rounds else 0.0, max(plain, 0.0)


def tree_grid(record: Mapping) -> list[Mapping]:
    """The dynamic-tree shapes the record decoded with (depth, total_tokens, tau)."""
    return [g for g in (record.get("tree") or {}).get("grid") or ()
            if {"depth", "total_tokens", "tau"} <= set(g)]


def predict(record: Mapping, local: Mapping, trees: bool = True) -> list[Shape]:
    """Every shape the record measured, with its speedup predicted from ``local`` costs
    (:func:`eval.kstar.measure_costs`'s dict: ``t_ar``, ``t_draft``, ``t_verify`` per K,
    ``t_verify_tree`` per node count), best first. ``trees=False``: chains only."""
    round_rest, plain_rest = _remainders(record)
    plain = float(local["t_ar"]) + plain_rest
    t_draft = float(local["t_draft"])
    shapes = []
    alpha = [float(a) for a in record.get("alpha") or ()]
    for k, t_verify in local["t_verify"].items():
        if 1 <= int(k) <= len(alpha):
            tokens = expected_tokens(alpha, int(k))
            cost = int(k) * t_draft + float(t_verify) + round_rest
            shapes.append(Shape(int(k), None, tokens, tokens * plain / cost))
    for g in tree_grid(record) if trees else ():
        t_verify = local["t_verify_tree"].get(int(g["total_tokens"]))
        if t_verify is not None:
            cost = int(g["depth"]) * t_draft + float(t_verify) + round_rest
            shapes.append(Shape(int(g["depth"]), int(g["total_tokens"]), float(g["tau"]),
                                float(g["tau"]) * plain / cost))
    return sorted(shapes, key=lambda s: (-s.speedup, s.k, s.nodes or 0))


def describe(best: Shape | None, kept: bool = False) -> str:
    """The ``k_source`` of a re-timed choice (``kept``: the record's own shape)."""
    if best is None or best.speedup < MARGIN:
        shown = "" if best is None else f" (best {best.speedup:.2f}x)"
        return f"re-timed here: no measured shape predicted {MARGIN:g}x{shown}, plain decoding"
    shape = f"tree {best.nodes} nodes" if best.nodes else "chain"
    whose = "the record's " if kept else ""
    return f"re-timed here: {whose}{shape}, predicted {best.speedup:.2f}x"


def chosen(plan: Any, shapes: list[Shape]) -> tuple[Shape | None, bool]:
    """The shape to draft, best first, and whether it is the one the record chose (``plan``):
    that one stays while predicted at least :data:`MARGIN` and within :data:`KEEP` of the best,
    so that re-timing on the record's own machine changes nothing."""
    if not shapes:
        return None, False
    own = next((s for s in shapes if s.k == plan.k
                and s.nodes == (plan.tree_size if plan.tree else None)), None)
    if own is not None and own.speedup >= max(MARGIN, KEEP * shapes[0].speedup):
        return own, True
    return shapes[0], False


def monotone(local: Mapping) -> dict:
    """``local`` costs with each forward's time bounded by every wider forward's: feeding more
    tokens never costs less, so a narrower forward timed slower than a wider one was slowed by the
    machine, not by its width (one stall among three repeats made a 1-token forward of the 1.5B
    450 ms against 286 ms for two, and predicted 1.92x from a plain step 1.5x too slow). The
    plain step ``t_ar`` is the 1-token forward; a tree's forward is bounded by every larger
    tree's."""
    def bounded(times: Mapping) -> dict:
        out, bound = {}, float("inf")
        for key in sorted(times, reverse=True):
            bound = min(bound, float(times[key]))
            out[key] = bound
        return out

    t_verify = bounded(local["t_verify"])
    return {**local, "t_verify": t_verify, "t_ar": t_verify.get(0, local["t_ar"]),
            "t_verify_tree": bounded(local.get("t_verify_tree") or {})}


def shadow_judge(record: Mapping, local: Mapping, fill: bool = False) -> Judge:
    """The judge of shadow drafts: measured alphas -> the best chain (K, predicted speedup)
    from :func:`predict` with ``local`` costs and the record's remainders; (0, 0.0) when none is
    measured. ``fill``: positions past the measured ones take the record's alphas scaled by the
    measured first one against the record's (sampled decoding scores position 1 only)."""
    own = [float(a) for a in record.get("alpha") or ()]

    def judge(alpha: list[float]) -> tuple[int, float]:
        alpha = list(alpha)
        if fill and alpha and own and own[0] > 0:
            alpha += [min(1.0, a * alpha[0] / own[0]) for a in own[len(alpha):]]
        shapes = predict({**record, "alpha": alpha}, local, trees=False)
        return (shapes[0].k, shapes[0].speedup) if shapes else (0, 0.0)

    return judge


def shadow_for(record: Mapping, local: Mapping, shapes: list[Shape], temperature: float,
               watching: bool = True) -> Shadow | None:
    """The judge of the draft on the prompts at hand: for a run that re-timing sent to plain
    decoding, shadow drafting (greedy chains one longer than the best predicted chain, scored
    position by position; one draft when sampling); for one it sent to a chain (``watching``
    False), the verdicts on its verified rounds, and shadow drafting after a stop. None where
    even a draft that is always accepted would not reach :data:`MEASURED_MARGIN` here."""
    greedy = float(temperature) == 0
    chains = [s.k for s in shapes if s.nodes is None]
    depth = min(len(record.get("alpha") or ()), chains[0] + 1 if chains else 1) if greedy else 1
    judge = shadow_judge(record, local, fill=not greedy)
    if depth < 1 or judge([1.0] * depth)[1] < MEASURED_MARGIN:
        return None
    return Shadow(depth, judge, MEASURED_MARGIN, watching=watching)


def replan(cfg: Mapping[str, Any], pkg: Any, plan: Any, loaded: Any,
           prompt_ids: Sequence[int], record: Mapping
           ) -> tuple[Any, list[Shape], Shadow | None]:
    """``plan`` (a :class:`eval.draft.DraftSettings`) chosen again from ``record`` with this
    machine's costs, timed on ``prompt_ids``; the predicted shapes, best first; and, where the
    plan is plain decoding or a chain, the judge of the draft on these prompts (None: none;
    :func:`shadow_for`). Call it only where ``k`` and ``tree_size`` were left to the record;
    ``tree=chain`` / ``tree=tree`` limit the choice to chains / trees.
    """
    from draftsmith.eval.decoding.target_model import Target
    from draftsmith.eval.draft import build_proposer
    from draftsmith.eval.kstar import measure_costs
    from draftsmith.heads.family_base import TreeKind

    alpha = record.get("alpha") or ()
    mode = str(cfg.get("tree", "auto"))
    trees = pkg.family.tree is TreeKind.DYNAMIC and mode != "chain"
    nodes = sorted({int(g["total_tokens"]) for g in tree_grid(record)}) if trees else []
    vocab = int(loaded.model.config.vocab_size)
    chain = build_proposer(pkg, replace(plan, tree=False), loaded, vocab, str(cfg["device"]),
                           str(cfg["dtype"]), str(cfg.get("draft_kernels", "auto")))
    local = monotone(measure_costs(Target(loaded.model, chain.layer_ids), chain, prompt_ids,
                                   range(len(alpha) + 1), repeats=3, tree_nodes=nodes))
    shapes = predict(record, local, trees)
    widths = ", ".join(f"{int(k) + 1}: {t * 1e3:.0f}" for k, t in sorted(local["t_verify"].items()))
    trees_ms = ", ".join(f"{n}: {t * 1e3:.0f}" for n, t in sorted(local["t_verify_tree"].items()))
    print(f"timed here (ms): forward of w tokens {{{widths}}}, tree of n nodes {{{trees_ms}}}, "
          f"a drafted token {local['t_draft'] * 1e3:.1f}")
    if mode == "tree":  # the user asked for a tree: its depth and size are chosen here
        shapes = [s for s in shapes if s.nodes is not None]
        if not shapes:
            return plan, shapes, None
    best, kept = chosen(plan, shapes)
    source = describe(best, kept)
    if best is None or best.speedup < MARGIN:
        shadow = (None if mode == "tree" or not cfg.get("shadow", True)
                  else shadow_for(record, local, shapes, float(cfg.get("temperature") or 0.0)))
        if shadow is not None:
            source += f"; shadow drafts of {shadow.depth} judge the draft on these prompts"
        return replace(plan, k=0, tree=False, k_source=source), shapes, shadow
    if best.nodes is None:
        shadow = (shadow_for(record, local, shapes, float(cfg.get("temperature") or 0.0),
                             watching=False) if cfg.get("shadow", True) else None)
        if shadow is not None:
            source += "; judged on these prompts as it drafts"
        return replace(plan, k=best.k, tree=False, k_source=source), shapes, shadow
    return (replace(plan, k=best.k, tree=True, tree_size=best.nodes, k_source=source), shapes,
            None)
