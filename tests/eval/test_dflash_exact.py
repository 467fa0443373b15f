"""Exactness of sampled decoding with a DFlash drafter: the decoder's outputs must follow the
target's warped distribution over whole outputs (chi-square, the binary-vocabulary setup of
``tests/eval/test_sampling_exact.py``: 6 new tokens, 64 outcomes, K = 3 = the block's B-1 slots).

Each slot's draft is drawn from that slot's own distribution and verified with it. The twin
verifies slot k against slot k-1's distribution (q rows shifted by one) and must fail: the
drafter is seeded so that neighbouring slots disagree strongly (one slot near token 0, the next
near token 1), else a shifted q would look right by accident.
"""
from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposal import Proposal
from draftsmith.eval.decoding.proposers_dflash import DFlashProposer
from draftsmith.heads.family import get_family
from tests.eval.test_sampling_exact import (
    DEEP_K,
    DEEP_NEW,
    DEEP_PROMPT,
    DEEP_SAMPLES,
    DEEP_SETTINGS,
    DEEP_V,
    _binary_llama,
    _deep_exact,
    chi_square_p,
)


class SlotShiftedQ(DFlashProposer):
    """The broken twin: slot k's draft is verified against slot k-1's distribution (slot 1 keeps
    its own), as a proposer that misaligns its q rows by one would."""

    def propose(self, ctx, k):
        prop = super().propose(ctx, k)
        if prop.q is None or len(prop) < 2:
            return prop
        return Proposal(prop.tokens, prop.parents, torch.cat([prop.q[:1], prop.q[:-1]]))


def _drafter(model):
    """A DFlash drafter of block 4 (3 drafts) on the binary target, its trainable weights moved
    by seeded noise (scale 2) so that neighbouring slots draft from very different laws."""
    family = get_family("dflash")
    cfg = family.head_config({"block_size": DEEP_K + 1, "fuse_layers": [0, 1],
                              "mask_token_id": 0}, model.config)
    drafter = family.build(cfg, model)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 2.0)
    return drafter.eval()


def _p_value(setting: dict, proposer_class=DFlashProposer) -> float:
    model = _binary_llama(seed=1)
    dec = SpeculativeDecoder(model, proposer_class(_drafter(model), DEEP_V), k=DEEP_K,
                             adaptive=False, fallback=False)
    g = torch.Generator().manual_seed(0)
    outs, deepest, reached_3, accepted = [], 0, 0, 0
    for _ in range(DEEP_SAMPLES):
        res = dec.generate(DEEP_PROMPT, max_new_tokens=DEEP_NEW, generator=g, **setting)
        assert len(res.output_ids) == DEEP_NEW
        outs.append(int("".join(map(str, res.output_ids)), DEEP_V))
        deepest = max(deepest, len(res.stats.reached))
        reached_3 += res.stats.reached[2] if len(res.stats.reached) > 2 else 0
        accepted += res.stats.accepted
    assert deepest == DEEP_K  # three slots drafted, not capped
    assert reached_3 > DEEP_SAMPLES // 4  # and the third slot was decided often
    assert 0 < accepted < DEEP_SAMPLES * DEEP_NEW  # with acceptances and rejections
    return chi_square_p(torch.tensor(outs), _deep_exact(model, setting))


def test_the_drafters_neighbouring_slots_disagree():
    """What makes the twin meaningful: the block's slots draft from clearly different laws."""
    from draftsmith.eval.decoding.target_model import Target

    model = _binary_llama(seed=1)
    drafter = _drafter(model)
    proposer = DFlashProposer(drafter, DEEP_V)
    target = Target(model, proposer.layer_ids)
    proposer.reset(DEEP_PROMPT + [1], target.prefill(torch.tensor(DEEP_PROMPT)))
    pos = torch.arange(len(DEEP_PROMPT), len(DEEP_PROMPT) + DEEP_K + 1)[None]
    with torch.no_grad():
        hidden = drafter.block_hidden(drafter.block_ids(torch.tensor([[1]])), pos,
                                      proposer.cache)
        q = torch.softmax(drafter.compute_logits(hidden)[0, 1:], -1)  # slots 1..3
    assert float((q[1:] - q[:-1]).abs().max()) > 0.5


@pytest.mark.parametrize("setting", DEEP_SETTINGS, ids=["T0.7", "T1.0"])
def test_dflash_sampling_is_exact(setting):
    assert _p_value(setting) > 0.01


def test_twin_slot_k_verified_with_slot_k_minus_1s_q_fails():
    p = _p_value(DEEP_SETTINGS[1], SlotShiftedQ)
    assert p < 1e-3, f"verifying slot k against slot k-1's q passed the exactness test: p = {p:.3g}"
