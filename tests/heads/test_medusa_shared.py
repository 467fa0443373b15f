"""Medusa heads sharing the target's frozen LM head (``draft.config.lm_head=shared``): the
``auto`` choice, training, the package (LM head left out, re-attached at load), decoding, int8
copies and the medusa export (an LM head per head, copied from the target)."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers_medusa import MedusaProposer
from draftsmith.heads import medusa
from draftsmith.heads.family import get_family
from draftsmith.heads.medusa import MedusaConfig, build_medusa
from draftsmith.heads.package import PACKAGE_JSON, load_package, save_package
from draftsmith.heads.weights import WEIGHTS
from draftsmith.train.losses import DistillLoss
from draftsmith.train.teacher_probs import shared_teacher_rows

VOCAB = 96


def _greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def _train(heads, model, steps: int = 12) -> list[float]:
    """A few steps the way the recipe takes them: shared teacher rows, chunks recomputed."""
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 20))
    hidden = model.model(ids).last_hidden_state.detach()
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    weight = model.get_output_embeddings().weight.detach()
    loss_fn = DistillLoss({"fkl": 1.0}, chunk_size=4)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        outs = medusa.distill_targets(heads, ids, hidden, loss_mask)
        log_p, rows = shared_teacher_rows(hidden.flatten(0, 1),
                                          [o.teacher_index[o.mask] for o in outs], weight, 1.0)
        loss = sum(loss_fn(o.draft_logits, None, None, teacher_logp=log_p,
                           teacher_logp_index=rows[k][None], recompute=True)
                   for k, o in enumerate(outs))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ----- the auto choice ---------------------------------------------------------------------------
def test_auto_is_own_for_small_lm_heads_and_shared_for_a_262k_vocabulary(caplog):
    with caplog.at_level(logging.INFO, logger="draftsmith.heads.medusa"):
        assert medusa.auto_lm_head(3, 262144, 640) == "shared"  # Gemma 3 270M: 8 GB of state
    assert "lm_head=auto -> shared" in caplog.text
    assert medusa.auto_lm_head(3, 49152, 576) == "own"  # SmolLM2-135M: 1.3 GB
    assert medusa.auto_lm_head(4, 49152, 576) == "own"
    limit_heads = medusa.OWN_LM_HEAD_BYTES // (1000 * 100 * 16)
    assert medusa.auto_lm_head(limit_heads, 1000, 100) == "own"
    assert medusa.auto_lm_head(limit_heads + 1, 1000, 100) == "shared"


def test_family_resolves_auto_against_the_target_and_refuses_without_it():
    family = get_family("medusa")
    target = make_tiny_target()
    cfg = family.head_config({"num_heads": 2, "lm_head": "auto"}, target.model.config)
    assert cfg.lm_head == "own"
    with pytest.raises(ValueError, match="lm_head=auto is decided by the target"):
        family.head_config({"num_heads": 2, "lm_head": "auto"}, None)
    with pytest.raises(ValueError, match="draft.config.lm_head='tied' is invalid"):
        family.validate({"config": {"lm_head": "tied"}})
    with pytest.raises(ValueError, match="must be one of"):
        MedusaConfig(lm_head="tied")
    with pytest.raises(ValueError, match="nothing to train"):
        MedusaConfig(num_layers=0, lm_head="shared")
    # an unresolved config cannot build heads; build_medusa resolves it against the target
    with pytest.raises(ValueError, match="not resolved"):
        medusa.MedusaHeads(MedusaConfig(lm_head="auto"), 32, VOCAB)
    assert build_medusa(MedusaConfig(lm_head="auto"), target.model).cfg.lm_head == "own"


def test_a_package_written_before_the_key_loads_as_own():
    assert MedusaConfig.from_dict({"num_heads": 2, "num_layers": 1,
                                   "loss_decay": 0.8}).lm_head == "own"


# ----- the shared head ---------------------------------------------------------------------------
def test_shared_heads_apply_the_targets_frozen_lm_head_and_train_only_their_blocks():
    target = make_tiny_target()
    model = target.model
    heads = build_medusa(MedusaConfig(num_heads=3, lm_head="shared"), model)
    w = model.get_output_embeddings().weight
    assert heads.lm_head.weight.data_ptr() == w.data_ptr()  # the target's tensor, not a copy
    assert not heads.lm_head.weight.requires_grad
    assert all(h.lm_head is None for h in heads.heads)
    trainable = {n for n, p in heads.named_parameters() if p.requires_grad}
    assert trainable and all(".blocks." in n for n in trainable)
    hidden = model.model(torch.randint(3, VOCAB, (2, 7))).last_hidden_state.detach()
    with torch.no_grad():
        want = model.lm_head(hidden)
        for i in range(3):  # zero-initialised blocks: every head starts as the target's head
            torch.testing.assert_close(heads(hidden)[:, :, i], want)
    before = w.detach().clone()
    losses = _train(heads, model)
    assert losses[-1] < losses[0]
    assert torch.equal(w, before)  # the target's LM head is never updated


def test_shared_heads_train_save_reload_and_decode_like_plain_greedy(tmp_path, caplog):
    target = make_tiny_target()
    model = target.model
    cfg = MedusaConfig(num_heads=3, num_layers=1, lm_head="shared")
    heads = build_medusa(cfg, model)
    _train(heads, model)
    pkg_dir = save_package(tmp_path / "pkg", "medusa", heads, cfg, target.identity)
    stored = load_file(str(pkg_dir / WEIGHTS))
    assert stored and not any("lm_head" in k for k in stored)  # the target's, not stored
    assert json.loads((pkg_dir / PACKAGE_JSON).read_text())["head_config"]["lm_head"] == "shared"

    pkg = load_package(pkg_dir, target=target)
    assert pkg.head_config.lm_head == "shared"
    assert pkg.module.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    hidden = model.model(torch.randint(3, VOCAB, (1, 9))).last_hidden_state.detach()
    with torch.no_grad():
        torch.testing.assert_close(pkg.module(hidden), heads.eval()(hidden), rtol=0, atol=0)

    prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    dec = SpeculativeDecoder(model, MedusaProposer(pkg.module, VOCAB), k=3, adaptive=False,
                             fallback=False)
    got = dec.generate(prompt, max_new_tokens=16, temperature=0.0)
    assert got.output_ids == _greedy(model, prompt, 16)
    assert got.stats.drafted > 0

    # without its target the LM head is unset: said at load, refused by the proposer
    with caplog.at_level(logging.WARNING):
        bare = load_package(pkg_dir)
    assert "loaded without its target" in caplog.text and not bare.module.target_attached
    with pytest.raises(ValueError, match="not attached"):
        MedusaProposer(bare.module, VOCAB)
    bare.module.attach_target(model)
    with torch.no_grad():
        torch.testing.assert_close(bare.module(hidden), heads(hidden), rtol=0, atol=0)


def test_saving_with_an_unresolved_or_other_config_is_refused(tmp_path):
    target = make_tiny_target()
    heads = build_medusa(MedusaConfig(num_heads=2, lm_head="auto"), target.model)
    with pytest.raises(ValueError, match="save them with their resolved config"):
        save_package(tmp_path / "p", "medusa", heads, MedusaConfig(num_heads=2, lm_head="auto"),
                     target.identity)


def test_int8_copy_of_a_shared_package_quantizes_the_blocks_and_decodes(tmp_path):
    from draftsmith.scripts.quantize import quantize_package

    target = make_tiny_target()
    model = target.model
    cfg = MedusaConfig(num_heads=2, num_layers=1, lm_head="shared")
    heads = build_medusa(cfg, model)
    _train(heads, model, steps=4)
    src = save_package(tmp_path / "pkg", "medusa", heads, cfg, target.identity)
    out = quantize_package(src, tmp_path / "int8")
    modules = json.loads((out / PACKAGE_JSON).read_text())["quantization"]["modules"]
    assert modules == ["heads.0.blocks.0.linear", "heads.1.blocks.0.linear"]
    pkg = load_package(out, target=target)
    assert pkg.module.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    prompt = [1, 5, 9, 13, 5, 9]
    dec = SpeculativeDecoder(model, MedusaProposer(pkg.module, VOCAB), k=2, adaptive=False,
                             fallback=False)
    assert dec.generate(prompt, max_new_tokens=12, temperature=0.0).output_ids == \
        _greedy(model, prompt, 12)


def test_medusa_export_of_shared_heads_writes_the_targets_lm_head_per_head(tmp_path):
    from draftsmith.heads.exports import import_export
    from draftsmith.scripts.export import export_package
    from draftsmith.scripts.export_formats import ExportError

    target = make_tiny_target()
    model = target.model
    cfg = MedusaConfig(num_heads=3, num_layers=1, lm_head="shared")
    heads = build_medusa(cfg, model)
    _train(heads, model, steps=4)
    pkg = save_package(tmp_path / "pkg", "medusa", heads, cfg, target.identity)
    with pytest.raises(ExportError, match="check_target=true"):
        export_package(pkg, "medusa", tmp_path / "no-target", verifier="org/tiny")
    out = export_package(pkg, "medusa", tmp_path / "medusa", target=target, verifier="org/tiny")
    state = load_file(str(out / "medusa_lm_head.safetensors"))
    for i in range(3):  # Medusa's numbering: {i}.{num_layers}.weight is head i's LM head
        assert torch.equal(state[f"{i}.1.weight"], model.lm_head.weight)
    back = import_export(out, target=target)
    assert back.module.cfg.lm_head == "own"  # the layout holds an LM head per head
    hidden = model.model(torch.randint(3, VOCAB, (1, 6))).last_hidden_state.detach()
    with torch.no_grad():
        torch.testing.assert_close(back.module(hidden), heads.eval()(hidden), rtol=0, atol=0)
