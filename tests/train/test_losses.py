"""Distillation losses and acceptance metrics against hand-written formulas."""
from __future__ import annotations

import math

import pytest
import torch

from draftsmith.train.losses import LOSS_TERMS, DistillLoss, feature_regression
from draftsmith.train.metrics import acceptance_stats, expected_acceptance, top1_agreement
from draftsmith.train.teacher_probs import teacher_log_probs

P = [0.5, 0.25, 0.15, 0.1]
Q = [0.1, 0.2, 0.3, 0.4]


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().view(1, 1, -1)  # (1, 1, V)


def _one() -> torch.Tensor:
    return torch.ones(1, 1, dtype=torch.bool)


def _kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def test_each_term_matches_its_formula_on_hand_made_distributions():
    zp, zq, m = _logits(P), _logits(Q), _one()
    assert DistillLoss({"fkl": 1.0})(zq, zp, m).item() == pytest.approx(_kl(P, Q), rel=1e-5)
    assert DistillLoss({"rkl": 1.0})(zq, zp, m).item() == pytest.approx(_kl(Q, P), rel=1e-5)
    tvd_hand = 1 - sum(min(a, b) for a, b in zip(P, Q))
    assert DistillLoss({"tvd": 1.0})(zq, zp, m).item() == pytest.approx(tvd_hand, rel=1e-5)
    assert tvd_hand == pytest.approx(0.5 * sum(abs(a - b) for a, b in zip(P, Q)))
    for beta in (0.1, 0.5, 0.9):
        mix = [beta * a + (1 - beta) * b for a, b in zip(P, Q)]
        want = beta * _kl(P, mix) + (1 - beta) * _kl(Q, mix)
        got = DistillLoss({"jsd": 1.0}, beta=beta)(zq, zp, m).item()
        assert got == pytest.approx(want, rel=1e-5)
    # teacher argmax is id 0; data token 2
    assert DistillLoss({"ce": 1.0})(zq, zp, m).item() == pytest.approx(-math.log(Q[0]))
    got = DistillLoss({"ce_data": 1.0})(zq, zp, m, labels=torch.tensor([[2]])).item()
    assert got == pytest.approx(-math.log(Q[2]), rel=1e-6)


def test_temperature_applies_to_teacher_and_student():
    zp, zq, m, tau = _logits(P), _logits(Q), _one(), 2.0

    def soft(z: torch.Tensor) -> list[float]:
        return torch.softmax(z.view(-1) / tau, -1).tolist()

    got = DistillLoss({"fkl": 1.0}, temperature=tau)(zq, zp, m).item()
    assert got == pytest.approx(_kl(soft(zp), soft(zq)), rel=1e-5)
    assert got != pytest.approx(_kl(P, Q), rel=1e-2)


def test_tvd_equals_one_minus_expected_acceptance():
    g = torch.Generator().manual_seed(0)
    zp, zq = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    alpha = expected_acceptance(zp.softmax(-1), zq.softmax(-1), mask)
    assert DistillLoss({"tvd": 1.0})(zq, zp, mask).item() == pytest.approx(1 - alpha.item(),
                                                                           abs=1e-6)


@pytest.mark.parametrize("term", ["fkl", "rkl", "tvd", "jsd"])
def test_divergences_are_zero_iff_distributions_match(term):
    g = torch.Generator().manual_seed(1)
    zp = torch.randn(2, 6, 13, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    loss = DistillLoss({term: 1.0})
    same = loss(zp + 3.0, zp, mask)  # a shift leaves softmax unchanged
    assert abs(same.item()) < 1e-6
    other = loss(zp + 0.5 * torch.randn(2, 6, 13, generator=g), zp, mask)
    assert other.item() > 1e-4


def test_mask_ignores_entries_and_averages_over_the_rest():
    g = torch.Generator().manual_seed(2)
    zp, zq = torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 7, generator=g)
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    loss = DistillLoss({"fkl": 1.0})
    full = loss(zq, zp, mask)
    zq2 = zq.clone()
    zq2[~mask] = 100 * torch.randn(int((~mask).sum()), 7)
    assert loss(zq2, zp, mask).item() == pytest.approx(full.item(), rel=1e-6)
    each = [_kl(zp[b, t].softmax(-1).tolist(), zq[b, t].softmax(-1).tolist())
            for b, t in mask.nonzero().tolist()]
    assert full.item() == pytest.approx(sum(each) / 3, rel=1e-5)
    assert loss(zq, zp, torch.zeros_like(mask)).item() == 0.0


def test_hidden_plus_lm_head_in_chunks_equals_logits_with_same_gradients():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 9, 5, generator=g), torch.randn(17, 5, generator=g)
    zs = torch.randn(2, 9, 17, generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.2
    weights = {"fkl": 1.0, "tvd": 0.5, "jsd": 0.3, "rkl": 0.2, "ce": 0.1}
    ref_in = zs.clone().requires_grad_(True)
    ref = DistillLoss(weights, temperature=0.7)(ref_in, hidden @ weight.T, mask)
    ref.backward()
    chunk_in = zs.clone().requires_grad_(True)
    got, parts = DistillLoss(weights, temperature=0.7, chunk_size=2).forward_with_parts(
        chunk_in, None, mask, teacher_hidden=hidden, lm_head_weight=weight)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(chunk_in.grad, ref_in.grad, atol=1e-6)
    assert got.item() == pytest.approx(sum(weights[k] * parts[k].item() for k in weights), rel=1e-5)


def test_reduced_vocab_teacher_renormalised_or_mass_outside_counted():
    zp = _logits(P)  # target vocab of 4
    d2t = torch.tensor([1, 3])  # draft vocab = target ids 1 and 3
    zq = torch.tensor([0.6, 0.4]).log().view(1, 1, 2)
    m = _one()
    outside = DistillLoss({"tvd": 1.0})(zq, zp, m, draft_to_target=d2t).item()
    assert outside == pytest.approx(1 - (min(0.25, 0.6) + min(0.1, 0.4)), rel=1e-5)
    renorm = DistillLoss({"tvd": 1.0}, renormalize=True)(zq, zp, m, draft_to_target=d2t).item()
    pr = [0.25 / 0.35, 0.1 / 0.35]
    assert renorm == pytest.approx(1 - (min(pr[0], 0.6) + min(pr[1], 0.4)), rel=1e-5)
    fkl = DistillLoss({"fkl": 1.0}, renormalize=True)(zq, zp, m, draft_to_target=d2t).item()
    assert fkl == pytest.approx(_kl(pr, [0.6, 0.4]), rel=1e-5)
    # data labels are target ids: id 3 is draft id 1; id 0 is outside and skipped
    ce = DistillLoss({"ce_data": 1.0})
    got = ce(zq.expand(1, 2, 2), zp.expand(1, 2, 4), torch.ones(1, 2, dtype=torch.bool),
             draft_to_target=d2t, labels=torch.tensor([[3, 0]])).item()
    assert got == pytest.approx(-math.log(0.4), rel=1e-5)
    lp = teacher_log_probs(zp, 1.0, draft_to_target=d2t)
    assert lp.exp().sum().item() == pytest.approx(0.35, rel=1e-5)


def test_feature_regression_is_masked_smooth_l1():
    pred = torch.tensor([[[0.0, 2.0], [5.0, 5.0]]], requires_grad=True)
    target = torch.tensor([[[0.5, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, False]])
    # smooth L1 (beta 1): 0.5*0.5^2 = 0.125 and |2|-0.5 = 1.5 -> mean over H = 0.8125
    got = feature_regression(pred, target, mask)
    assert got.item() == pytest.approx(0.8125)
    got.backward()
    assert pred.grad[0, 0].tolist() == [-0.25, 0.5] and pred.grad[0, 1].tolist() == [0.0, 0.0]
    far = pred.detach().clone()
    far[0, 1] = 1e6  # a masked-out entry changes nothing
    assert feature_regression(far, target, mask).item() == pytest.approx(0.8125)
    assert feature_regression(far, target, torch.zeros_like(mask)).item() == 0.0
    two = feature_regression(pred.detach(), target, torch.ones_like(mask)).item()
    assert two == pytest.approx((0.8125 + 4.5) / 2)  # |5| - 0.5 on both features of entry 2
    with pytest.raises(ValueError, match="must be"):
        feature_regression(pred.detach(), target[..., :1], mask)


def test_loss_terms_are_the_ones_the_config_allows():
    """One list: DistillLoss and the config validator accept the same terms, and the feature
    regression is not one of them (the recipe adds it with draft.feature_weight)."""
    from draftsmith.train import config

    assert config.LOSS_TERMS is LOSS_TERMS and "feature" not in LOSS_TERMS
    for term in LOSS_TERMS:
        DistillLoss({term: 1.0})
    with pytest.raises(ValueError, match="unknown loss terms"):
        DistillLoss({"feature": 1.0})


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown loss terms"):
        DistillLoss({"kl": 1.0})
    with pytest.raises(ValueError, match="JSD beta"):
        DistillLoss({"jsd": 1.0}, beta=1.0)
    with pytest.raises(ValueError, match="temperature"):
        DistillLoss({"tvd": 1.0}, temperature=0)
    with pytest.raises(ValueError, match="either as teacher_logits"):
        DistillLoss({"tvd": 1.0})(torch.zeros(1, 1, 3), None, _one())
    with pytest.raises(ValueError, match="lm_head_weight"):
        DistillLoss({"tvd": 1.0})(torch.zeros(1, 1, 3), None, _one(),
                                  teacher_hidden=torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="labels"):
        DistillLoss({"ce_data": 1.0})(torch.zeros(1, 1, 3), torch.zeros(1, 1, 3), _one())


def test_metrics_on_hand_made_distributions():
    p = torch.tensor([[P, Q]])
    q = torch.tensor([[Q, Q]])
    mask = torch.tensor([[True, True]])
    alpha = expected_acceptance(p, q, mask).item()
    assert alpha == pytest.approx((sum(min(a, b) for a, b in zip(P, Q)) + 1.0) / 2)
    assert top1_agreement(p, q, mask).item() == pytest.approx(0.5)
    assert top1_agreement(p, q, torch.tensor([[False, True]])).item() == 1.0


def test_acceptance_stats_from_hidden_greedy_and_reduced_vocab():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(2, 6, 5, generator=g), torch.randn(12, 5, generator=g)
    zq = torch.randn(2, 6, 12, generator=g)
    mask = torch.rand(2, 6, generator=g) > 0.3
    p = torch.softmax(hidden @ weight.T / 0.8, -1)
    q = torch.softmax(zq / 0.8, -1)
    st = acceptance_stats(zq, mask, hidden, weight, temperature=0.8, chunk_size=4)
    assert st.alpha == pytest.approx(expected_acceptance(p, q, mask).item(), rel=1e-5)
    assert st.top1 == pytest.approx(top1_agreement(p, q, mask).item())
    greedy = acceptance_stats(zq, mask, hidden, weight, temperature=0.0)
    assert greedy.alpha == pytest.approx(st.top1)
    d2t = torch.tensor([0, 4, 7])
    zr = zq[..., d2t]
    red = acceptance_stats(zr, mask, hidden, weight, temperature=0.8, draft_to_target=d2t)
    qr = torch.softmax(zr / 0.8, -1)
    want = torch.minimum(p[..., d2t], qr).sum(-1)[mask].mean().item()
    assert red.alpha == pytest.approx(want, rel=1e-5)
    assert red.alpha < 1 - (1 - p[..., d2t].sum(-1))[mask].mean().item() + 1e-6


def test_acceptance_stats_scores_only_masked_rows_a_chunk_at_a_time(monkeypatch):
    """The teacher's full-vocabulary block is at most chunk_size rows, masked rows only: a
    (B, T) chunk of a 152k vocabulary held gigabytes per validation batch."""
    from draftsmith.train import metrics

    seen, real = [], metrics.teacher_log_probs
    monkeypatch.setattr(metrics, "teacher_log_probs",
                        lambda t, *a, **k: seen.append(tuple(t.shape)) or real(t, *a, **k))
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(4, 10, 5, generator=g), torch.randn(12, 5, generator=g)
    zq, mask = torch.randn(4, 10, 12, generator=g), torch.zeros(4, 10, dtype=torch.bool)
    mask[:, 7:] = True  # 12 counted rows of 40
    st = acceptance_stats(zq, mask, hidden, weight, temperature=1.0, chunk_size=5)
    assert seen == [(5, 5), (5, 5), (2, 5)]
    p, q = torch.softmax(hidden @ weight.T, -1), torch.softmax(zq, -1)
    assert st.alpha == pytest.approx(expected_acceptance(p, q, mask).item(), rel=1e-5)


def test_acceptance_sums_from_logits():
    g = torch.Generator().manual_seed(5)
    zp, zq = torch.randn(2, 5, 9, generator=g), torch.randn(2, 5, 9, generator=g)
    mask = torch.rand(2, 5, generator=g) > 0.4
    a, t, n = (float(v) for v in acceptance_stats(zq, mask, teacher_logits=zp, temperature=1.0))
    assert n == float(mask.sum())
    want = expected_acceptance(zp.softmax(-1), zq.softmax(-1), mask).item() * n
    assert a == pytest.approx(want, rel=1e-5)
    assert t == pytest.approx(top1_agreement(zp, zq, mask).item() * n)


def test_tvd_equals_the_rejection_rate_of_the_decoders_verifier():
    """TVD loss = 1 - the acceptance rate that eval.decoding.verify actually realises (K = 1
    chains)."""
    from draftsmith.eval.decoding.verify import verify_chain_batch

    torch.manual_seed(0)
    zp, zq = torch.randn(1, 1, 12) * 2, torch.randn(1, 1, 12) * 2
    p, q = zp.softmax(-1)[0, 0], zq.softmax(-1)[0, 0]
    n = 200_000
    gen = torch.Generator().manual_seed(1)
    draft = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=gen)  # (n, 1)
    accepted, _ = verify_chain_batch(torch.stack([p, p]).expand(n, 2, 12), q.expand(n, 1, 12),
                                     draft, gen)
    rate = accepted.float().mean().item()
    tvd = DistillLoss({"tvd": 1.0})(zq, zp, torch.ones(1, 1, dtype=torch.bool)).item()
    sigma = (rate * (1 - rate) / n) ** 0.5
    assert abs((1 - tvd) - rate) < 4 * sigma, (1 - tvd, rate, sigma)


# ----- the fast path: one teacher per token, forward KL with its gradient written out -----------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_kl_equals_autograd_through_log_softmax(temperature, dtype):
    from draftsmith.train.losses import forward_kl, fused_forward_kl

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(6, 40, generator=g) * 3).to(dtype)
    log_p = torch.log_softmax(torch.randn(6, 50, generator=g) * 2, -1)[:, :40]  # restricted
    a = z.clone().requires_grad_()
    b = z.clone().requires_grad_()
    weights = torch.rand(6, generator=g)
    got = fused_forward_kl(a, log_p, temperature)
    (got * weights).sum().backward()
    want = forward_kl(log_p, torch.log_softmax(b.float() / temperature, -1))
    (want * weights).sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=1e-6 if dtype == torch.float32
                          else 1e-2)
    assert a.grad.dtype == dtype


def test_fused_forward_kl_leaves_fp32_logits_untouched():
    from draftsmith.train.losses import fused_forward_kl

    z = torch.randn(3, 10)
    before = z.clone()
    fused_forward_kl(z, torch.log_softmax(torch.randn(3, 10), -1))
    assert torch.equal(z, before)


def test_fused_kl_gradient_check_catches_a_wrong_gradient(monkeypatch):
    """Twin: the comparison above fails when the hand-written backward drops the mass factor
    (correct only for an unrestricted teacher)."""
    from draftsmith.train import losses

    def broken(ctx, grad):
        q, p, _ = ctx.saved_tensors
        return (q - p).mul_(grad[:, None] / ctx.temperature).to(ctx.z_dtype), None, None

    monkeypatch.setattr(losses._ForwardKL, "backward", staticmethod(broken))
    z = torch.randn(4, 30, requires_grad=True)
    log_p = torch.log_softmax(torch.randn(4, 60), -1)[:, :30]  # mass well below 1
    losses.fused_forward_kl(z, log_p).sum().backward()
    z2 = z.detach().clone().requires_grad_()
    losses.forward_kl(log_p, torch.log_softmax(z2, -1)).sum().backward()
    assert not torch.allclose(z.grad, z2.grad, atol=1e-3)


def test_distill_loss_fused_and_reference_agree_with_every_teacher_form():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=g)
    w = torch.randn(30, 8, generator=g)
    d2t = torch.tensor([0, 3, 4, 7, 9, 12, 20, 29])
    student = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    mask = torch.rand(2, 5, generator=g) > 0.3
    ref = DistillLoss({"fkl": 1.0, "tvd": 0.5}, temperature=0.8, fused=False)
    fast = DistillLoss({"fkl": 1.0, "tvd": 0.5}, temperature=0.8)
    want = ref(student, None, mask, teacher_hidden=hidden, lm_head_weight=w, draft_to_target=d2t)
    logp = teacher_log_probs(hidden, 0.8, w, d2t)
    got = fast(student, None, mask, teacher_logp=logp, draft_to_target=d2t)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    with pytest.raises(ValueError, match="exactly one way"):
        fast(student, None, mask, teacher_hidden=hidden, lm_head_weight=w, teacher_logp=logp)


def test_shared_teacher_computes_each_row_once_and_matches_per_position_teachers(monkeypatch):
    from draftsmith.train import teacher_probs

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, 8, generator=g)
    w = torch.randn(30, 8, generator=g)
    d2t = torch.tensor([1, 2, 5, 8, 13])
    rows = [torch.tensor([0, 1, 2, 5]), torch.tensor([1, 2, 3, 6]), torch.tensor([2, 3, 4, 7])]
    seen = []
    real = teacher_probs.teacher_log_probs

    def counting(teacher, *args, **kw):
        seen.append(teacher.shape[0])
        return real(teacher, *args, **kw)

    monkeypatch.setattr(teacher_probs, "teacher_log_probs", counting)
    shared = teacher_probs.shared_teacher_log_probs(hidden, rows, w, 0.9, d2t, chunk_size=3)
    assert sum(seen) == 8  # the distinct rows 0..7, not 12
    for r, got in zip(rows, shared):
        assert torch.allclose(got, real(hidden[r], 0.9, w, d2t), atol=1e-6)


def test_shared_teacher_with_the_cached_normaliser_needs_only_the_draft_rows(monkeypatch):
    """With the cache's log-normaliser the teacher over a reduced vocabulary is the draft rows'
    logits minus it: no vocabulary-wide softmax runs, and the log-probs are the same. Twin: a
    normaliser one row off gives other log-probs."""
    from draftsmith.train import teacher_probs

    g = torch.Generator().manual_seed(3)
    hidden, w = torch.randn(12, 8, generator=g), torch.randn(30, 8, generator=g)
    d2t = torch.tensor([1, 2, 5, 8, 13])
    rows = [torch.tensor([0, 1, 2, 5]), torch.tensor([1, 2, 3, 6]), torch.tensor([2, 3, 4, 7])]
    lse = torch.logsumexp(hidden @ w.T, dim=-1)
    want = teacher_probs.shared_teacher_log_probs(hidden, rows, w, 1.0, d2t)
    # the full-vocabulary path is not run
    monkeypatch.setattr(teacher_probs, "teacher_log_probs", None)
    got = teacher_probs.shared_teacher_log_probs(hidden, rows, w, 1.0, d2t, log_normalizer=lse)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    off = teacher_probs.shared_teacher_log_probs(hidden, rows, w, 1.0, d2t,
                                                 log_normalizer=lse.roll(1))
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(off, want))


def test_ce_data_with_shared_teacher_and_reduced_vocab_equals_the_hidden_path():
    """Teacher log-probs over a reduced vocabulary do not tell the target's vocabulary size; the
    data-label CE still maps target-id labels to draft ids (outside ids skipped)."""
    g = torch.Generator().manual_seed(6)
    hidden, w = torch.randn(1, 6, 8, generator=g), torch.randn(30, 8, generator=g)
    d2t = torch.tensor([0, 3, 4, 7, 9, 12, 20, 29])
    student = torch.randn(1, 6, 8, generator=g)
    labels = torch.tensor([[3, 29, 1, 7, 0, 28]])  # 1 and 28 are not draft ids
    loss = DistillLoss({"ce_data": 1.0, "fkl": 0.5}, temperature=0.9)
    want, want_parts = loss.forward_with_parts(student, None, None, teacher_hidden=hidden,
                                               lm_head_weight=w, draft_to_target=d2t,
                                               labels=labels)
    logp = teacher_log_probs(hidden, 0.9, w, d2t)
    got, parts = loss.forward_with_parts(student, None, None, teacher_logp=logp,
                                         draft_to_target=d2t, labels=labels)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    log_q = torch.log_softmax(student[0] / 0.9, -1)
    by_hand = -(log_q[0, 1] + log_q[1, 7] + log_q[3, 3] + log_q[4, 0]) / 4
    assert parts["ce_data"].item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert want_parts["ce_data"].item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_teacher_log_probs_from_hidden_go_through_the_cache_teacher_logits(monkeypatch):
    """The LM head over cached hidden states has one implementation,
    ``data.teacher.teacher_logits``; losses and metrics reach it through teacher_log_probs."""
    from draftsmith.data import teacher

    g = torch.Generator().manual_seed(7)
    hidden, w = torch.randn(3, 8, generator=g), torch.randn(20, 8, generator=g)
    want = torch.log_softmax(hidden @ w.T / 0.7, -1)
    torch.testing.assert_close(teacher_log_probs(hidden, 0.7, w), want)
    calls = []
    real = teacher.teacher_logits
    monkeypatch.setattr(teacher, "teacher_logits",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    teacher_log_probs(hidden, 0.7, w)
    acceptance_stats(torch.randn(1, 3, 20), torch.ones(1, 3, dtype=torch.bool), hidden[None], w)
    assert calls == [(3, 8), (3, 8)]  # acceptance_stats passes the masked rows


def test_teacher_logits_run_the_matmul_in_the_lm_heads_dtype():
    """A bf16 target's teacher is its bf16 LM head output (as in the target's own forward),
    returned in fp32 and divided by the temperature there."""
    from draftsmith.data.teacher import teacher_logits

    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(4, 16, generator=g).half()  # the cache's fp16 rows
    w = torch.randn(50, 16, generator=g).bfloat16()
    bf16 = torch.nn.functional.linear(hidden.bfloat16(), w).float()
    got = teacher_logits(hidden, w, temperature=2.0)
    assert got.dtype == torch.float32 and torch.equal(got, bf16 / 2.0)
    assert torch.equal(teacher_logits(hidden, w), bf16)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        teacher_logits(hidden, w, temperature=0.0)
