"""The training-memory estimate (train/memory.py) and the loss chunks it relies on."""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch
from conftest import make_tiny_target

from draftsmith.train.config import ConfigError
from draftsmith.train.host_memory import usable_memory
from draftsmith.train.losses import DistillLoss
from draftsmith.train.memory import (
    MARGIN,
    GiB,
    TrainShapes,
    check_memory,
    check_training_memory,
    estimate,
    fitting_options,
    run_shapes,
)
from draftsmith.train.teacher_probs import shared_teacher_rows
from tests.train.launching import TINY
from tests.train.launching import compose_config as _compose

V, H = 262144, 640  # Gemma 3 270M


def _medusa_quick(own: bool) -> TrainShapes:
    """experiment=medusa_quick on Gemma 3 270M: 3 heads, own LM heads or the shared one."""
    blocks = 3 * (H * H + H)
    lm = 3 * V * H if own else 0
    return TrainShapes(micro_batch_size=2, max_length=512, positions=3, vocab_size=V,
                       draft_vocab=V, hidden_size=H, trainable_params=blocks + lm,
                       largest_trainable=V * H if own else H * H, target_bytes=268_098_176 * 4,
                       activation_width=3 * 2 * H, feature_width=H, logits_bytes=2,
                       mixed_precision="bf16", own_lm_head_params=lm)


def test_estimate_grows_with_batch_length_and_vocabulary():
    base = _medusa_quick(own=False)
    for key, values in (("micro_batch_size", (1, 2, 4, 8)), ("max_length", (128, 256, 512)),
                        ("draft_vocab", (8192, 32768, V)), ("positions", (1, 2, 3))):
        totals = [estimate(dataclasses.replace(base, **{key: v})).total for v in values]
        assert totals == sorted(totals) and len(set(totals)) == len(totals), (key, totals)
    assert estimate(_medusa_quick(own=True)).total > estimate(base).total + 8 * GiB


def test_full_vocabulary_logits_are_bounded_by_the_budget():
    """Past the budget the loss recomputes its chunks: counted at the budget's worth, not at
    every chunk's fp32 tensors (3 x 1024 rows x 262k: 6 GiB of q and p)."""
    shapes = _medusa_quick(own=False)
    budget = shapes.teacher_budget
    parts = estimate(shapes).parts
    assert parts["loss state"] == (2 * budget + 4 * 256 * V) * 4
    assert parts["teacher"] <= budget * 4 + 256 * V * 10
    kept = estimate(dataclasses.replace(shapes, teacher_budget=1 << 40)).parts["loss state"]
    assert kept >= 2 * 3 * 1024 * V * 4  # q and p of every row, had they been kept


def test_a_run_that_cannot_fit_is_refused_naming_overrides_that_fit():
    shapes = _medusa_quick(own=True)
    usable = 14 * GiB
    with pytest.raises(ConfigError) as e:
        check_memory(shapes, usable, "test limit")
    msg = str(e.value)
    assert "draft.config.lm_head=shared" in msg and "train.memory_check=false" in msg
    assert "student logits" in msg and "AdamW moments" in msg and "test limit" in msg
    options = fitting_options(shapes, int(usable * MARGIN))
    assert options and all(est.total <= usable * MARGIN for _, est in options)
    for name, _ in options:
        assert name in msg
    # a full-vocabulary EAGLE head is offered a reduced draft vocabulary
    eagle = dataclasses.replace(shapes, own_lm_head_params=0, reducible_vocab=True,
                                micro_batch_size=16, trainable_params=13_000_000,
                                largest_trainable=4_000_000)
    with pytest.raises(ConfigError, match=r"draft.config.draft_vocab_size=32768"):
        check_memory(eagle, 10 * GiB)


def test_a_smaller_batch_is_offered_with_the_accumulation_that_keeps_the_batch():
    shapes = dataclasses.replace(_medusa_quick(own=False), micro_batch_size=8, grad_accum=1)
    limit = estimate(dataclasses.replace(shapes, micro_batch_size=3)).total + 1
    names = [name for name, _ in fitting_options(shapes, limit)]
    assert "train.micro_batch_size=3 train.grad_accum=3" in names
    assert any(re.fullmatch(r"data.max_length=\d+", n) for n in names)


def test_nothing_that_fits_says_so():
    with pytest.raises(ConfigError, match="No override found that fits"):
        check_memory(_medusa_quick(own=False), GiB)


def test_a_run_that_fits_passes_and_logs_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="draftsmith.distill"):
        est = check_memory(_medusa_quick(own=False), 24 * GiB, "test")
    lines = [r.getMessage() for r in caplog.records if "memory estimate" in r.getMessage()]
    assert len(lines) == 1 and "peak per process" in lines[0]
    assert 4 * GiB < est.total < 10 * GiB  # Gemma medusa_quick, shared LM head


@pytest.mark.parametrize("mode", ["own", "shared"])
def test_run_shapes_count_the_built_draft(mode):
    from draftsmith.train.trainable import build_trainable

    target = make_tiny_target()
    cfg = _compose(TINY + ["draft=medusa", "draft.config.num_heads=2",
                           f"draft.config.lm_head={mode}", "train.mixed_precision=bf16"])
    draft = build_trainable(cfg, target)
    s = run_shapes(cfg, target.model, draft, torch.device("cpu"))
    v, h = target.model.config.vocab_size, target.model.config.hidden_size
    blocks = 2 * (h * h + h)
    own = 2 * v * h if mode == "own" else 0
    assert (s.trainable_params, s.own_lm_head_params) == (blocks + own, own)
    assert s.frozen_draft_bytes == 0  # a shared LM head is the target's storage
    assert s.target_bytes == sum(p.nbytes for p in target.model.parameters()) + sum(
        b.nbytes for b in target.model.buffers())
    assert (s.rows, s.positions, s.draft_vocab, s.logits_bytes) == (
        int(cfg.train.micro_batch_size) * int(cfg.data.max_length), 2, v, 2)
    assert s.activation_width == 2 * 2 * h  # the blocks' linears; LM heads are logits
    with pytest.raises(ConfigError, match="train.memory_check=false"):
        check_training_memory(cfg, target.model, draft, torch.device("cpu"), usable=(1, "tiny"))
    cfg.train.memory_check = False
    assert check_training_memory(cfg, target.model, draft, torch.device("cpu"),
                                 usable=(1, "tiny")) is None


def test_usable_memory_reads_the_cgroup_limit(tmp_path, monkeypatch):
    from draftsmith.train import host_memory

    (tmp_path / "memory.max").write_text(f"{2 * GiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {GiB // 2}\nfile {GiB}\n")
    free, source = host_memory._cgroup_free(tmp_path)
    assert free == GiB + GiB // 2 and "memory.max 2.0 GiB" in source
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory._cgroup_free(tmp_path) is None
    monkeypatch.setattr(host_memory, "_cgroup_free", lambda: (GiB, "cgroup"))
    monkeypatch.setattr(host_memory, "_own_resident_bytes", lambda: GiB // 4)
    size, source = usable_memory(torch.device("cpu"), processes=2)
    assert size == GiB // 4 + GiB // 2 and "2 local processes" in source


# ----- the loss chunks the estimate relies on ------------------------------------------------
def _saved_bytes(fn, alive: list[torch.Tensor]) -> int:
    """Bytes of new storage autograd keeps for backward while ``fn`` runs (checkpointed regions
    keep only their inputs; views of the ``alive`` tensors cost nothing)."""
    seen = {t.untyped_storage().data_ptr() for t in alive}
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("terms", [{"fkl": 1.0}, {"fkl": 1.0, "tvd": 0.5, "ce_data": 0.2}])
def test_recomputed_chunks_give_the_same_loss_and_gradients_and_keep_nothing(terms):
    g = torch.Generator().manual_seed(0)
    n, vocab, hidden = 40, 300, 16
    h = torch.randn(n + 5, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g)
    rows = [torch.arange(n), torch.arange(n) + 5]
    log_p, index = shared_teacher_rows(h, rows, w, 0.9, chunk_size=7)
    labels = torch.randint(0, vocab, (1, n), generator=g)
    loss_fn = DistillLoss(terms, temperature=0.9, chunk_size=8)
    results = {}
    for recompute in (False, True):
        z = torch.randn(1, n, vocab, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        out = {}

        def run(z=z, out=out, recompute=recompute):
            out["loss"] = sum(loss_fn(z, None, None, teacher_logp=log_p,
                                      teacher_logp_index=index[k][None], labels=labels,
                                      recompute=recompute) for k in range(2))

        saved = _saved_bytes(run, [z, log_p, labels, *index])
        out["loss"].backward()
        results[recompute] = (out["loss"].item(), z.grad, saved)
    (l0, g0, kept), (l1, g1, recomputed) = results[False], results[True]
    assert l1 == pytest.approx(l0, rel=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
    assert kept >= 2 * n * vocab * 4  # the twin: every chunk's q and p were kept
    assert recomputed < 8 * vocab * 4  # less than one chunk's (chunk, V) fp32 tensor


def test_indexed_teacher_rows_equal_per_position_copies():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(12, 8, generator=g), torch.randn(50, 8, generator=g)
    rows = [torch.tensor([0, 3, 4, 9]), torch.tensor([3, 4, 11])]
    log_p, index = shared_teacher_rows(h, rows, w, 1.0)
    z = torch.randn(1, 3, 50, generator=g)
    loss = DistillLoss({"fkl": 1.0})
    want = loss(z, None, None, teacher_logp=log_p[index[1]][None])
    assert loss(z, None, None, teacher_logp=log_p, teacher_logp_index=index[1][None]).item() == \
        pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"\(R, V_draft\) rows"):
        loss(z, None, None, teacher_logp=log_p[None], teacher_logp_index=index[1][None])


# ----- the recipe's loss path past the budget ---------------------------------------------------
def _recipe_loss_and_grads(recipe, batch) -> tuple[float, dict[str, torch.Tensor]]:
    recipe.optimizer.zero_grad(set_to_none=True)
    loss, _, _ = recipe.objective(batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in recipe.draft.module.named_parameters()
                         if p.grad is not None}


@pytest.mark.parametrize("lm_head", ["own", "shared"])
def test_recipe_loss_past_the_budget_equals_the_kept_path(lm_head, tmp_path, monkeypatch):
    """Recomputed chunks (with the shared teacher table, or the teacher from hidden states when
    even that is over the budget) give the loss and gradients of the path that keeps them."""
    from accelerate.state import AcceleratorState

    from draftsmith.train import objective
    from draftsmith.train.distill import DistillRecipe

    AcceleratorState._reset_state(True)
    recipe = DistillRecipe(_compose(TINY + ["draft=medusa", f"draft.config.lm_head={lm_head}",
                                            f"out_dir={tmp_path}"]))
    recipe.setup()
    try:
        batch = next(recipe._batches())
        want_loss, want = _recipe_loss_and_grads(recipe, batch)
        calls = []
        monkeypatch.setattr(objective, "recompute_loss",
                            lambda n, budget: calls.append(n) or True)
        shared_loss, shared = _recipe_loss_and_grads(recipe, batch)
        assert calls  # the shared table, chunks recomputed
        recipe.cfg.train.teacher_logits_budget = 1  # no table fits: the teacher per chunk
        hidden_loss, hidden = _recipe_loss_and_grads(recipe, batch)
    finally:
        recipe.cleanup()
        AcceleratorState._reset_state(True)
    assert want and want.keys() == shared.keys() == hidden.keys()
    for loss in (shared_loss, hidden_loss):
        assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, g in want.items():
        torch.testing.assert_close(shared[name], g, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(hidden[name], g, rtol=1e-4, atol=1e-6)


def test_the_recipe_refuses_a_run_that_would_not_fit_before_its_first_step(tmp_path,
                                                                           monkeypatch):
    from accelerate.state import AcceleratorState

    from draftsmith.train import memory
    from draftsmith.train.distill import DistillRecipe

    monkeypatch.setattr(memory, "usable_memory", lambda device: (GiB // 2, "a small test box"))
    for check in (True, False):
        AcceleratorState._reset_state(True)
        recipe = DistillRecipe(_compose(TINY + ["draft=medusa", f"train.memory_check={check}",
                                                f"out_dir={tmp_path / str(check)}"]))
        try:
            if check:
                with pytest.raises(ConfigError, match="a small test box") as e:
                    recipe.setup()
                assert not hasattr(recipe, "optimizer")  # refused before the optimizer
                assert "train.memory_check=false skips" in str(e.value)
            else:
                recipe.setup()
                assert hasattr(recipe, "optimizer")
        finally:
            AcceleratorState._reset_state(True)
