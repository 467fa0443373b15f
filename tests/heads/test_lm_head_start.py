"""The reduced-vocabulary EAGLE LM head's start (``draft.config.lm_head``): the target's rows
trained (``copy``), those rows frozen (``frozen``, speculators' choice) or a fresh trained layer
(``random``, ModelOpt's and SpecForge's); each survives a save and load, and bad values are
refused with the fix."""
from __future__ import annotations

import pytest
import torch

from draftsmith.heads.eagle import EagleHead, build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from tests.conftest import tiny_llama

VOCAB, DRAFT_VOCAB = 96, 24


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, vocab=VOCAB)


def _head(target, start: str) -> EagleHead:
    counts = torch.arange(VOCAB, 0, -1, dtype=torch.float)  # id 0 most frequent
    torch.manual_seed(3)
    cfg = EagleConfig(draft_vocab_size=DRAFT_VOCAB, fuse_layers=[0, 1], layout="eagle3",
                      lm_head=start)
    return build_eagle(cfg, target, token_counts=counts)


def _target_rows(target, head: EagleHead) -> torch.Tensor:
    return target.get_output_embeddings().weight[head.d2t]


def _one_step(head: EagleHead) -> None:
    params = [p for p in head.parameters() if p.requires_grad]  # as train/distill.py selects
    opt = torch.optim.SGD(params, lr=0.5)
    h = torch.randn(2, 5, head.hidden_size)
    head.lm_head(head.norm(h)).square().mean().backward()
    head.fc.weight.grad = torch.ones_like(head.fc.weight)
    opt.step()


@pytest.mark.parametrize("start,trained", [("copy", True), ("frozen", False), ("random", True)])
def test_start_and_whether_a_step_moves_it(target, start, trained):
    head = _head(target, start)
    rows = _target_rows(target, head)
    if start == "random":
        assert not torch.allclose(head.lm_head.weight, rows)
    else:
        torch.testing.assert_close(head.lm_head.weight, rows)
    before, fc_before = head.lm_head.weight.detach().clone(), head.fc.weight.detach().clone()
    _one_step(head)
    assert not torch.equal(head.fc.weight, fc_before)
    assert torch.equal(head.lm_head.weight, before) is not trained
    assert head.lm_head.weight.requires_grad is trained


@pytest.mark.parametrize("start", ["frozen", "random"])
def test_saved_head_loads_back_with_its_lm_head(target, start):
    head = _head(target, start)
    state = head.trainable_state_dict()
    assert "lm_head.weight" in state  # frozen rows are the draft vocabulary's: saved with it
    fresh = EagleHead(head.cfg, target.config)
    fresh.load_trainable_state_dict(state)
    torch.testing.assert_close(fresh.lm_head.weight, head.lm_head.weight)
    assert fresh.lm_head.weight.requires_grad is (start != "frozen")


def test_bad_values_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="lm_head must be one of"):
        EagleConfig(draft_vocab_size=DRAFT_VOCAB, lm_head="zeros")
    with pytest.raises(ValueError, match="set draft.config.draft_vocab_size"):
        EagleConfig(lm_head="random")
