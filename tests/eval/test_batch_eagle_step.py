"""Batched EAGLE drafting (``BatchEagle``, eval/decoding/batch_drafters.py) runs the proposer's
fused step (eval/decoding/eagle_step.py) where it has one, and the head's modules otherwise, with
the same result: rows of different prompt lengths (per-row positions, padding and slot masks),
chains and EAGLE-2 trees, the eagle1 layout (on the target's last features and on fused target
layers) and the eagle3 layout, greedy, draft the same tokens and trees step by step, their hidden
outputs agree up to rounding, and the decoded rows are the same. Twins: the comparison sees a
step whose weight was perturbed, and a step given row 0's positions and mask for every row."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from draftsmith.eval.decoding.batch import BatchDecoder
from draftsmith.eval.decoding.eagle_step import EagleStep
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.heads.eagle import build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from tests.conftest import tiny_llama
from tests.eval.test_decoder import hf_greedy
from tests.eval.test_sampling_exact import _binary_llama

# target -> (vocabulary, prompts of four lengths, layers a head may fuse, new tokens); the
# 64-id target's drafts are rich but rarely accepted (its weights drawn wide enough that greedy
# decoding does not just repeat the last token), the binary one's are accepted by the rows
# unequally (the slots each row keeps differ)
TARGETS = {"v64": (64, [[1, 5, 9, 13, 5, 9], [1, 40, 41, 42, 43, 40, 41, 42, 43, 40], [1, 7],
                        [3, 1, 4, 1, 5, 9, 26, 53, 58, 9, 7, 9, 3, 23]], [1, 2], 12),
           "binary": (2, [[1, 0, 1], [0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1, 0, 1, 1], [0]], [0, 1],
                      16)}
HEADS = {"eagle1": ("eagle1", False), "eagle1-fused": ("eagle1", True),
         "eagle3": ("eagle3", True)}


def setup(target: str, head: str) -> tuple[nn.Module, nn.Module]:
    vocab, _, fuse, _ = TARGETS[target]
    model = (tiny_llama(seed=0, vocab=vocab, initializer_range=0.3) if target == "v64"
             else _binary_llama(seed=1))
    layout, fused_layers = HEADS[head]
    torch.manual_seed(4)
    cfg = EagleConfig(layout=layout, fuse_layers=fuse if fused_layers else None)
    return model, build_eagle(cfg, model).eval()


class CountingStep:
    """An :class:`EagleStep` that counts its calls (``inner``: the step itself, or a function
    of the same arguments wrapping it)."""

    def __init__(self, inner: EagleStep | Callable) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


@dataclass
class Run:
    """What one batched decode drafted and returned, and how its head ran."""
    drafts: list = field(default_factory=list)  # per proposal: each row's drafts (or tree)
    hidden: list = field(default_factory=list)  # per head call: its output (B, T, H)
    rows: list = field(default_factory=list)  # per row: (output ids, accepted per depth)
    step_calls: int = 0
    module_calls: int = 0


def decode(target: str, model: nn.Module, head: nn.Module, tree: bool, fused: bool,
           wrap: Callable[[EagleStep], Callable] | None = None) -> Run:
    """Greedy batched decoding of ``target``'s prompts with the head, fused step or modules
    (``wrap``: what the step is replaced by, around the proposer's own)."""
    vocab, prompts, _, new = TARGETS[target]
    prop = EagleProposer(head, vocab, tree=tree, topk=2, total_tokens=6, fused=fused)
    assert (prop.step is not None) == fused
    if fused:
        prop.step = CountingStep(prop.step if wrap is None else wrap(prop.step))
    dec = BatchDecoder(model, prop, k=3, fallback=False)
    drafter, run = dec.drafter, Run()
    head_run, propose, propose_tree = drafter._run, drafter.propose, drafter.propose_tree

    def spy_run(*args):
        run.hidden.append(head_run(*args))
        return run.hidden[-1]

    def spy_propose(*args):
        drafts, q = propose(*args)
        run.drafts.append(drafts.tolist())
        return drafts, q

    def spy_tree(*args):
        props = propose_tree(*args)
        run.drafts.append([(p.tokens.tolist(), p.parents.tolist()) for p in props])
        return props

    drafter._run, drafter.propose, drafter.propose_tree = spy_run, spy_propose, spy_tree
    hook = head.register_forward_pre_hook(lambda *_: setattr(run, "module_calls",
                                                             run.module_calls + 1))
    # the 64-id target ends row 2 early (its third token): the batch drops it, the rest go on
    eos = hf_greedy(model, prompts[2], 3, None)[2] if target == "v64" else None
    try:
        got = dec.generate(prompts, max_new_tokens=new, eos_token_id=eos)
    finally:
        hook.remove()
    run.rows = [(r.output_ids, r.stats.accepted_at) for r in got]
    run.step_calls = prop.step.calls if fused else 0
    return run


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("head_name", list(HEADS))
@pytest.mark.parametrize("target", list(TARGETS))
def test_batched_drafts_with_the_fused_step_equal_the_modules(target, head_name, tree):
    model, head = setup(target, head_name)
    fused = decode(target, model, head, tree, fused=True)
    modules = decode(target, model, head, tree, fused=False)
    # each path ran as it says: the step alone, or the modules alone
    assert fused.step_calls == len(fused.hidden) > 0 and fused.module_calls == 0
    assert modules.module_calls == len(modules.hidden) > 0
    assert fused.drafts and fused.drafts == modules.drafts
    assert fused.rows == modules.rows
    assert len(fused.hidden) == len(modules.hidden)
    for a, b in zip(fused.hidden, modules.hidden):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if target == "v64":  # rows 2, then 1 met the end of sequence and left the batch
        assert [len(ids) for ids, _ in fused.rows] == [12, 6, 3, 12]
    else:  # drafts were accepted
        assert sum(sum(acc) for _, acc in fused.rows) > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("head_name", ["eagle1", "eagle3"])
def test_the_binary_targets_rows_accept_unequally(head_name, tree):
    # so the equality above covers rows that keep different numbers of drafted slots
    model, head = setup("binary", head_name)
    rows = decode("binary", model, head, tree, fused=True).rows
    assert len({tuple(acc) for _, acc in rows}) > 1


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_twin_a_perturbed_step_weight_changes_the_drafts(tree):
    # the comparison above sees the step's own weights: flipping the order of the fused
    # gate/up rows (a copy the modules do not read) changes the drafts; decoding stays lossless
    model, head = setup("v64", "eagle3")
    modules = decode("v64", model, head, tree, fused=False)

    def perturbed(step: EagleStep) -> EagleStep:
        step.gate_up.weight = step.gate_up.weight.flip(0)
        return step

    bad = decode("v64", model, head, tree, fused=True, wrap=perturbed)
    assert bad.step_calls > 0 and bad.drafts != modules.drafts
    assert [ids for ids, _ in bad.rows] == [ids for ids, _ in modules.rows]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_twin_one_rows_positions_and_mask_for_all_rows_change_the_drafts(tree):
    # the rows' own positions and masks matter: a step given row 0's for every row drafts
    # differently from the modules (the prompts differ in length)
    model, head = setup("v64", "eagle1")
    modules = decode("v64", model, head, tree, fused=False)

    def row0(step: EagleStep) -> Callable:
        def call(feats, ids, cache, pos, allowed):
            return step(feats, ids, cache, pos[:1].expand_as(pos), allowed[:1].expand_as(allowed))
        return call

    bad = decode("v64", model, head, tree, fused=True, wrap=row0)
    assert bad.step_calls > 0 and bad.drafts != modules.drafts
