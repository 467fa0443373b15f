"""Every draft family on tiny random targets of seven architectures.

For Llama, Qwen 2, Qwen 3, Mistral, Gemma 2, Gemma 3 and Phi-3 (a few layers each; Mistral and
the Gemmas with a sliding window shorter than the decoded sequences, Gemma 2 with final logit
soft-capping, Gemma with a head dim that is not hidden / heads): each family trains a few steps,
writes a package that loads back, decodes greedily identical to the target's own ``generate`` in
fp32 (chain, and tree where the family drafts trees), and the derived draft config and the
exports carry the target's values.
Twins: a draft layer with the wrong RoPE theta, or an export with the wrong layer ids, fails the
same checks.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from draftsmith.data.identity import TargetIdentity
from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.decoding.proposers import DraftLMProposer
from draftsmith.eval.decoding.proposers_dflash import DFlashProposer
from draftsmith.eval.decoding.proposers_eagle import EagleProposer
from draftsmith.eval.decoding.proposers_medusa import MedusaProposer, medusa_choices
from draftsmith.heads.draft_config import draft_layer_config, rope_parameters
from draftsmith.heads.family import get_family
from draftsmith.heads.family_base import TreeKind
from draftsmith.heads.package import load_package, save_package
from draftsmith.train.trainable import DistillModule

VOCAB, HIDDEN, LAYERS = 96, 64, 4
COMMON = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 96,
          "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0}
WINDOW = 8  # shorter than prompt + generated tokens: windows are exercised
ARCHS = {
    "llama": lambda: LlamaConfig(**COMMON, rope_theta=5e4),
    "qwen2": lambda: Qwen2Config(**COMMON, rope_theta=2e5),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, rope_theta=3e5),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW, rope_theta=7e4),
    "gemma2": lambda: Gemma2Config(**COMMON, head_dim=24, sliding_window=WINDOW,
                                   final_logit_softcapping=3.0, query_pre_attn_scalar=24),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=24, sliding_window=WINDOW,
                                       layer_types=["sliding_attention", "sliding_attention",
                                                    "full_attention", "sliding_attention"],
                                       query_pre_attn_scalar=24),
    "phi3": lambda: Phi3Config(**COMMON, rope_theta=4e4),
}
PROMPTS = [[1, 5, 9, 14, 3, 22, 7, 40, 11, 6, 17], [1, 30, 31]]
NEW = 20


def tiny_target(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ARCHS[arch]()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # peaked logits: greedy paths have clear winners
        model.get_output_embeddings().weight.mul_(4.0)
    ident = TargetIdentity(name=arch, weights_sha256=f"{arch}-w", tokenizer_sha256="tok",
                           vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)

    class Loaded:  # LoadedTarget's fields
        pass

    loaded = Loaded()
    loaded.model, loaded.tokenizer, loaded.identity, loaded.path = model, None, ident, None
    return loaded


def head_config(kind: str, model):
    family = get_family(kind)
    raw = {"lm": {"num_layers": 2, "init": "target"},
           "medusa": {"num_heads": 3, "num_layers": 1},
           "eagle": {"layout": "eagle3", "fuse_layers": "auto", "draft_vocab_size": 64,
                     "ttt_steps": 2},
           # the mask: the EOS id (the pad id's row of these random targets is all zeros)
           "dflash": {"fuse_layers": "auto", "block_size": 4, "mask_token_id": 2}}[kind]
    return family, family.head_config(raw, model.config)


def train_a_few_steps(kind: str, model, steps: int = 3):
    """The family's head trained a few steps on the target's own hidden states (forward KL)."""
    family, cfg = head_config(kind, model)
    counts = torch.ones(VOCAB) if family.needs_token_counts(cfg) else None
    draft = family.build(cfg, model, token_counts=counts)
    layer_ids = list(getattr(cfg, "fuse_layers", None) or []) or None
    n = family.num_positions(cfg, 2)
    module = DistillModule(draft, family.distill_targets, family.distill_extra(n, layer_ids))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hidden = model.model(input_ids=ids).last_hidden_state.detach()  # final-norm states
    layers = torch.stack([out.hidden_states[i] for i in layer_ids], 1) if layer_ids else None
    head_w = model.get_output_embeddings().weight
    losses = []
    for _ in range(steps):
        targets = module(ids, hidden, torch.ones_like(ids, dtype=torch.bool), layers=layers)
        loss = 0.0
        for t in list(targets)[:n]:
            p = torch.log_softmax(t.teacher_hidden.float() @ head_w.T, -1)
            d2t = family.draft_to_target(draft, cfg)
            p = p if d2t is None else torch.log_softmax(p[..., d2t], -1)
            q = torch.log_softmax(t.draft_logits.float(), -1)
            loss = loss + (p.exp() * (p - q)).sum(-1)[t.mask].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    return family, cfg, draft.eval()


def proposer(kind: str, module, cfg, tree: bool):
    if kind == "lm":
        return DraftLMProposer(module, VOCAB, tree=tree, topk=3, total_tokens=10)
    if kind == "medusa":
        return MedusaProposer(module, VOCAB, medusa_choices((3, 2, 1) if tree else (1, 1, 1)))
    if kind == "dflash":
        return DFlashProposer(module, VOCAB)
    return EagleProposer(module, VOCAB, tree=tree, topk=3, total_tokens=10)


def plain_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    return request.param


@pytest.mark.parametrize("kind", ["lm", "medusa", "eagle", "dflash"])
def test_family_trains_saves_and_decodes_exactly(arch, kind, tmp_path):
    loaded = tiny_target(arch)
    model = loaded.model
    family, cfg, draft = train_a_few_steps(kind, model)
    pkg_dir = save_package(tmp_path / kind, kind, draft, cfg, loaded.identity,
                           target_config=model.config)
    pkg = load_package(pkg_dir, target=loaded)
    for tree in (False, True) if family.tree is not TreeKind.NONE else (False,):
        dec = SpeculativeDecoder(model, proposer(kind, pkg.module.eval(), pkg.head_config, tree),
                                 k=3, adaptive=False, fallback=False)
        for prompt in PROMPTS:
            got = dec.generate(prompt, max_new_tokens=NEW, temperature=0.0)
            assert got.output_ids == plain_greedy(model, prompt), (arch, kind, tree, prompt)
    info = json.loads((pkg_dir / "draftsmith.json").read_text())
    assert info["target_config"]["model_type"] == model.config.model_type


def test_draft_layer_config_carries_the_targets_values(arch):
    tc = ARCHS[arch]()
    dc = draft_layer_config(tc)
    assert dc.model_type == "llama"
    assert (dc.hidden_size, dc.num_attention_heads, dc.num_key_value_heads, dc.vocab_size) == \
        (tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.vocab_size)
    assert dc.head_dim == (getattr(tc, "head_dim", None) or HIDDEN // 4)
    assert dc.intermediate_size == tc.intermediate_size
    assert dc.rope_parameters["rope_theta"] == rope_parameters(tc)["rope_theta"]
    act = getattr(tc, "hidden_activation", None) or tc.hidden_act
    assert dc.hidden_act == act
    assert draft_layer_config(dc).to_dict() == dc.to_dict()  # idempotent


def eagle3_package(arch: str, tmp_path):
    loaded = tiny_target(arch)
    family, cfg = head_config("eagle", loaded.model)
    draft = family.build(cfg, loaded.model, token_counts=torch.ones(VOCAB)).eval()
    return loaded, save_package(tmp_path / "eagle3", "eagle", draft, cfg, loaded.identity,
                                target_config=loaded.model.config)


def check_layer_config(layer: dict, tc) -> list[str]:
    """The fields of an exported draft layer config that differ from the target's values."""
    want = {"hidden_size": tc.hidden_size, "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": tc.num_key_value_heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            "intermediate_size": tc.intermediate_size, "vocab_size": tc.vocab_size,
            "rope_theta": rope_parameters(tc)["rope_theta"],
            "hidden_act": getattr(tc, "hidden_activation", None) or tc.hidden_act}
    return [f"{k}: {layer.get(k)!r} != {v!r}" for k, v in want.items() if layer.get(k) != v]


def test_exports_name_the_target_and_its_layers(arch, tmp_path):
    from draftsmith.scripts.export import export_package

    loaded, pkg = eagle3_package(arch, tmp_path)
    tc = loaded.model.config
    fuse = get_family("eagle").resolve_config({"fuse_layers": "auto"}, tc)["fuse_layers"]
    e3 = json.loads((export_package(pkg, "eagle3", tmp_path / "e3") / "config.json").read_text())
    assert check_layer_config(e3, tc) == []
    assert e3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == fuse
    spec = json.loads((export_package(pkg, "speculators", tmp_path / "sp", verifier="v")
                       / "config.json").read_text())
    assert check_layer_config(spec["transformer_layer_config"], tc) == []
    assert spec["eagle_aux_hidden_state_layer_ids"] == fuse
    assert spec["speculators_config"]["verifier"]["architectures"] == [
        type(loaded.model).__name__]


def test_dflash_export_names_the_target_and_its_layers(arch, tmp_path):
    """The DFlash export's Qwen3 layer config carries the target's widths, head dim and RoPE
    (the activation is SiLU whatever the target's) and vLLM's layer ids."""
    from draftsmith.scripts.export import export_package

    loaded = tiny_target(arch)
    tc = loaded.model.config
    family, cfg = head_config("dflash", loaded.model)
    pkg = save_package(tmp_path / "dflash", "dflash", family.build(cfg, loaded.model).eval(),
                       cfg, loaded.identity, target_config=tc)
    spec = json.loads((export_package(pkg, "dflash", tmp_path / "df", verifier="v")
                       / "config.json").read_text())
    layer = spec["transformer_layer_config"]
    act = getattr(tc, "hidden_activation", None) or tc.hidden_act
    assert check_layer_config({**layer, "hidden_act": act}, tc) == []
    assert layer["hidden_act"] == "silu" and layer["model_type"] == "qwen3"
    assert layer["rope_parameters"]["rope_theta"] == rope_parameters(tc)["rope_theta"]
    assert spec["aux_hidden_state_layer_ids"] == sorted(cfg.fuse_layers) == [1, 2, 3]
    assert spec["speculators_config"]["verifier"]["architectures"] == [
        type(loaded.model).__name__]


def test_twin_wrong_rope_theta_or_layer_ids_fail_the_checks(tmp_path):
    """The checks above catch a draft layer with the default RoPE theta (the target's own is
    7e4) and an export whose layer ids are off by one."""
    tc = ARCHS["mistral"]()
    wrong = draft_layer_config(tc).to_dict()
    wrong["rope_theta"] = 10000.0
    assert any(d.startswith("rope_theta") for d in check_layer_config(wrong, tc))
    fuse = get_family("eagle").resolve_config({"fuse_layers": "auto"}, tc)["fuse_layers"]
    assert [i - 1 for i in fuse] != fuse  # SGLang's indexing is not vLLM's


def test_twin_no_sliding_window_diverges(monkeypatch):
    """Without the windowed masks, verification on Gemma 3 differs from plain decoding."""
    import draftsmith.eval.decoding.target_model as tm

    loaded = tiny_target("gemma3")
    model = loaded.model
    _, cfg, draft = train_a_few_steps("eagle", model, steps=1)
    monkeypatch.setattr(tm, "sliding_window", lambda config: None)
    dec = SpeculativeDecoder(model, proposer("eagle", draft, cfg, tree=True), k=3,
                             adaptive=False, fallback=False)
    got = dec.generate(PROMPTS[0], max_new_tokens=NEW, temperature=0.0)
    assert got.output_ids != plain_greedy(model, PROMPTS[0])
