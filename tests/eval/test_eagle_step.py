"""The EAGLE head's fused decoding step (eval/decoding/eagle_step.py) computes what the head's
transformers modules compute: every layout, any query / key-value grouping and head width, tree
masks, biases, bf16, and int8, int4 and dynamic int8 weights; and the proposer drafts the same
trees with it."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.eagle_step import EagleStep
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.target_model import new_cache
from draftsmith.heads.eagle import build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.quantize import quantizable, quantize
from tests.conftest import tiny_llama

VOCAB = 64
LAYOUTS = {"eagle1": ("eagle1", None), "eagle1-fused": ("eagle1", [1, 2]),
           "normed": ("normed", None), "eagle3": ("eagle3", [0, 1, 2])}


def make_head(layout: str, bias: bool = False, scheme: str | None = None,
              **target: int) -> nn.Module:
    """A head on a tiny target (``target``: its shape); ``bias``: random biases on q, v and the
    MLP's gate (none on k: a fused bias fills it with zeros), which the engines' layout lacks."""
    kind, fuse = LAYOUTS[layout]
    model = tiny_llama(seed=0, vocab=VOCAB, **target)
    torch.manual_seed(1)
    head = build_eagle(EagleConfig(layout=kind, fuse_layers=fuse), model).eval()
    if bias:
        layer = head.layer
        for lin in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.gate_proj):
            lin.bias = nn.Parameter(torch.randn(lin.out_features))
    if scheme is not None:
        quantize(head, scheme, quantizable(head))
    return head


def calls(head: nn.Module) -> list[tuple]:
    """Committed pairs (target features, causal), a tree depth of three rows (own outputs, a
    mask with the prefix, an ancestor and self), then one row."""
    g = torch.Generator().manual_seed(2)
    h, k_h = head.hidden_size, head.fc.in_features - (0 if head.eagle3 else head.hidden_size)
    tree = torch.ones(3, 10, dtype=torch.bool)
    tree[:, 7:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    return [(torch.randn(1, 7, k_h, generator=g), torch.randint(0, VOCAB, (1, 7), generator=g),
             torch.arange(7)[None], None),
            (torch.randn(1, 3, h, generator=g), torch.randint(0, VOCAB, (1, 3), generator=g),
             torch.tensor([[7, 8, 8]]), tree),
            (torch.randn(1, 1, h, generator=g), torch.randint(0, VOCAB, (1, 1), generator=g),
             torch.tensor([[10]]), None)]


def both_paths(head: nn.Module, step: EagleStep) -> tuple[list, list]:
    """Each call's output by the modules and by the step, each on its own cache."""
    outs: tuple[list, list] = ([], [])
    for path, out in zip(("modules", "step"), outs):
        cache = new_cache()
        for feats, ids, pos, allowed in calls(head):
            with torch.inference_mode():
                if path == "step":
                    out.append(step(feats, ids, cache, pos, allowed))
                else:
                    mask = None if allowed is None else allowed[None, None]
                    out.append(head(feats, ids, past_key_values=cache, position_ids=pos,
                                    attention_mask=mask))
        out.append(cache.layers[0].keys.clone())  # the cache's keys after all calls
    return outs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bias", [False, True])
def test_the_step_computes_what_the_modules_compute(layout, bias):
    head = make_head(layout, bias)
    step = EagleStep.of(head)
    assert step is not None and step.qkv.kind == "dense" and step.group == 2
    assert (step.qkv.bias is not None) == bias
    ref, got = both_paths(head, step)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,group", [({"kv": 1}, 4), ({"kv": 4}, 1),
                                         ({"head_dim": 16}, 2)])
def test_any_grouping_and_head_width(shape, group):
    head = make_head("eagle3", **shape)
    step = EagleStep.of(head)
    assert step.group == group and step.head_dim == head.layer.self_attn.head_dim
    ref, got = both_paths(head, step)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_bf16_heads_match_too():
    head = make_head("eagle3", bias=True).to(torch.bfloat16)
    ref, got = both_paths(head, EagleStep.of(head))
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("scheme,kind", [("int8", "int8"), ("int4", "separate"),
                                         ("int8_dynamic", "separate")])
def test_quantized_heads_run_their_own_kernels(scheme, kind):
    head = make_head("eagle3", bias=True, scheme=scheme)
    step = EagleStep.of(head)
    assert step.qkv.kind == kind and step.gate_up.kind == kind
    ref, got = both_paths(head, step)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_twin_a_wrong_query_to_key_grouping_is_caught():
    # the comparison above must see a step whose query heads read the wrong key/value head:
    # swap query heads 1 and 2 (groups 0 and 1 of two) in the fused weights
    head = make_head("eagle3")
    step = EagleStep.of(head)
    d = step.head_dim
    w = step.qkv.weight.clone()
    w[d:2 * d], w[2 * d:3 * d] = step.qkv.weight[2 * d:3 * d], step.qkv.weight[d:2 * d]
    step.qkv.weight = w
    ref, got = both_paths(head, step)
    assert not torch.allclose(ref[0], got[0], atol=1e-3)


def test_heads_it_cannot_read_use_the_modules():
    assert EagleStep.of(nn.Linear(4, 4)) is None
    head = make_head("eagle3")
    head.layer.post_attention_layernorm = nn.LayerNorm(head.hidden_size)
    assert EagleStep.of(head) is None
    head = make_head("eagle3")
    head.layer.hidden_norm = nn.Identity()  # EAGLE-3 norms its input: not a layout it knows
    assert EagleStep.of(head) is None


@pytest.mark.parametrize("tree", [False, True])
def test_the_proposer_drafts_the_same_with_and_without_the_step(tree):
    model = tiny_llama(seed=0, vocab=VOCAB)
    torch.manual_seed(4)
    head = build_eagle(EagleConfig(layout="eagle3", fuse_layers=[0, 1, 2]), model).eval()
    drafted = {}
    for fused in (True, False):
        prop = EagleProposer(copy.deepcopy(head), VOCAB, tree=tree, topk=3, total_tokens=10,
                             fused=fused)
        assert (prop.step is not None) == fused
        seen = drafted[fused] = []
        propose = prop.propose

        def spy(ctx, k, propose=propose, seen=seen):
            p = propose(ctx, k)
            seen.append((p.tokens.tolist(), None if p.parents is None else p.parents.tolist()))
            return p

        prop.propose = spy
        dec = SpeculativeDecoder(model, prop, k=3, adaptive=False, fallback=False)
        out = dec.generate([1, 40, 41, 42, 43, 40, 41, 42, 43, 40], max_new_tokens=12)
        drafted[fused, "out"] = out.output_ids, out.stats.accepted
    assert drafted[True] and drafted[True] == drafted[False]
    assert drafted[True, "out"] == drafted[False, "out"]
