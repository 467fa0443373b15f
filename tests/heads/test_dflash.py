"""The DFlash block drafter (heads/dflash.py, heads/dflash_train.py,
eval/decoding/proposers_dflash.py) on tiny random Llama targets: config and family, shapes, the
package round trip, the blocks' attention mask (with a leaky twin), the training pairs' alignment, a
few training steps, and decoding: greedy output equals the target's own and the proposer's cached
context gives the drafts a from-scratch forward gives."""
from __future__ import annotations

import re

import pytest
import torch
from conftest import make_tiny_target, randomize

from draftsmith.eval.decoding.batch_drafters import batch_drafter_for
from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers_dflash import DFlashProposer
from draftsmith.eval.draft import DraftSettings, settle
from draftsmith.heads import dflash, dflash_train
from draftsmith.heads.dflash import DFlashConfig, DFlashDrafter, build_dflash
from draftsmith.heads.dflash_train import distill_targets
from draftsmith.heads.family import get_family
from draftsmith.heads.family_base import TreeKind
from draftsmith.heads.package import load_package, save_package
from draftsmith.train.losses import DistillLoss
from draftsmith.train.metrics import acceptance_stats
from draftsmith.train.teacher_probs import shared_teacher_rows

LAYERS, FUSE, EOS = 4, [3, 1], 2  # fuse_layers out of order: the column order is kept everywhere
FAMILY = get_family("dflash")


@pytest.fixture(scope="module")
def target():
    t = make_tiny_target(seed=0, layers=LAYERS)
    with torch.no_grad():  # peaked target distributions: clearer greedy winners
        t.model.get_output_embeddings().weight.mul_(3.0)
    return t


def drafter(target, block_size: int = 4, seed: int = 1, **config) -> DFlashDrafter:
    cfg = FAMILY.head_config({"block_size": block_size, "fuse_layers": FUSE,
                              "mask_token_id": EOS, **config}, target.model.config)
    return randomize(FAMILY.build(cfg, target.model), seed=seed)


def features(target, ids: torch.Tensor, fuse=FUSE) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused features (B, T, n*H), final hidden (B, T, H)) of the target on ``ids``."""
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
        hidden = target.model.model(ids).last_hidden_state
    return torch.cat([out.hidden_states[i] for i in fuse], -1), hidden


def layers_of(target, ids: torch.Tensor, fuse=FUSE) -> torch.Tensor:
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
    return torch.stack([hs[i] for i in fuse], 1)  # (B, L, T, H)


def ids_of(seed: int, b: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(3, 96, (b, t), generator=torch.Generator().manual_seed(seed))


# ----- config and family -------------------------------------------------------------------------
def test_config_defaults_round_trip_and_errors():
    cfg = DFlashConfig()
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    assert DFlashConfig(block_size=8).gamma == 4.0 and DFlashConfig(block_size=16).gamma == 7.0
    assert DFlashConfig(block_size=8).position_weights(3) == pytest.approx(
        [1.0, 2.718281828 ** -0.25, 2.718281828 ** -0.5])
    for kw, key in (({"block_size": 1}, "block_size"), ({"num_layers": 0}, "num_layers"),
                    ({"draft_vocab_size": 40}, "draft_vocab_size"),
                    ({"fuse_layers": []}, "fuse_layers"), ({"mask_token_id": -1}, "mask_token_id"),
                    ({"loss_decay_gamma": 0}, "loss_decay_gamma")):
        with pytest.raises(ValueError, match=re.escape(f"draft.config.{key}=")):
            DFlashConfig(**kw)
    with pytest.raises(ValueError, match="unknown DFlashConfig keys"):
        DFlashConfig.from_dict({"ttt_steps": 2})


def test_family_resolves_auto_values_and_checks_configs(target):
    tc = target.model.config
    cfg = FAMILY.head_config({}, tc)  # fuse_layers auto, mask_token_id null
    assert cfg.fuse_layers == [1, 2, 3] and cfg.mask_token_id == tc.pad_token_id == 0
    with pytest.raises(ValueError, match=r"mask_token_id=0 has an all-zero embedding row.*e\.g\. "
                                         r"2, the target's EOS id"):
        FAMILY.build(cfg, target.model)  # the tiny target's padding row is zero
    assert FAMILY.tree is TreeKind.NONE and FAMILY.max_draft_length(cfg) == 7
    assert FAMILY.engine_draft_length(cfg) == 7 and FAMILY.num_positions(cfg, 9) == 7
    assert FAMILY.default_position_weights(cfg, 2) == cfg.position_weights(2)
    with pytest.raises(ValueError, match=r"draft.num_positions=3 must be draft.config.block_size "
                                         r"- 1 = 7.*set draft.num_positions=7"):
        FAMILY.validate({"num_positions": 3, "config": {"block_size": 8}})
    FAMILY.validate({"num_positions": 7, "config": {"block_size": 8}})
    sizes = {"vocab_size": 96, "hidden_size": 32, "num_layers": 4}
    with pytest.raises(ValueError, match=re.escape("draft.config.fuse_layers has ids [5]")):
        FAMILY.validate_against_target({"config": {"fuse_layers": [1, 5]}}, **sizes)
    with pytest.raises(ValueError, match=r"mask_token_id=96 is outside"):
        FAMILY.validate_against_target({"config": {"mask_token_id": 96}}, **sizes)
    with pytest.raises(ValueError, match=r"fuses target layers \[3, 1\]"):
        FAMILY.check_init_from(drafter(target).cfg, {"config": {"fuse_layers": [1, 3]}}, "pkg")


def test_shapes_and_the_stored_tensors_have_vllms_names(target):
    d = drafter(target, num_layers=2)
    ids = ids_of(0)
    feats, _ = features(target, ids)
    anchors = torch.tensor([[2, 5, 9], [1, 4, 12]])
    assert d(feats, ids, anchors).shape == (2, 3, 4, 32)
    stored = set(FAMILY.saved_state(d, d.cfg))
    assert set(d.state_dict()) - stored == {"embed_tokens.weight", "lm_head.weight"}
    layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert stored == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in layer}
    assert d.fc.weight.shape == (32, 2 * 32) and d.layers[0].self_attn.q_norm.weight.shape == (8,)
    assert not any(p.requires_grad for p in (d.embed_tokens.weight, d.lm_head.weight))


def test_package_round_trip_gives_identical_logits(target, tmp_path):
    d = drafter(target).eval()
    pkg_dir = save_package(tmp_path / "pkg", "dflash", d, d.cfg, target.identity,
                           target_config=target.model.config)
    pkg = load_package(pkg_dir, target=target)
    assert pkg.family.name == "dflash" and pkg.head_config == d.cfg
    assert pkg.info["draft_config"]["architectures"] == ["DFlashDrafter"]
    assert pkg.info["draft_config"]["hidden_act"] == "silu"
    ids = ids_of(1)
    feats, _ = features(target, ids)
    anchors = torch.tensor([[3, 7], [2, 10]])
    with torch.no_grad():
        want = d.compute_logits(d(feats, ids, anchors))
        got = pkg.module.compute_logits(pkg.module(feats, ids, anchors))
        other = drafter(target, seed=9).eval()  # the comparison sees the weights
        assert not torch.allclose(other.compute_logits(other(feats, ids, anchors)), want)
    assert torch.equal(got, want)


# ----- the attention mask ------------------------------------------------------------------------
def _block_logits(d, feats, ids, anchors, attn=None):
    with torch.no_grad():
        return d.compute_logits(d(feats, ids, anchors, attention_mask=attn))


def test_a_block_sees_only_earlier_context_and_itself(target):
    d = drafter(target).eval()
    ids = ids_of(2, b=1, t=16)
    feats, _ = features(target, ids)
    anchors = torch.tensor([[5, 9]])
    base = _block_logits(d, feats, ids, anchors)
    later = feats.clone()
    later[:, 5:] += torch.randn_like(later[:, 5:])  # the context at and after anchor 5
    assert torch.equal(_block_logits(d, later, ids, anchors)[:, 0], base[:, 0])
    assert not torch.allclose(_block_logits(d, later, ids, anchors)[:, 1], base[:, 1])
    other = ids.clone()
    other[0, 9] = 50 if ids[0, 9] != 50 else 51  # the other block's anchor token
    assert torch.equal(_block_logits(d, feats, other, anchors)[:, 0], base[:, 0])
    before = feats.clone()
    before[:, 4] += 1.0  # the last context position the first block sees: it changes
    assert not torch.allclose(_block_logits(d, before, ids, anchors)[:, 0], base[:, 0])
    padded = feats.clone()
    padded[:, 2] += 5.0  # a padding position inside the context
    attn = torch.ones_like(ids)
    attn[0, 2] = 0
    assert torch.equal(_block_logits(d, padded, ids, anchors, attn),
                       _block_logits(d, feats, ids, anchors, attn))


def test_twin_a_leaky_mask_is_caught(target, monkeypatch):
    """The same perturbations under masks that leak (the anchor's own context position; another
    block's slots) change the logits the checks above hold fixed."""
    d = drafter(target).eval()
    ids = ids_of(2, b=1, t=16)
    feats, _ = features(target, ids)
    anchors = torch.tensor([[5, 9]])
    right = dflash.block_attention_mask

    def sees_its_anchor(anchors, valid, seq, bs, attn=None):
        allowed = right(anchors, valid, seq, bs, attn)
        allowed[:, :, :bs, anchors[0, 0]] = True
        return allowed

    def sees_other_blocks(anchors, valid, seq, bs, attn=None):
        allowed = right(anchors, valid, seq, bs, attn)
        allowed[..., seq:] = True
        return allowed

    later = feats.clone()
    later[:, 5:] += torch.randn_like(later[:, 5:])
    other = ids.clone()
    other[0, 9] = 50 if ids[0, 9] != 50 else 51
    for leak, changed in ((sees_its_anchor, (later, ids)), (sees_other_blocks, (feats, other))):
        monkeypatch.setattr(dflash, "block_attention_mask", leak)
        base = _block_logits(d, feats, ids, anchors)
        assert not torch.allclose(_block_logits(d, *changed, anchors)[:, 0], base[:, 0]), leak


def test_the_mask_compares_positions_and_keeps_filler_blocks_to_themselves():
    anchors, valid = torch.tensor([[3, 6]]), torch.tensor([[True, False]])
    m = dflash.block_attention_mask(anchors, valid, 8, 2)[0, 0]  # (4, 8 + 4)
    assert m.shape == (4, 12)
    assert m[:2, :8].tolist() == [[True] * 3 + [False] * 5] * 2
    assert not m[2:, :8].any()  # a filler block sees no context
    assert m[:, 8:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


# ----- training pairs ----------------------------------------------------------------------------
def test_anchors_are_counted_positions_drawn_without_replacement():
    ids = ids_of(3, b=2, t=20)
    loss = torch.zeros(2, 20, dtype=torch.bool)
    loss[0, 6:15] = True
    loss[1, 3:5] = True
    attn = torch.ones(2, 20, dtype=torch.long)
    attn[0, 12:] = 0
    anchors, valid = dflash_train.sample_anchors(ids, loss, attn, 4,
                                                 dflash_train._data_generator(ids))
    assert anchors.shape == valid.shape == (2, 4)
    for b in range(2):
        got = anchors[b][valid[b]].tolist()
        counted = [a for a in range(1, 19) if loss[b, a + 1] and attn[b, a + 1]]
        assert got == sorted(set(got)) and set(got) <= set(counted)
        assert len(got) == min(4, len(counted))
    again = dflash_train.sample_anchors(ids, loss, attn, 4, dflash_train._data_generator(ids))
    assert torch.equal(again[0], anchors)  # eval mode: the same blocks every validation


def test_distill_targets_align_slot_k_with_token_a_plus_k(target):
    d = drafter(target, block_size=4, max_anchors=3).eval()
    ids = ids_of(4, b=2, t=14)
    feats, hidden = features(target, ids)
    loss = torch.rand(2, 14, generator=torch.Generator().manual_seed(0)) > 0.3
    attn = torch.ones(2, 14, dtype=torch.long)
    attn[1, 10:] = 0
    with torch.no_grad():
        out = distill_targets(d, ids, hidden, loss, attn, layers=layers_of(target, ids, [1, 2, 3]),
                              layer_ids=[1, 2, 3])
        anchors, valid = dflash_train.sample_anchors(ids, loss, attn, 3,
                                                     dflash_train._data_generator(ids))
        full = d.compute_logits(d(feats, ids, anchors, valid, attn))  # (B, N, 4, V)
    assert len(out) == 3
    for k, pos in enumerate(out, start=1):
        want = [(b, j, int(a) + k) for b in range(2) for j, a in enumerate(anchors[b])
                if valid[b, j] and a + k < 14 and loss[b, a + k] and attn[b, a + k]]
        assert pos.draft_logits.shape == (1, len(want), 96) and bool(pos.mask.all())
        assert pos.labels[0].tolist() == [int(ids[b, t]) for b, _, t in want]
        assert pos.teacher_index[0].tolist() == [b * 14 + t - 1 for b, _, t in want]
        torch.testing.assert_close(pos.teacher_hidden[0], hidden.flatten(0, 1)[
            pos.teacher_index[0]])
        torch.testing.assert_close(pos.draft_logits[0],
                                   torch.stack([full[b, j, k] for b, j, _ in want]))
    assert len(distill_targets(d, ids, hidden, loss, attn, layers=layers_of(target, ids),
                               num_steps=2)) == 2


def test_a_few_training_steps_lower_the_loss_and_raise_acceptance(target):
    torch.manual_seed(0)
    d = drafter(target, block_size=4, seed=2).train()
    ids = ids_of(5, b=4, t=24)
    _, hidden = features(target, ids)
    layers, loss_mask = layers_of(target, ids), torch.ones_like(ids, dtype=torch.bool)
    weight = target.model.lm_head.weight.detach()
    loss_fn = DistillLoss({"fkl": 1.0})
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)

    def alphas() -> list[float]:
        d.eval()
        with torch.no_grad():
            outs = distill_targets(d, ids, hidden, loss_mask, layers=layers)
        d.train()
        return [acceptance_stats(o.draft_logits, o.mask, o.teacher_hidden, weight).alpha
                for o in outs]

    before, losses = alphas(), []
    for _ in range(30):
        outs = distill_targets(d, ids, hidden, loss_mask, layers=layers)
        # the recipe's shared-teacher path: one teacher row per distinct teacher_index
        log_p, rows = shared_teacher_rows(hidden.flatten(0, 1),
                                          [o.teacher_index[o.mask] for o in outs], weight, 1.0)
        loss = sum(w * loss_fn(o.draft_logits, None, None, teacher_logp=log_p,
                               teacher_logp_index=r[None])
                   for w, o, r in zip(d.cfg.position_weights(3), outs, rows))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    after = alphas()
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    assert all(a > b + 0.03 for a, b in zip(after, before)), (before, after)


# ----- decoding ----------------------------------------------------------------------------------
def _plain_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def test_greedy_decoding_equals_the_targets_own(target):
    d = drafter(target, block_size=4).eval()
    dec = SpeculativeDecoder(target.model, DFlashProposer(d, 96), k=3, adaptive=False,
                             fallback=False)
    for prompt in ([1, 5, 9, 13, 5, 9], [1, 7], [1, 40, 41, 42, 43, 40, 41, 42]):
        got = dec.generate(prompt, max_new_tokens=20, temperature=0.0)
        assert got.output_ids == _plain_greedy(target.model, prompt, 20), prompt


class Recording(DFlashProposer):
    """Records the committed sequence and the drafts of every step."""

    def propose(self, ctx, k):
        prop = super().propose(ctx, k)
        self.steps.append((list(ctx.tokens), prop.tokens.tolist()))
        return prop


def test_the_context_cache_drafts_what_a_fresh_forward_drafts(target):
    """Through the decoder (every step rejects and rolls back), each step's drafts equal the
    drafter's training forward over the whole committed sequence with the pending token as the
    anchor: the cache holds the committed positions only, and no block's keys stay behind."""
    d = drafter(target, block_size=4).eval()
    rec = Recording(d, 96)
    rec.steps = []
    SpeculativeDecoder(target.model, rec, k=3, adaptive=False, fallback=False).generate(
        [1, 5, 9, 13], max_new_tokens=16, temperature=0.0)
    assert len(rec.steps) >= 4
    for tokens, drafts in rec.steps:
        ids = torch.tensor([tokens])
        feats, _ = features(target, ids)
        anchor = torch.tensor([[len(tokens) - 1]])
        with torch.no_grad():
            logits = d.compute_logits(d(feats, ids, anchor))[0, 0, 1:]
        assert logits.argmax(-1).tolist()[:len(drafts)] == drafts


def test_the_context_cache_after_accepting_several_drafts(target):
    """accept() with several rows at once (the pending token and accepted drafts): the block's
    final states over the cache equal a fresh forward's, step after step."""
    from draftsmith.eval.decoding.proposal import DecodeContext
    from draftsmith.eval.decoding.target_model import Target

    d = drafter(target, block_size=4).eval()
    prop = DFlashProposer(d, 96)
    tgt = Target(target.model, prop.layer_ids)
    tokens = [1, 5, 9, 13]
    prop.reset(tokens + [20], tgt.prefill(torch.tensor(tokens)))
    tokens.append(20)
    for accepted, nxt in (([30, 31, 32], 33), ([], 40), ([41], 42)):
        prop.propose(DecodeContext(tokens), 3)  # a block runs over the cache and leaves nothing
        out = tgt.extend(torch.tensor([tokens[-1]] + accepted))
        tokens += accepted + [nxt]
        prop.accept(list(range(len(accepted))), accepted + [nxt], out)
        assert prop.n_ctx == len(tokens) - 1
        p = len(tokens) - 1
        with torch.no_grad():
            cached = d.block_hidden(d.block_ids(torch.tensor([[nxt]])),
                                    torch.arange(p, p + 4)[None], prop.cache)
            ids = torch.tensor([tokens])
            fresh = d(features(target, ids)[0], ids, torch.tensor([[p]]))[:, 0]
        torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=1e-5)


def test_chains_only_and_no_batches(target):
    d = drafter(target).eval()
    chain = DraftSettings(k=3, k_source="config", tree=False, tree_size=10, tree_topk=2,
                          draft_vocab=None)
    assert isinstance(DFlashProposer.for_draft(d, d.cfg, 96, chain), DFlashProposer)
    with pytest.raises(ValueError, match="no tree"):
        DFlashProposer.for_draft(d, d.cfg, 96, DraftSettings(**{**chain.__dict__, "tree": True}))
    with pytest.raises(ValueError, match="draft_vocab=full"):
        DFlashProposer.for_draft(d, d.cfg, 96, chain, vocab_ids=torch.arange(10))
    with pytest.raises(ValueError, match="batch_size=1"):
        batch_drafter_for(DFlashProposer(d, 96))

    from types import SimpleNamespace

    pkg = SimpleNamespace(family=FAMILY, path=".", speculation={  # a tree measured faster
        "k_star": 3, "tree": {"depth": 3, "total_tokens": 8, "speedup": 9.0},
        "measured_speedup": {"speedup": 1.0}})
    assert settle({"tree": "auto"}, pkg).tree is False
    with pytest.raises(ValueError, match=r"tree=tree: a dflash draft drafts one chain"):
        settle({"tree": "tree"}, pkg)


def test_a_drafter_needs_resolved_values(target):
    with pytest.raises(ValueError, match="needs resolved fuse_layers and mask_token_id"):
        DFlashDrafter(DFlashConfig(), target.model.config)
    with pytest.raises(ValueError, match=r"fuse_layers \[9\] are not hidden-state ids"):
        build_dflash(DFlashConfig(fuse_layers=[9], mask_token_id=EOS), target.model)
