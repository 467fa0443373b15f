"""Draft families: construction, alignment, caches, vocab maps, save/load and short training."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from draftsmith.heads import draft_lm, eagle_ttt, medusa
from draftsmith.heads.draft_lm import DraftLMConfig, apply_lora, build_draft_lm
from draftsmith.heads.eagle import EagleHead, build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.medusa import MedusaConfig, build_medusa
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train.losses import DistillLoss
from draftsmith.train.metrics import acceptance_stats

B, T, V = 2, 10, 96


def _ids(seed: int = 0, b: int = B, t: int = T) -> torch.Tensor:
    return torch.randint(3, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _hidden(target: LlamaForCausalLM, ids: torch.Tensor, layers: bool = False):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    if layers:
        return out.hidden_states[-1], torch.stack(out.hidden_states, dim=1)  # (B, L+1, T, H)
    return out.hidden_states[-1]


def _counted(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None,
             shift: int) -> list[tuple[int, int]]:
    """The (b, t) entries a teacher offset ``shift`` counts, written out from the definition:
    token t+shift+1 exists, is not padding and has ``loss_mask`` set."""
    b_, t_ = loss_mask.shape
    return [(b, t) for b in range(b_) for t in range(t_)
            if t + shift + 1 < t_ and bool(loss_mask[b, t + shift + 1])
            and (attention_mask is None or bool(attention_mask[b, t + shift + 1]))]


def _check_packed(pos, counted: list[tuple[int, int]], shift: int, ids: torch.Tensor,
                  hidden: torch.Tensor, full_logits: torch.Tensor | None = None) -> None:
    """``pos`` holds exactly the counted entries, in (b, t) order, packed as (1, N, ...): the
    teacher row ``hidden[b, t+shift]`` (and its flat index), the label ``ids[b, t+shift+1]``
    and, when given, the draft logits of the full (B, T) forward at (b, t)."""
    n, seq = len(counted), ids.shape[1]
    assert pos.mask.shape == (1, n) and bool(pos.mask.all())
    assert pos.teacher_index[0].tolist() == [b * seq + t + shift for b, t in counted]
    assert torch.equal(pos.teacher_hidden[0],
                       torch.stack([hidden[b, t + shift] for b, t in counted]))
    assert pos.labels[0].tolist() == [int(ids[b, t + shift + 1]) for b, t in counted]
    assert pos.draft_logits.shape[:2] == (1, n)
    if full_logits is not None:
        want = torch.stack([full_logits[b, t] for b, t in counted])
        torch.testing.assert_close(pos.draft_logits[0], want, atol=1e-5, rtol=1e-5)


# ----- draft LM ------------------------------------------------------------------------------
def test_draft_lm_with_all_target_layers_reproduces_the_target():
    target = tiny_llama()
    cfg = DraftLMConfig.matching(target.config, 2, init="target", init_layers=[0, 1])
    draft = build_draft_lm(cfg, target).eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(draft(ids).logits, target(ids).logits, atol=1e-5)
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.eos_token_id == target.config.eos_token_id


def test_draft_lm_from_the_target_refuses_weights_it_does_not_copy(monkeypatch):
    """init='target' skips random init (every weight is copied): a draft architecture with a
    weight the copy does not know about is refused instead of left uninitialised."""
    target = tiny_llama()
    build = AutoModelForCausalLM.from_config

    def with_extra(config, **kw):
        model = build(config, **kw)
        model.model.extra_scale = torch.nn.Parameter(torch.empty(4))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", with_extra)
    with pytest.raises(ValueError, match=r"draft also has \['model.extra_scale'\]: use "
                                         "init='random'"):
        build_draft_lm(DraftLMConfig.matching(target.config, 2, init="target"), target)
    build_draft_lm(DraftLMConfig.matching(target.config, 2, init="random"), target)  # random: ok


def test_draft_lm_copies_chosen_layers_and_defaults_to_evenly_spaced():
    target = tiny_llama(layers=3)
    draft = build_draft_lm(DraftLMConfig.matching(target.config, 2, init="target"), target)
    assert draft_lm.default_init_layers(2, 3) == [0, 2]
    assert draft_lm.default_init_layers(2, 30) == [0, 29]
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight,
                       target.model.layers[2].mlp.up_proj.weight)
    assert not torch.equal(draft.model.layers[1].mlp.up_proj.weight,
                           target.model.layers[1].mlp.up_proj.weight)
    rnd = build_draft_lm(DraftLMConfig.matching(target.config, 2, init="random"), target)
    assert not torch.equal(rnd.model.embed_tokens.weight, target.model.embed_tokens.weight)


def test_draft_lm_config_errors_and_round_trip():
    target = tiny_llama()
    with pytest.raises(ValueError, match="hidden_size: draft 16 vs target 32"):
        build_draft_lm(DraftLMConfig(2, 16, 64, 4, 2, init="target"), target)
    with pytest.raises(ValueError, match="outside the target"):
        build_draft_lm(DraftLMConfig.matching(target.config, 1, init_layers=[5]), target)
    with pytest.raises(ValueError, match="init_layers has 1 entries"):
        DraftLMConfig.matching(target.config, 2, init_layers=[0])
    with pytest.raises(ValueError, match="init must be one of"):
        DraftLMConfig(init="copy")
    small = DraftLMConfig(num_layers=4, hidden_size=576, intermediate_size=1536, num_heads=9,
                          num_kv_heads=3)
    assert (small.num_layers, small.hidden_size) == (4, 576)
    assert DraftLMConfig.from_dict(small.to_dict()) == small
    # a random-init draft of another width is fine
    other = build_draft_lm(DraftLMConfig(1, 16, 32, 4, 2, init="random"), target)
    assert other.config.hidden_size == 16 and other.config.vocab_size == V


def test_draft_lm_save_load_round_trip(tmp_path):
    target = tiny_llama()
    draft = build_draft_lm(DraftLMConfig.matching(target.config, 1, init="target"), target)
    draft.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, draft.eval()(ids).logits, atol=1e-6)
    assert isinstance(loaded, LlamaForCausalLM) and loaded.config.num_hidden_layers == 1


def test_draft_lm_targets_alignment():
    target = tiny_llama()
    draft = build_draft_lm(DraftLMConfig.matching(target.config, 1), target)
    ids, hidden = _ids(), _hidden(target, _ids())
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, 7:] = 0
    (pos,) = draft_lm.distill_targets(draft, ids, hidden, loss_mask, pad)
    counted = _counted(loss_mask, pad, 0)
    assert counted == [(0, t) for t in range(T - 1)] + [(1, t) for t in range(6)]
    with torch.no_grad():
        full = draft(input_ids=ids, attention_mask=pad).logits  # (B, T, V)
    assert pos.draft_logits.shape == (1, len(counted), V)
    _check_packed(pos, counted, 0, ids, hidden, full)


def test_lora_trains_only_adapters_and_merges():
    target, teacher = tiny_llama(initializer_range=0.4), tiny_llama(seed=1, initializer_range=0.4)
    draft = build_draft_lm(DraftLMConfig.matching(target.config, 1), target)
    model = apply_lora(draft, r=4, alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = _ids(3, b=4, t=16)
    with torch.no_grad():
        teacher_logits = teacher(ids).logits
    loss_fn = DistillLoss({"fkl": 1.0})
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(15):
        loss = loss_fn(model(ids).logits, teacher_logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    model.eval()
    with torch.no_grad():
        before = model(ids).logits
        merged = model.merge_and_unload()
        assert isinstance(merged, LlamaForCausalLM)
        assert torch.allclose(merged(ids).logits, before, atol=1e-4)


# ----- Medusa --------------------------------------------------------------------------------
def test_medusa_heads_are_distinct_and_start_as_the_target_head():
    target = tiny_llama()
    heads = build_medusa(MedusaConfig(num_heads=3, num_layers=2), target)
    assert len({id(h) for h in heads.heads}) == 3
    assert len({id(b) for h in heads.heads for b in h.blocks}) == 6
    ptrs = {p.data_ptr() for p in heads.parameters()}
    assert len(ptrs) == len(list(heads.parameters()))
    hidden = _hidden(target, _ids())
    with torch.no_grad():
        logits = heads(hidden)
        assert logits.shape == (B, T, 3, V)
        want = target.lm_head(hidden)
        for i in range(3):
            assert torch.allclose(logits[:, :, i], want, atol=1e-5)
        heads.heads[0].blocks[0].linear.weight.add_(0.1)
        assert not torch.allclose(heads(hidden)[:, :, 0], want, atol=1e-4)
        assert torch.allclose(heads(hidden)[:, :, 1], want, atol=1e-5)


def test_medusa_config_and_alignment():
    cfg = MedusaConfig(num_heads=3, loss_decay=0.5)
    assert cfg.loss_weights() == [1.0, 0.5, 0.25]
    assert MedusaConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="loss_decay"):
        MedusaConfig(loss_decay=0.0)
    with pytest.raises(ValueError, match="unknown MedusaConfig keys"):
        MedusaConfig.from_dict({"heads": 2})
    target = tiny_llama()
    heads = build_medusa(cfg, target)
    ids = _ids()
    hidden = _hidden(target, ids)
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[:, :3] = False
    out = medusa.distill_targets(heads, ids, hidden, loss_mask)
    assert len(out) == 3
    for i, pos in enumerate(out):
        s = 1 + i
        counted = _counted(loss_mask, None, s)
        assert counted == [(b, t) for b in range(B) for t in range(T) if 3 <= t + s + 1 < T]
        with torch.no_grad():
            full = heads.head_logits(hidden, i)  # (B, T, V): head i at every position
        _check_packed(pos, counted, s, ids, hidden, full)


# ----- EAGLE ---------------------------------------------------------------------------------
LAYOUTS = {"eagle1": (EagleConfig, 1), "eagle3": (lambda **kw: EagleConfig(
    layout="eagle3", fuse_layers=[1, 0], **kw), 2)}


def _feats(hidden, k):
    """k fused 'layers' made from the final hidden state (the head only sees widths)."""
    return torch.cat([hidden * (1 + 0.5 * i) for i in range(k)], dim=-1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_eagle_cache_step_by_step_equals_full_sequence(layout):
    make, k = LAYOUTS[layout]
    target = tiny_llama()
    head = build_eagle(make(), target).eval()
    ids = _ids()
    hidden = _feats(_hidden(target, ids), k)
    with torch.no_grad():
        full = head(hidden, ids)
        assert full.shape == (B, T, 32)
        cache = head.new_cache()
        parts = [head(hidden[:, :4], ids[:, :4], past_key_values=cache)]
        for t in range(4, T):
            parts.append(head(hidden[:, t:t + 1], ids[:, t:t + 1], past_key_values=cache))
        assert cache.get_seq_length() == T
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_eagle_unrolled_steps_equal_step_by_step_drafting(layout):
    make, k = LAYOUTS[layout]
    target = tiny_llama()
    head = build_eagle(make(ttt_steps=3), target).eval()
    ids = _ids()
    hidden = _feats(_hidden(target, ids), k)
    with torch.no_grad():
        outs = eagle_ttt.eagle_unrolled_forward(head, hidden, ids, 3)
        for t in (0, 3, 6):
            cache = head.new_cache()
            own = head(hidden[:, : t + 1], ids[:, 1: t + 2], past_key_values=cache)[:, -1:]
            assert torch.allclose(own[:, 0], outs[0][:, t], atol=1e-5)
            for s in (2, 3):
                own = head(own, ids[:, t + s: t + s + 1], past_key_values=cache)
                assert torch.allclose(own[:, 0], outs[s - 1][:, t], atol=1e-5)
        # a broken alignment (true features at step 2) gives different outputs
        wrong = head(hidden[:, 1: T - 1], ids[:, 2:])
        assert not torch.allclose(wrong[:, 3], outs[1][:, 3], atol=1e-3)


def test_eagle3_layout_structure_and_config_errors():
    """layout=eagle3: fc over the fused layers only, q/k/v over [embedding, hidden] (2H), the
    pre-norm output fed back (width H, no fc), logits through the output norm."""
    target = tiny_llama()
    head = build_eagle(EagleConfig(layout="eagle3", fuse_layers=[0, 1]), target).eval()
    h = target.config.hidden_size
    assert head.fc.in_features == 2 * h and head.fc.bias is None and head.self_fc is None
    assert head.layer.self_attn.q_proj.in_features == 2 * h
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    ids = _ids()
    feats = _feats(_hidden(target, ids), 2)
    with torch.no_grad():
        out = head(feats, ids)
        torch.testing.assert_close(head.compute_logits(out),
                                   head.lm_head(head.norm(out)))  # the norm is in the logits
        assert head(out, ids).shape == out.shape  # own predictions: width H, no fusion
    keys = set(head.trainable_state_dict())
    assert {"layer.hidden_norm.weight", "layer.input_layernorm.weight", "norm.weight"} <= keys
    with pytest.raises(ValueError, match="features have width"):
        head(feats[..., :5], ids)
    with pytest.raises(ValueError, match=r"layout=eagle3 fuses several.*fuse_layers"):
        EagleConfig(layout="eagle3")
    with pytest.raises(ValueError, match=r"layout=eagle3 fuses several"):
        EagleConfig(layout="eagle3", fuse_layers=[2])
    with pytest.raises(ValueError, match="init_layer cannot seed an eagle3 layer"):
        EagleConfig(layout="eagle3", fuse_layers=[0, 1], init_layer=0)


def test_eagle_padding_does_not_leak_into_valid_positions():
    target = tiny_llama()
    head = build_eagle(EagleConfig(), target).eval()
    ids = _ids()
    hidden = _hidden(target, ids)
    pad = torch.ones(B, T, dtype=torch.long)
    pad[0, 6:] = 0
    ids2, hidden2 = ids.clone(), hidden.clone()
    ids2[0, 6:], hidden2[0, 6:] = 0, 5.0
    with torch.no_grad():
        a = eagle_ttt.eagle_unrolled_forward(head, hidden, ids, 2, attention_mask=pad)
        b = eagle_ttt.eagle_unrolled_forward(head, hidden2, ids2, 2, attention_mask=pad)
    assert torch.allclose(a[0][0, :5], b[0][0, :5], atol=1e-5)  # step 1 valid: t + 1 <= 5
    assert torch.allclose(a[1][0, :4], b[1][0, :4], atol=1e-5)  # step 2 valid: t + 2 <= 5


def test_eagle_frozen_parts_are_not_saved_and_reattach():
    target = tiny_llama()
    head = build_eagle(EagleConfig(), target)
    state = head.trainable_state_dict()
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in state)
    frozen = [n for n, p in head.named_parameters() if not p.requires_grad]
    assert sorted(frozen) == ["embed_tokens.weight", "lm_head.weight"]
    fresh = EagleHead(EagleConfig(), target.config)
    fresh.load_trainable_state_dict(state)
    fresh.attach_target(target)
    ids = _ids()
    hidden = _hidden(target, ids)
    with torch.no_grad():
        assert torch.allclose(fresh.eval()(hidden, ids), head.eval()(hidden, ids), atol=1e-6)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_trainable_state_dict({k: v for k, v in state.items() if k != "fc.weight"})
    with pytest.raises(ValueError, match="another target"):
        fresh.attach_target(tiny_llama(vocab=64))


@pytest.mark.parametrize("family", ["eagle", "dflash"])
def test_a_head_without_its_target_weights_is_refused_until_attached(family):
    """The frozen embedding and LM head are built unset (meta: no random values to overwrite)
    and a proposer refuses the head until ``attach_target``."""
    from draftsmith.eval.decoding.proposers_dflash import DFlashProposer
    from draftsmith.eval.decoding.proposers_eagle import EagleProposer
    from draftsmith.heads.dflash import DFlashConfig, DFlashDrafter

    target = tiny_llama()
    head, proposer = {
        "eagle": (lambda: EagleHead(EagleConfig(), target.config), EagleProposer),
        "dflash": (lambda: DFlashDrafter(DFlashConfig(fuse_layers=[1, 2], num_layers=1,
                                                      block_size=4, mask_token_id=3),
                                         target.config), DFlashProposer)}[family]
    head = head()
    assert not head.target_attached and head.embed_tokens.weight.is_meta
    with pytest.raises(ValueError, match="not attached: load the draft with its target"):
        proposer(head, V)
    head.attach_target(target)
    assert head.target_attached
    assert head.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    proposer(head, V)  # accepted now


def test_build_vocab_map_and_reduced_vocab_head():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_map(counts, 4)
    assert d2t.tolist() == [0, 2, 3, 5]
    assert t2d.tolist() == [i in (0, 2, 3, 5) for i in range(8)]
    d2t, _ = build_vocab_map(counts, 4, always_include=[6])
    assert d2t.tolist() == [2, 3, 5, 6]
    tie, _ = build_vocab_map(torch.tensor([1, 1, 1, 1]), 2)
    assert tie.tolist() == [0, 1]
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..8"):
        build_vocab_map(counts, 9)
    target = tiny_llama()
    with pytest.raises(ValueError, match="token_counts"):
        build_eagle(EagleConfig(draft_vocab_size=20), target)
    counts = torch.arange(V)  # the highest ids are the most frequent; EOS (id 2) is rare
    head = build_eagle(EagleConfig(draft_vocab_size=20), target, token_counts=counts)
    assert head.d2t.tolist() == [target.config.eos_token_id] + list(range(V - 19, V))
    assert head.t2d.sum().item() == 20 and bool(head.t2d[target.config.eos_token_id])
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.d2t])
    assert head.lm_head.weight.requires_grad and "lm_head.weight" in head.trainable_state_dict()
    assert "d2t" in head.trainable_state_dict()
    ids = _ids()
    logits = head.compute_logits(head(_hidden(target, ids), ids))
    assert logits.shape == (B, T, 20)
    assert torch.equal(head.to_target_ids(torch.tensor([0, 19])), head.d2t[[0, 19]])


def test_eagle_fused_layers_noise_and_errors():
    target = tiny_llama()
    cfg = EagleConfig(fuse_layers=[0, 1, 2], ttt_steps=2, feature_noise=0.1)
    head = build_eagle(cfg, target)
    assert head.fc.in_features == 4 * 32 and head.self_fc is not None
    ids = _ids()
    hidden, layers = _hidden(target, ids, layers=True)
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    out = eagle_ttt.distill_targets(head, ids, hidden, loss_mask, layers=layers,
                                layer_ids=[0, 1, 2])
    assert [o.draft_logits.shape for o in out] == [(1, B * (T - 2), V), (1, B * (T - 3), V)]
    assert out[1].draft_hidden.shape == (1, B * (T - 3), 32)
    _check_packed(out[1], [(b, t) for b in range(B) for t in range(T - 3)], 2, ids, hidden)
    again = eagle_ttt.distill_targets(head, ids, hidden, loss_mask, layers=layers,
                                      layer_ids=[0, 1, 2])
    assert not torch.allclose(out[0].draft_hidden, again[0].draft_hidden)  # training noise
    head.eval()
    e1 = eagle_ttt.distill_targets(head, ids, hidden, loss_mask, layers=layers, layer_ids=[0, 1, 2])
    e2 = eagle_ttt.distill_targets(head, ids, hidden, loss_mask, layers=layers, layer_ids=[0, 1, 2])
    assert torch.equal(e1[0].draft_hidden, e2[0].draft_hidden)
    with pytest.raises(ValueError, match="not in the feature cache"):
        eagle_ttt.distill_targets(head, ids, hidden, loss_mask, layers=layers[:, :2],
                              layer_ids=[0, 1])
    with pytest.raises(ValueError, match="features have width"):
        head(torch.zeros(B, T, 64), ids)
    with pytest.raises(ValueError, match="fuse_layers"):
        EagleHead(EagleConfig(fuse_layers=[7]), target.config)


def test_eagle_layouts_structure_init_and_config():
    target = tiny_llama()
    ids = _ids()
    hidden = _hidden(target, ids)
    e1 = build_eagle(EagleConfig(init_layer=1), target).eval()  # default layout: eagle1
    assert e1.cfg.layout == "eagle1" and e1.fc.bias is None
    assert isinstance(e1.layer.input_layernorm, torch.nn.Identity)
    assert isinstance(e1.norm, torch.nn.Identity)
    keys = set(e1.trainable_state_dict())
    assert "layer.post_attention_layernorm.weight" in keys  # engines keep this norm
    assert not keys & {"fc.bias", "norm.weight", "layer.input_layernorm.weight"}
    src = target.model.layers[1].state_dict()
    for k, v in e1.layer.state_dict().items():  # init_layer copies all but the input norm
        assert torch.equal(v, src[k])
    normed = build_eagle(EagleConfig(layout="normed"), target).eval()
    assert normed.fc.bias is not None
    assert torch.equal(normed.norm.weight, target.model.norm.weight)
    assert {"fc.bias", "norm.weight", "layer.input_layernorm.weight"} <= set(
        normed.trainable_state_dict())

    def rms(out, w):
        return (out / w).pow(2).mean(-1).sqrt()

    with torch.no_grad():  # only the normed head's output is RMS-normalised (per norm weight)
        ones = torch.ones(B, T)
        assert torch.allclose(rms(normed(hidden, ids), normed.norm.weight), ones, atol=1e-3)
        assert not torch.allclose(rms(e1(hidden, ids), target.model.norm.weight), ones, atol=0.1)
    fused = build_eagle(EagleConfig(fuse_layers=[0, 2]), target)  # still allowed in eagle1
    assert fused.fc.bias is None and fused.self_fc.bias is None
    assert EagleConfig.from_dict({"ttt_steps": 2}).layout == "eagle1"  # missing key: default
    assert EagleConfig.from_dict(normed.cfg.to_dict()) == normed.cfg
    with pytest.raises(ValueError, match=r"layout must be one of \('eagle1', 'normed', 'eagle3'\)"
                       r".*'eagle2'"):
        EagleConfig(layout="eagle2")


# ----- short training of each family -----------------------------------------------------------
def _family(kind: str, target: LlamaForCausalLM):
    if kind == "lm":
        cfg = DraftLMConfig.matching(target.config, 1, init="random")
        return build_draft_lm(cfg, target), draft_lm.distill_targets
    if kind == "medusa":
        return build_medusa(MedusaConfig(num_heads=2), target), medusa.distill_targets
    return build_eagle(EagleConfig(ttt_steps=2), target), eagle_ttt.distill_targets


@pytest.mark.parametrize("kind", ["lm", "medusa", "eagle"])
def test_training_steps_lower_loss_and_raise_acceptance(kind):
    torch.manual_seed(0)
    target = tiny_llama(initializer_range=0.4)
    ids = _ids(7, b=4, t=24)
    hidden = _hidden(target, ids)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    model, targets_fn = _family(kind, target)
    weight = target.lm_head.weight.detach()
    loss_fn = DistillLoss({"fkl": 1.0, "tvd": 1.0})
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def alphas() -> list[float]:
        with torch.no_grad():
            outs = targets_fn(model, ids, hidden, loss_mask)
        return [acceptance_stats(o.draft_logits, o.mask, o.teacher_hidden, weight).alpha
                for o in outs]

    before = alphas()
    losses = []
    for _ in range(40):
        outs = targets_fn(model, ids, hidden, loss_mask)
        loss = sum(loss_fn(o.draft_logits, None, o.mask, teacher_hidden=o.teacher_hidden,
                           lm_head_weight=weight) for o in outs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = alphas()
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    assert all(a > b + 0.05 for a, b in zip(after, before)), (before, after)


@pytest.mark.real
def test_families_on_the_real_target(real_target):
    """A 2-layer draft LM, Medusa and EAGLE build on SmolLM2-135M and produce aligned shapes."""
    model = real_target.model
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 378]])
    hidden = _hidden(model, ids)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    vocab = model.config.vocab_size
    draft = build_draft_lm(DraftLMConfig(num_layers=2, hidden_size=576, intermediate_size=1536,
                                         num_heads=9, num_kv_heads=3), model)
    assert draft.config.num_hidden_layers == 2
    assert torch.equal(draft.model.layers[1].self_attn.q_proj.weight,
                       model.model.layers[29].self_attn.q_proj.weight)
    heads = build_medusa(MedusaConfig(num_heads=2), model)
    head = build_eagle(EagleConfig(ttt_steps=2), model).eval()
    with torch.no_grad():
        # position 1 counts 7 of the 8 tokens for the draft LM, 6 for Medusa and EAGLE
        for fn, m, n in ((draft_lm.distill_targets, draft, 7), (medusa.distill_targets, heads, 6),
                         (eagle_ttt.distill_targets, head, 6)):
            out = fn(m, ids, hidden, loss_mask)
            assert out[0].draft_logits.shape == (1, n, vocab)
        full = head(hidden, ids)
        cache = head.new_cache()
        steps = [head(hidden[:, t:t + 1], ids[:, t:t + 1], past_key_values=cache) for t in range(8)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4)


def test_targets_are_the_counted_rows_of_the_full_forward():
    """Every family returns exactly its counted entries, in order, packed as (1, N, ...), with
    the logits its full (B, T) forward has there, under padding and a ragged loss mask."""
    target = tiny_llama(seed=3)
    torch.manual_seed(0)
    ids = torch.randint(3, 96, (2, 12))
    hidden = target.model(ids).last_hidden_state.detach()
    loss_mask = torch.rand(2, 12) > 0.3
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[1, 9:] = 0
    draft = build_draft_lm(DraftLMConfig.matching(target.config, 1), target).eval()
    heads = build_medusa(MedusaConfig(num_heads=2), target).eval()
    head = build_eagle(EagleConfig(ttt_steps=2), target).eval()
    with torch.no_grad():
        full = {
            "lm": [draft(input_ids=ids, attention_mask=attn).logits],
            "medusa": [heads.head_logits(hidden, i) for i in range(2)],
            "eagle": [head.compute_logits(o) for o in
                      eagle_ttt.eagle_unrolled_forward(head, hidden, ids, 2, attn)],
        }
        got = {"lm": draft_lm.distill_targets(draft, ids, hidden, loss_mask, attention_mask=attn),
               "medusa": medusa.distill_targets(heads, ids, hidden, loss_mask, attention_mask=attn),
               "eagle": eagle_ttt.distill_targets(head, ids, hidden, loss_mask,
                                                  attention_mask=attn)}
    shifts = {"lm": [0], "medusa": [1, 2], "eagle": [1, 2]}
    for kind, positions in got.items():
        assert len(positions) == len(shifts[kind]), kind
        for pos, shift, logits in zip(positions, shifts[kind], full[kind]):
            counted = _counted(loss_mask, attn, shift)
            assert 0 < len(counted) < 2 * 12 - shift - 1  # the mask and the padding both bite
            _check_packed(pos, counted, shift, ids, hidden, logits)
