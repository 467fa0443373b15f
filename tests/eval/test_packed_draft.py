"""A draft packed for oneDNN (eval/draft.py packs a head's own linears where the target's are
packed, eval/decoding/kernels.py) computes what the plain head computes: the fused step's
concatenated weights, the head's other linears and a cut draft vocabulary all run packed, and a
target weight the head shares stays the target's."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from draftsmith.eval.decoding.eagle_step import EagleStep
from draftsmith.eval.decoding.kernels import (
    PackedLinear,
    apply_kernels,
    is_packed,
    packing_unsupported,
)
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.heads.quantize import quantize, record
from tests.eval.test_eagle_step import VOCAB, both_paths, make_head

pytestmark = pytest.mark.skipif(packing_unsupported(torch.float32, torch.device("cpu")) is not None,
                                reason="oneDNN cannot pack fp32 here")


def packed_copy(head: nn.Module) -> nn.Module:
    packed = copy.deepcopy(head)
    assert apply_kernels(packed, "packed")[0] == "packed"
    return packed


def cut_vocabulary_logits_agree(head: nn.Module, ids: torch.Tensor) -> tuple:
    """Proposers over ``ids`` with ``head`` and its packed copy, checked to give the same
    logits; returned (plain, packed)."""
    plain = EagleProposer(head, VOCAB, vocab_ids=ids)
    packed = EagleProposer(packed_copy(head), VOCAB, vocab_ids=ids)
    hidden = torch.randn(1, 4, head.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(packed._logits(hidden), plain._logits(hidden),
                                   atol=1e-5, rtol=1e-5)
    return plain, packed


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_a_packed_head_steps_as_the_plain_one(layout):
    head = make_head(layout, bias=True)
    packed = packed_copy(head)
    step = EagleStep.of(packed)
    assert is_packed(step.qkv.packed) and is_packed(step.gate_up.packed)
    assert isinstance(step.o_proj, PackedLinear) and isinstance(step.down, PackedLinear)
    ref = both_paths(head, EagleStep.of(head))[1]
    got_step, got_modules = both_paths(packed, step)[::-1]
    for a, b, c in zip(ref, got_step, got_modules):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


def test_twin_a_stale_packed_weight_is_caught():
    # the comparison above must see a fused step that multiplies by packed weights other than
    # the head's: pack a changed copy of q/k/v
    head = make_head("eagle3")
    step = EagleStep.of(packed_copy(head))
    step.qkv.packed = torch.ops.mkldnn._reorder_linear_weight(step.qkv.weight * 1.5, 16)
    ref, got = both_paths(head, EagleStep.of(head))[1], both_paths(head, step)[1]
    assert not torch.allclose(ref[0], got[0], atol=1e-3)


def test_a_cut_draft_vocabulary_is_packed_and_gives_the_same_logits():
    head = make_head("eagle3")
    plain, packed = cut_vocabulary_logits_agree(head, torch.arange(0, VOCAB, 3))
    assert is_packed(packed._sub_head) and not is_packed(plain._sub_head)


def test_an_int8_heads_cut_vocabulary_is_packed_from_its_dequantized_rows():
    # as scripts/quantize.py leaves a release: int8 layers and LM head, the fc in 16 bits
    head = make_head("eagle3")
    quantize(head, "int8", record(head, "int8", ("fc",))["modules"])
    _, packed = cut_vocabulary_logits_agree(head, torch.arange(1, VOCAB, 2))
    assert isinstance(packed.head.fc, PackedLinear) and is_packed(packed._sub_head)


def test_kv_rows_of_a_packed_fused_weight_are_packed_anew():
    head = make_head("eagle3")
    step = EagleStep.of(packed_copy(head))
    kv = step.qkv.tail(1)
    x = torch.randn(5, step.qkv.weight.shape[1])
    with torch.inference_mode():
        for a, b in zip(kv(x), step.qkv(x)[1:]):
            torch.testing.assert_close(a, b)


def test_a_weight_shared_with_the_target_is_not_packed():
    head = make_head("eagle3")
    shared = head.layer.mlp.down_proj.weight
    apply_kernels(head, "packed", shared=(shared,))
    assert type(head.layer.mlp.down_proj) is nn.Linear
    assert head.layer.mlp.down_proj.weight is shared
    assert isinstance(head.layer.mlp.up_proj, PackedLinear)


@pytest.mark.real
def test_the_release_is_packed_where_the_target_is_and_drafts_the_same(real_target, monkeypatch):
    # build_proposer packs the head's own linears when the target's are packed (draft_kernels
    # auto; the probe forced to prefer packing, as it measures on an AVX-512 / AMX CPU), and
    # leaves them with draft_kernels=default; both decode the same tokens and accept as many
    # drafts, up to a near tie that packing's rounding could flip
    from dataclasses import replace
    from pathlib import Path

    from draftsmith.eval.decoding import kernels
    from draftsmith.eval.decoding.decoder import SpeculativeDecoder
    from draftsmith.eval.decoding.kernels import kernels_in
    from draftsmith.eval.draft import build_proposer, load_draft, settle
    from draftsmith.eval.session import encode_prompt

    monkeypatch.setattr(kernels, "probe", lambda linear: {"rows": [1, 8], "default": [2.0, 2.0],
                                                          "packed": [1.0, 1.0]})
    target = replace(real_target, model=copy.deepcopy(real_target.model).float().eval())
    apply_kernels(target.model, "packed")
    release = Path(__file__).resolve().parents[2] / "releases/eagle3-smollm2-135m"
    vocab = int(target.model.config.vocab_size)
    got = {}
    for how in ("auto", "default"):
        pkg = load_draft(release, target)
        plan = settle({"k": 3, "tree": "chain", "tree_topk": 8, "tree_size": 16,
                       "medusa_branching": None, "draft_vocab": 8192, "device": "cpu",
                       "dtype": "float32"}, pkg, measured=False)
        eagle = build_proposer(pkg, plan, target, vocab, draft_kernels=how)
        assert kernels_in(eagle.head) == ("packed" if how == "auto" else "default")
        assert is_packed(eagle._sub_head) == (how == "auto")
        dec = SpeculativeDecoder(target.model, eagle, k=3, adaptive=False, fallback=False)
        out = dec.generate(encode_prompt(target.tokenizer, "Write a haiku about rain."),
                           max_new_tokens=24)
        got[how] = out.output_ids, out.stats.accepted
    assert got["auto"][0] == got["default"][0]
    assert got["default"][1] > 0 and abs(got["auto"][1] - got["default"][1]) <= 2, got
