"""The draft families directly: the registry (heads/family.py), build -> save -> load on a tiny
target, the stored tensors, the config checks, export formats and the per-family position
defaults."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target, randomize
from omegaconf import OmegaConf

from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.exports import export_format, export_formats, format_families
from draftsmith.heads.family import FAMILIES, get_family
from draftsmith.heads.family_base import HeadStateError, load_object
from draftsmith.heads.medusa import MedusaConfig

REPO = Path(__file__).resolve().parents[2]
DRAFT_CONF = REPO / "conf" / "draft"
KINDS = ("lm", "medusa", "eagle", "dflash")
LAYERS = 4  # conf/draft/lm.yaml asks for 4 target-initialised layers
# the tiny target's padding row (dflash's default mask id) is all zeros: mask with its EOS id
OVERRIDES = {"dflash": {"mask_token_id": 2}}


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(seed=0, layers=LAYERS)


def _draft_group(kind: str) -> dict:
    """conf/draft/<kind>.yaml with its ``${..}`` interpolations resolved, as train/trainable.py
    resolves ``cfg.draft`` (``OmegaConf.to_container(..., resolve=True)``)."""
    return OmegaConf.to_container(OmegaConf.load(DRAFT_CONF / f"{kind}.yaml"), resolve=True)


def _built(kind: str, target, seed: int = 1, **config):
    """The family, its head config (from the yaml's ``config:`` block, ``config`` overriding
    keys) and a built module with every trainable tensor moved off its initial value."""
    family = FAMILIES[kind]
    raw = {**_draft_group(kind)["config"], **OVERRIDES.get(kind, {}), **config}
    head_cfg = family.head_config(raw, target.model.config)
    counts = None
    if family.needs_token_counts(head_cfg):
        counts = torch.arange(target.model.config.vocab_size, 0, -1)  # small ids most frequent
    module = family.build(head_cfg, target.model, token_counts=counts)
    return family, head_cfg, randomize(module, seed=seed)


def _outputs(kind: str, module, target) -> torch.Tensor:
    """The module's logits on one fixed input (tokens, and target features where it reads them)."""
    cfg = target.model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=g)
    features = torch.randn(2, 7, cfg.hidden_size, generator=g)
    with torch.no_grad():
        if kind == "lm":
            return module(ids).logits
        if kind == "medusa":
            return module(features)
        if kind == "dflash":  # blocks at two anchors per row over the fused target layers
            fused = torch.randn(2, 7, module.fc.in_features, generator=g)
            return module.compute_logits(module(fused, ids, torch.tensor([[1, 4], [2, 5]])))
        return module.compute_logits(module(features, ids))


def _empty(family, head_cfg, target):
    """An untrained head of the same shapes, as a package load starts from."""
    if family.name == "lm":  # the draft LM loads with from_pretrained: a fresh build stands in
        return family.build(head_cfg, target.model)
    return family.empty_head(head_cfg, target.identity.to_dict(), target.model.config,
                             target.model)


# ----- the registry ----------------------------------------------------------------------------
def test_families_are_the_kinds_of_the_draft_configs():
    kinds = {OmegaConf.load(p).kind for p in DRAFT_CONF.glob("*.yaml")}
    assert set(FAMILIES) == kinds == set(KINDS)
    for name, family in FAMILIES.items():
        assert family.name == name and get_family(name) is family


def test_each_family_names_an_existing_proposer_and_its_config_class():
    for family in FAMILIES.values():
        module, cls = family.proposer.rsplit(".", 1)
        proposer = getattr(importlib.import_module(module), cls)
        assert callable(getattr(proposer, "for_draft", None)), family.proposer
        cfg = family.config_class()
        assert family.config_class.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", ["x", "", None, "LM"])
def test_get_family_of_an_unknown_name_lists_the_known_ones(name):
    with pytest.raises(ValueError, match=re.escape(f"unknown draft family {name!r}")) as e:
        get_family(name)
    assert all(kind in str(e.value) for kind in KINDS)


# ----- head configs from conf/draft/*.yaml ------------------------------------------------------
def test_head_configs_from_the_draft_configs(target):
    tc = target.model.config
    lm = FAMILIES["lm"].head_config(_draft_group("lm")["config"], tc)
    # no widths given: the target's, so init=target can copy its layers
    assert (lm.num_layers, lm.init, lm.hidden_size, lm.intermediate_size, lm.num_heads,
            lm.num_kv_heads) == (4, "target", tc.hidden_size, tc.intermediate_size,
                                 tc.num_attention_heads, tc.num_key_value_heads)
    explicit = FAMILIES["lm"].head_config({"num_layers": 1, "hidden_size": 16,
                                           "intermediate_size": 24, "num_heads": 2,
                                           "num_kv_heads": 1, "init": "random"}, tc)
    assert (explicit.hidden_size, explicit.intermediate_size) == (16, 24)
    medusa_group = _draft_group("medusa")
    medusa = FAMILIES["medusa"].head_config(medusa_group["config"], tc)
    assert medusa == MedusaConfig(num_heads=4, num_layers=1, loss_decay=0.8)
    assert medusa_group["num_positions"] == medusa.num_heads  # ${.config.num_heads}
    eagle_group = _draft_group("eagle")
    eagle = FAMILIES["eagle"].head_config(eagle_group["config"], tc)
    assert eagle.ttt_steps == eagle_group["num_positions"] == 3  # ${..num_positions}
    assert (eagle.draft_vocab_size, eagle.fuse_layers, eagle.layout) == (None, None, "eagle1")


# ----- build -> save -> load ---------------------------------------------------------------------
@pytest.mark.parametrize("kind,config", [("lm", {}), ("medusa", {}), ("eagle", {}),
                                         ("eagle", {"draft_vocab_size": 40,
                                                    "fuse_layers": [1, 2, 4]}),
                                         ("dflash", {"num_layers": 2, "fuse_layers": [3, 0]})],
                         ids=["lm", "medusa", "eagle", "eagle-reduced-fused", "dflash"])
def test_build_save_load_gives_identical_outputs(target, tmp_path, kind, config):
    family, head_cfg, module = _built(kind, target, **config)
    module.eval()
    folder = tmp_path / kind
    folder.mkdir()
    family.save(module, head_cfg, folder)
    loaded = family.load(folder, head_cfg, target.identity.to_dict(), target.model.config,
                         target.model).eval()
    want = _outputs(kind, module, target)
    got = _outputs(kind, loaded, target)
    assert torch.equal(got, want)
    # the comparison sees the weights: an untrained head of the same shapes answers otherwise
    assert not torch.allclose(_outputs(kind, _empty(family, head_cfg, target).eval(), target),
                              want)
    if kind == "eagle" and config:
        assert torch.equal(loaded.d2t, module.d2t) and torch.equal(loaded.t2d, module.t2d)
        assert torch.equal(family.draft_to_target(loaded, head_cfg), module.d2t)


def test_draft_to_target_only_for_a_reduced_vocabulary(target):
    for kind in KINDS:
        family, head_cfg, module = _built(kind, target)
        assert family.draft_to_target(module, head_cfg) is None
    family, head_cfg, module = _built("eagle", target, draft_vocab_size=40)
    d2t = family.draft_to_target(module, head_cfg)
    assert d2t.shape == (40,) and torch.equal(d2t, module.d2t)
    assert d2t.data_ptr() != module.d2t.data_ptr()  # a copy: training cannot change the head


def test_a_reduced_eagle_vocabulary_needs_token_counts(target):
    family = FAMILIES["eagle"]
    reduced = EagleConfig(draft_vocab_size=40)
    assert family.needs_token_counts(reduced) and not family.needs_token_counts(EagleConfig())
    assert not FAMILIES["lm"].needs_token_counts(FAMILIES["lm"].config_class())
    with pytest.raises(ValueError, match="needs the training split to count tokens"):
        family.build(reduced, target.model)


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_refuses_a_missing_an_extra_or_a_misshapen_tensor(target, kind):
    family, head_cfg, module = _built(kind, target)
    state = family.saved_state(module, head_cfg)
    head = _empty(family, head_cfg, target)
    key = max(state)
    with pytest.raises(HeadStateError, match=rf"missing \['{re.escape(key)}'\]"):
        family.load_state(head, head_cfg, {k: v for k, v in state.items() if k != key})
    with pytest.raises(HeadStateError, match=r"unexpected \['bogus.weight'\]"):
        family.load_state(head, head_cfg, {**state, "bogus.weight": torch.zeros(2)})
    bad = dict(state)
    bad[key] = torch.zeros(*state[key].shape[:-1], state[key].shape[-1] + 1)
    with pytest.raises(HeadStateError, match=rf"tensor shapes do not fit the head.*{key}"):
        family.load_state(head, head_cfg, bad)
    family.load_state(head, head_cfg, state)  # the whole stored state fits and is loaded
    own = head.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items())


def test_eagle_stores_no_target_embedding_and_no_target_lm_head(target):
    family, head_cfg, module = _built("eagle", target)
    full = set(module.state_dict())
    stored = set(family.saved_state(module, head_cfg))
    assert {"embed_tokens.weight", "lm_head.weight"} <= full
    assert full - stored == {"embed_tokens.weight", "lm_head.weight"}
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in stored)
    family, head_cfg, module = _built("eagle", target, draft_vocab_size=40)
    stored = family.saved_state(module, head_cfg)
    assert set(module.state_dict()) - set(stored) == {"embed_tokens.weight"}
    assert stored["lm_head.weight"].shape == (40, target.model.config.hidden_size)
    assert {"d2t", "t2d"} <= set(stored)  # the reduced head's own LM head and vocabulary map


@pytest.mark.parametrize("kind", ["lm", "medusa"])
def test_the_other_families_store_every_tensor_independently(target, kind):
    family, head_cfg, module = _built(kind, target)
    stored = family.saved_state(module, head_cfg)
    assert set(stored) == set(module.state_dict())
    ptrs = [v.data_ptr() for v in stored.values()]
    assert len(set(ptrs)) == len(ptrs)  # no shared storage (safetensors refuses it)
    assert all(v.is_contiguous() and v.device.type == "cpu" for v in stored.values())


# ----- config checks ---------------------------------------------------------------------------
def test_validate_refuses_a_bad_eagle_draft_vocab_size_naming_the_key():
    eagle = FAMILIES["eagle"]
    for bad in (0, -3, "40", 2.5):
        with pytest.raises(ValueError, match=re.escape(f"draft.config.draft_vocab_size={bad!r}")):
            eagle.validate({"config": {"draft_vocab_size": bad}})
    for good in (None, 1, 40):
        eagle.validate({"config": {"draft_vocab_size": good}})
    eagle.validate({"config": None})
    for kind in ("lm", "medusa"):  # no target-independent checks of their own
        FAMILIES[kind].validate(_draft_group(kind))


def test_validate_against_target_refuses_values_the_target_cannot_serve():
    lm, eagle = FAMILIES["lm"], FAMILIES["eagle"]
    sizes = {"vocab_size": 96, "hidden_size": 32, "num_layers": 4}
    with pytest.raises(ValueError, match=r"draft.config.hidden_size=16 .*init=target"):
        lm.validate_against_target({"config": {"hidden_size": 16, "init": "target"}}, **sizes)
    lm.validate_against_target({"config": {"hidden_size": 16, "init": "random"}}, **sizes)
    lm.validate_against_target({"config": {"hidden_size": 32, "init": "target"}}, **sizes)
    with pytest.raises(ValueError, match=r"draft.config.num_layers=5 exceeds the target's 4"):
        lm.validate_against_target({"config": {"num_layers": 5, "init": "target"}}, **sizes)
    lm.validate_against_target({"config": {"num_layers": 4, "init": "target"}}, **sizes)
    lm.validate_against_target({"config": {"num_layers": 5, "init": "random"}}, **sizes)
    with pytest.raises(ValueError, match=r"draft.config.draft_vocab_size=97 exceeds .*\(96\)"):
        eagle.validate_against_target({"config": {"draft_vocab_size": 97}}, **sizes)
    eagle.validate_against_target({"config": {"draft_vocab_size": 96}}, **sizes)
    for bad, named in (([0, 5], "[5]"), ([-1, 2], "[-1]")):
        message = re.escape(f"draft.config.fuse_layers has ids {named}")
        with pytest.raises(ValueError, match=message):
            eagle.validate_against_target({"config": {"fuse_layers": bad}}, **sizes)
    eagle.validate_against_target({"config": {"fuse_layers": [0, 2, 4]}}, **sizes)
    FAMILIES["medusa"].validate_against_target(_draft_group("medusa"), **sizes)


def test_check_init_from_refuses_an_eagle_package_fusing_other_layers():
    eagle = FAMILIES["eagle"]
    fused = EagleConfig(fuse_layers=[1, 2])
    for want in (None, [1], [2, 1]):
        with pytest.raises(ValueError, match=r"fuses target layers \[1, 2\] but "
                                             r"draft.config.fuse_layers is"):
            eagle.check_init_from(fused, {"config": {"fuse_layers": want}}, "pkg")
    eagle.check_init_from(fused, {"config": {"fuse_layers": [1, 2]}}, "pkg")
    with pytest.raises(ValueError, match=r"set draft.config.fuse_layers=null"):
        eagle.check_init_from(EagleConfig(), {"config": {"fuse_layers": [1, 2]}}, "pkg")
    eagle.check_init_from(EagleConfig(), {"config": {"fuse_layers": None}}, "pkg")


# ----- export formats, positions ---------------------------------------------------------------
def test_each_export_format_names_its_families_and_only_gguf_is_shared():
    per_family = [set(f.export_formats) for f in FAMILIES.values()]
    assert all(per_family)
    assert set().union(*per_family) == set(export_formats())
    assert len(set(export_formats())) == len(export_formats())
    for fmt in export_formats():
        assert format_families(fmt) == tuple(f for f in FAMILIES.values()
                                             if fmt in f.export_formats)
        assert len(format_families(fmt)) == 1 or fmt == "gguf"
    for family in FAMILIES.values():
        for fmt in family.export_formats:
            layout = export_format(fmt, family)
            assert callable(load_object(layout.writer)) and callable(load_object(layout.reader))
    assert {f.name: f.export_formats for f in FAMILIES.values()} == {
        "lm": ("hf", "gguf"), "medusa": ("medusa",),
        "eagle": ("eagle", "eagle3", "speculators", "gguf"), "dflash": ("dflash", "gguf")}
    # a draft LM's GGUF is written directly; the others go through llama.cpp's converter
    assert {f.name: f.gguf_layout for f in FAMILIES.values() if "gguf" in f.export_formats} == {
        "lm": None, "eagle": "eagle3", "dflash": "zlab_dflash"}


def test_the_bench_configs_have_a_key_per_family_they_run():
    bench = OmegaConf.load(REPO / "conf" / "eval" / "bench.yaml")
    batch = OmegaConf.load(REPO / "conf" / "eval" / "bench_batch.yaml")
    assert all(name in bench for name in FAMILIES)
    assert {f.name for f in FAMILIES.values() if f.batch_drafter} <= set(batch)


def test_num_positions_and_default_position_weights_per_family():
    lm, medusa, eagle = (FAMILIES[k] for k in KINDS[:3])
    lm_cfg = lm.config_class()
    assert [lm.num_positions(lm_cfg, n) for n in (1, 3)] == [1, 1]  # a chain draft: one token
    assert lm.default_position_weights(lm_cfg, 1) == [1.0]
    m_cfg = MedusaConfig(num_heads=3, loss_decay=0.5)
    assert [medusa.num_positions(m_cfg, n) for n in (1, 3, 5)] == [1, 3, 3]  # capped by heads
    assert medusa.default_position_weights(m_cfg, 3) == [1.0, 0.5, 0.25]
    e_cfg = EagleConfig(ttt_steps=2)
    assert [eagle.num_positions(e_cfg, n) for n in (1, 3, 5)] == [1, 3, 5]
    assert eagle.default_position_weights(e_cfg, 3) == pytest.approx([1.0, 0.8, 0.64])
    assert medusa.max_draft_length(m_cfg) == 3 and medusa.default_draft_length(m_cfg) == 3
    assert lm.max_draft_length(lm_cfg) is None and lm.default_draft_length(lm_cfg) == 3


def test_every_family_builds_an_empty_head_of_the_trained_shapes():
    """``empty_head`` (what a package's weights are loaded into) has the shapes ``build`` makes;
    the base class declares both abstract, so a family without them cannot be created."""
    from draftsmith.heads.draft_lm import DraftLMConfig
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.heads.family import get_family
    from draftsmith.heads.family_base import DraftFamily
    from draftsmith.heads.medusa import MedusaConfig

    target = make_tiny_target()
    tc = target.model.config
    dflash = get_family("dflash").head_config({"mask_token_id": 2, "num_layers": 2}, tc)
    for kind, cfg in (("lm", DraftLMConfig.matching(tc, num_layers=1)), ("eagle", EagleConfig()),
                      ("medusa", MedusaConfig(num_heads=2, num_layers=1)), ("dflash", dflash)):
        family = get_family(kind)
        built = family.build(cfg, target.model).state_dict()
        empty = family.empty_head(cfg, target.identity.to_dict(), tc, target.model).state_dict()
        assert {k: v.shape for k, v in empty.items()} == {k: v.shape for k, v in built.items()}
    with pytest.raises(TypeError, match="abstract"):
        DraftFamily()


def test_draft_vocab_size_auto_follows_the_target_vocabulary():
    """``draft_vocab_size: auto``: the target's own vocabulary up to 32,768 ids, else 32,768 of
    its most frequent (EAGLE-3's size for Llama 3), resolved from the target's config."""
    from transformers import LlamaConfig

    family = get_family("eagle")
    family.validate({"config": {"draft_vocab_size": "auto"}})  # accepted before the target loads
    small, big = LlamaConfig(vocab_size=32000), LlamaConfig(vocab_size=262144)
    assert family.resolve_config({"draft_vocab_size": "auto"}, small)["draft_vocab_size"] is None
    assert family.resolve_config({"draft_vocab_size": "auto"}, big)["draft_vocab_size"] == 32768
    assert family.resolve_config({"draft_vocab_size": 512}, big)["draft_vocab_size"] == 512
    with pytest.raises(ValueError, match="null, auto or a positive integer"):
        family.validate({"config": {"draft_vocab_size": "most"}})
