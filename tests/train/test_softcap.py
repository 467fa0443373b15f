"""The training teacher of a soft-capped target (Gemma 2's ``final_logit_softcapping``) is the
distribution its own forward gives: the cache's log-normaliser, the losses, the shared-row path
and the acceptance metric all cap the LM head's logits. Twins: without the cap each differs."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from draftsmith.data.teacher import logit_softcap, teacher_log_normalizer, teacher_logits
from draftsmith.train.losses import DistillLoss
from draftsmith.train.metrics import acceptance_stats
from draftsmith.train.teacher_probs import shared_teacher_rows, teacher_log_probs

CAP = 2.0  # small, so random logits reach it


@pytest.fixture(scope="module")
def gemma2():
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       final_logit_softcapping=CAP, query_pre_attn_scalar=16)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        ids = torch.tensor([[1, 5, 9, 14, 3, 22, 7, 40]])
        out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][0]  # (T, H) final-norm output
    return model, hidden, out.logits[0].float()


def test_teacher_logits_match_the_models_own_forward(gemma2):
    model, hidden, logits = gemma2
    cap = logit_softcap(model.config)
    assert cap == CAP
    w = model.get_output_embeddings().weight
    torch.testing.assert_close(teacher_logits(hidden, w, softcap=cap), logits,
                               atol=1e-5, rtol=1e-5)
    # twin: the uncapped head is another distribution
    assert (teacher_logits(hidden, w) - logits).abs().max() > 0.5


def test_log_normalizer_and_lse_path_use_the_cap(gemma2):
    model, hidden, logits = gemma2
    w = model.get_output_embeddings().weight
    lse = teacher_log_normalizer(hidden, w, softcap=CAP)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    assert (teacher_log_normalizer(hidden, w) - lse).abs().max() > 0.1  # twin
    # the reduced-vocabulary path (log p = capped draft rows - lse) equals the full softmax's rows
    d2t = torch.tensor([0, 3, 7, 11, 20])
    rows = [torch.arange(hidden.shape[0])]
    log_p, index = shared_teacher_rows(hidden, rows, w, 1.0, d2t, log_normalizer=lse,
                                       softcap=CAP)
    want = torch.log_softmax(logits, -1)[:, d2t]
    torch.testing.assert_close(log_p[index[0]], want, atol=1e-5, rtol=1e-5)
    full, index = shared_teacher_rows(hidden, rows, w, 1.0, softcap=CAP)
    torch.testing.assert_close(full[index[0]], torch.log_softmax(logits, -1), atol=1e-5,
                               rtol=1e-5)


def test_loss_and_alpha_of_the_exact_draft(gemma2):
    """A draft whose logits are the capped teacher's has zero forward KL and alpha 1; the
    uncapped teacher (the twin) sees a loss and alpha below 1."""
    model, hidden, logits = gemma2
    w = model.get_output_embeddings().weight
    student = logits[None].clone().requires_grad_(True)
    mask = torch.ones(1, hidden.shape[0], dtype=torch.bool)
    capped = DistillLoss({"fkl": 1.0}, softcap=CAP)
    loss = capped(student, None, mask, teacher_hidden=hidden[None], lm_head_weight=w)
    assert float(loss) < 1e-5
    uncapped = DistillLoss({"fkl": 1.0})
    assert float(uncapped(student, None, mask, teacher_hidden=hidden[None],
                          lm_head_weight=w)) > 1e-2
    stats = acceptance_stats(logits[None], mask, hidden[None], w, temperature=1.0, softcap=CAP)
    assert float(stats.alpha_sum) / float(stats.count) == pytest.approx(1.0, abs=1e-5)
    twin = acceptance_stats(logits[None], mask, hidden[None], w, temperature=1.0)
    assert float(twin.alpha_sum) / float(twin.count) < 0.99
    torch.testing.assert_close(teacher_log_probs(hidden, 1.0, w, softcap=CAP),
                               torch.log_softmax(logits, -1), atol=1e-5, rtol=1e-5)
