"""Distillation losses and acceptance metrics against hand-written formulas."""
from __future__ import annotations

import math

import pytest
import torch

from train.losses import (
    DistillLoss,
    FeatureRegressionLoss,
    ForwardKLLoss,
    HardCELoss,
    JSDLoss,
    ReverseKLLoss,
    TVDLoss,
    teacher_log_probs,
)
from train.metrics import (
    acceptance_stats,
    expected_acceptance,
    expected_acceptance_sums,
    top1_agreement,
)

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
    assert ForwardKLLoss()(zq, zp, m).item() == pytest.approx(_kl(P, Q), rel=1e-5)
    assert ReverseKLLoss()(zq, zp, m).item() == pytest.approx(_kl(Q, P), rel=1e-5)
    tvd_hand = 1 - sum(min(a, b) for a, b in zip(P, Q))
    assert TVDLoss()(zq, zp, m).item() == pytest.approx(tvd_hand, rel=1e-5)
    assert tvd_hand == pytest.approx(0.5 * sum(abs(a - b) for a, b in zip(P, Q)))
    for beta in (0.1, 0.5, 0.9):
        mix = [beta * a + (1 - beta) * b for a, b in zip(P, Q)]
        want = beta * _kl(P, mix) + (1 - beta) * _kl(Q, mix)
        got = JSDLoss(beta=beta)(zq, zp, m).item()
        assert got == pytest.approx(want, rel=1e-5)
    # teacher argmax is id 0; data token 2
    assert HardCELoss("teacher")(zq, zp, m).item() == pytest.approx(-math.log(Q[0]))
    got = HardCELoss("data")(zq, zp, m, labels=torch.tensor([[2]])).item()
    assert got == pytest.approx(-math.log(Q[2]), rel=1e-6)


def test_temperature_applies_to_teacher_and_student():
    zp, zq, m, tau = _logits(P), _logits(Q), _one(), 2.0

    def soft(z: torch.Tensor) -> list[float]:
        return torch.softmax(z.view(-1) / tau, -1).tolist()

    got = ForwardKLLoss(temperature=tau)(zq, zp, m).item()
    assert got == pytest.approx(_kl(soft(zp), soft(zq)), rel=1e-5)
    assert got != pytest.approx(_kl(P, Q), rel=1e-2)


def test_tvd_equals_one_minus_expected_acceptance():
    g = torch.Generator().manual_seed(0)
    zp, zq = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    alpha = expected_acceptance(zp.softmax(-1), zq.softmax(-1), mask)
    assert TVDLoss()(zq, zp, mask).item() == pytest.approx(1 - alpha.item(),
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
    loss = ForwardKLLoss()
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
    outside = TVDLoss()(zq, zp, m, draft_to_target=d2t).item()
    assert outside == pytest.approx(1 - (min(0.25, 0.6) + min(0.1, 0.4)), rel=1e-5)
    renorm = TVDLoss(renormalize=True)(zq, zp, m, draft_to_target=d2t).item()
    pr = [0.25 / 0.35, 0.1 / 0.35]
    assert renorm == pytest.approx(1 - (min(pr[0], 0.6) + min(pr[1], 0.4)), rel=1e-5)
    fkl = ForwardKLLoss(renormalize=True)(zq, zp, m, draft_to_target=d2t).item()
    assert fkl == pytest.approx(_kl(pr, [0.6, 0.4]), rel=1e-5)
    # data labels are target ids: id 3 is draft id 1; id 0 is outside and skipped
    ce = HardCELoss("data")
    got = ce(zq.expand(1, 2, 2), zp.expand(1, 2, 4), torch.ones(1, 2, dtype=torch.bool),
             draft_to_target=d2t, labels=torch.tensor([[3, 0]])).item()
    assert got == pytest.approx(-math.log(0.4), rel=1e-5)
    lp = teacher_log_probs(zp, 1.0, draft_to_target=d2t)
    assert lp.exp().sum().item() == pytest.approx(0.35, rel=1e-5)


def test_feature_regression_is_masked_smooth_l1():
    pred = torch.tensor([[[0.0, 2.0], [5.0, 5.0]]])
    target = torch.tensor([[[0.5, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, False]])
    # smooth L1 (beta 1): 0.5*0.5^2 = 0.125 and |2|-0.5 = 1.5 -> mean over H = 0.8125
    assert FeatureRegressionLoss()(pred, target, mask).item() == pytest.approx(0.8125)
    mix, parts = DistillLoss({"feature": 2.0}).forward_with_parts(
        torch.zeros(1, 2, 3), None, mask, teacher_hidden=target, lm_head_weight=torch.ones(3, 2),
        draft_hidden=pred)
    assert mix.item() == pytest.approx(1.625) and parts["feature"].item() == pytest.approx(0.8125)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown loss terms"):
        DistillLoss({"kl": 1.0})
    with pytest.raises(ValueError, match="JSD beta"):
        JSDLoss(beta=1.0)
    with pytest.raises(ValueError, match="temperature"):
        DistillLoss({"tvd": 1.0}, temperature=0)
    with pytest.raises(ValueError, match="either as teacher_logits"):
        TVDLoss()(torch.zeros(1, 1, 3), None, _one())
    with pytest.raises(ValueError, match="lm_head_weight"):
        TVDLoss()(torch.zeros(1, 1, 3), None, _one(), teacher_hidden=torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="labels"):
        HardCELoss("data")(torch.zeros(1, 1, 3), torch.zeros(1, 1, 3), _one())


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


def test_expected_acceptance_sums_from_logits():
    g = torch.Generator().manual_seed(5)
    zp, zq = torch.randn(2, 5, 9, generator=g), torch.randn(2, 5, 9, generator=g)
    mask = torch.rand(2, 5, generator=g) > 0.4
    a, t, n = expected_acceptance_sums(zp, zq, mask, temperature=1.0)
    assert n == float(mask.sum())
    want = expected_acceptance(zp.softmax(-1), zq.softmax(-1), mask).item() * n
    assert a == pytest.approx(want, rel=1e-5)
    assert t == pytest.approx(top1_agreement(zp, zq, mask).item() * n)


def test_tvd_equals_the_rejection_rate_of_the_decoders_verifier():
    """TVD loss = 1 - the acceptance rate that eval.verify actually realises (K = 1 chains)."""
    from eval.verify import verify_chain_batch

    torch.manual_seed(0)
    zp, zq = torch.randn(1, 1, 12) * 2, torch.randn(1, 1, 12) * 2
    p, q = zp.softmax(-1)[0, 0], zq.softmax(-1)[0, 0]
    n = 200_000
    gen = torch.Generator().manual_seed(1)
    draft = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=gen)  # (n, 1)
    accepted, _ = verify_chain_batch(torch.stack([p, p]).expand(n, 2, 12), q.expand(n, 1, 12),
                                     draft, gen)
    rate = accepted.float().mean().item()
    tvd = TVDLoss()(zq, zp, torch.ones(1, 1, dtype=torch.bool)).item()
    sigma = (rate * (1 - rate) / n) ** 0.5
    assert abs((1 - tvd) - rate) < 4 * sigma, (1 - tvd, rate, sigma)


# ----- the fast path: one teacher per token, forward KL with its gradient written out -----------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_kl_equals_autograd_through_log_softmax(temperature, dtype):
    from train.losses import forward_kl, fused_forward_kl

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
    from train.losses import fused_forward_kl

    z = torch.randn(3, 10)
    before = z.clone()
    fused_forward_kl(z, torch.log_softmax(torch.randn(3, 10), -1))
    assert torch.equal(z, before)


def test_fused_kl_gradient_check_catches_a_wrong_gradient(monkeypatch):
    """Twin: the comparison above fails when the hand-written backward drops the mass factor
    (correct only for an unrestricted teacher)."""
    from train import losses

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
    from train import losses

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, 8, generator=g)
    w = torch.randn(30, 8, generator=g)
    d2t = torch.tensor([1, 2, 5, 8, 13])
    rows = [torch.tensor([0, 1, 2, 5]), torch.tensor([1, 2, 3, 6]), torch.tensor([2, 3, 4, 7])]
    seen = []
    real = losses.teacher_log_probs

    def counting(teacher, *args, **kw):
        seen.append(teacher.shape[0])
        return real(teacher, *args, **kw)

    monkeypatch.setattr(losses, "teacher_log_probs", counting)
    shared = losses.shared_teacher_log_probs(hidden, rows, w, 0.9, d2t, chunk_size=3)
    assert sum(seen) == 8  # the distinct rows 0..7, not 12
    for r, got in zip(rows, shared):
        assert torch.allclose(got, real(hidden[r], 0.9, w, d2t), atol=1e-6)
