"""Exports for serving engines: written layouts, round trips, refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import eagle3_draft_logits, make_tiny_target
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from draftsmith.data.identity import TargetIdentity, TargetMismatchError
from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm
from draftsmith.heads.eagle import build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.exports import export_format, import_export
from draftsmith.heads.manifest import MANIFEST, SIGNATURE, PackageIntegrityError
from draftsmith.heads.medusa import MedusaConfig, build_medusa
from draftsmith.heads.package import load_package, save_package
from draftsmith.scripts import export_formats
from draftsmith.scripts.export import OutPathError, export_package, tensor_shapes
from draftsmith.scripts.export_formats import ExportError
from draftsmith.scripts.export_layouts import REQUIRED_FILES, layout_problems

REPO = Path(__file__).resolve().parents[2]


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _conforms(out: Path, fmt: str) -> None:
    for name in REQUIRED_FILES[fmt] + (MANIFEST,):
        assert (out / name).is_file(), f"{fmt} export lacks {name}"
    config = json.loads((out / "config.json").read_text())
    assert layout_problems(fmt, config, tensor_shapes(out / export_format(fmt).weights_file)) == []
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in out.iterdir()
                                               if p.name not in (MANIFEST, SIGNATURE))


@pytest.fixture
def lm_package(tmp_path):
    target = make_tiny_target()
    cfg = DraftLMConfig.matching(target.model.config, 1, init="random")
    draft = _randomize(build_draft_lm(cfg, target.model))
    pkg = save_package(tmp_path / "lm", "lm", draft, cfg, target.identity,
                       extra_json={"speculation": {"k_star": 4}}, train_config={"seed": 3})
    return target, draft, pkg


def test_hf_export_is_an_assistant_model_and_round_trips(lm_package, tmp_path):
    target, draft, pkg = lm_package
    out = export_package(pkg, "hf", tmp_path / "hf", target=target)
    _conforms(out, "hf")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["draft_kind"] == "lm" and manifest["training_config"] == {"seed": 3}
    assert json.loads((out / "speculation.json").read_text()) == {"k_star": 4}
    assistant = AutoModelForCausalLM.from_pretrained(out).eval()
    assert assistant.generation_config.num_assistant_tokens == 4  # K* from speculation.json
    ids = torch.randint(3, target.model.config.vocab_size, (1, 6))
    torch.testing.assert_close(assistant(ids).logits, draft(ids).logits, rtol=0, atol=0)
    plain = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    assisted = target.model.generate(ids, max_new_tokens=12, do_sample=False,
                                     assistant_model=assistant)
    assert torch.equal(plain, assisted)  # greedy speculative decoding is lossless
    back = import_export(out, target=target)
    torch.testing.assert_close(back.module(ids).logits, draft(ids).logits, rtol=0, atol=0)
    # the same object as load_package gives: a TargetIdentity, not the manifest's dict
    assert isinstance(back.identity, TargetIdentity)
    assert back.identity == load_package(pkg, target=target).identity == target.identity


@pytest.mark.slow
def test_gguf_export_reads_back_in_transformers_gguf_loader(lm_package, tmp_path, monkeypatch):
    """format=gguf: transformers' own GGUF reader (which undoes llama.cpp's q/k RoPE row order)
    gives the draft's logits and q/k weights back; the tokenizer is the target GGUF's. Twin: the
    same file written without the permutation reads back with other q/k weights."""
    import gguf

    from draftsmith.data.gguf_read import one_parse_per_file
    from draftsmith.data.packaged import packaged_target, target_gguf
    from draftsmith.scripts import export_gguf
    target, draft, pkg = lm_package  # the tiny target has SmolLM2's tokenizer
    with one_parse_per_file():  # each file's 49,152-word vocabulary parsed once, not per reader
        source = target_gguf(packaged_target("smollm2_135m").sha256)
        out = export_package(pkg, "gguf", tmp_path / "gguf", gguf_vocab_from=source)
        file = out / export_gguf.GGUF_FILE
        fields = gguf.GGUFReader(str(file)).fields
        want = gguf.GGUFReader(str(source)).fields
        assert fields["general.architecture"].contents() == "llama"
        assert fields["llama.block_count"].contents() == draft.config.num_hidden_layers
        tokens = "tokenizer.ggml.tokens"
        assert fields[tokens].contents() == want[tokens].contents()
        back = import_export(out, target=target).module
        ids = torch.randint(3, target.model.config.vocab_size, (1, 9))
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, draft(ids).logits, rtol=0, atol=0)
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(back.state_dict()[q], draft.state_dict()[q])
        monkeypatch.setattr(export_gguf, "_permute_rope", lambda w, n: w)
        export_gguf.write_gguf(draft, tmp_path / "unpermuted.gguf", torch.float32, None, "twin")
        twin = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="unpermuted.gguf")
        assert not torch.equal(twin.state_dict()[q], draft.state_dict()[q])


def test_gguf_export_needs_the_target_gguf_for_its_tokenizer(lm_package, tmp_path):
    _, _, pkg = lm_package  # a tiny target: no packaged target has its digest
    with pytest.raises(ExportError, match="target tiny is not a packaged one.*gguf_vocab_from"):
        export_package(pkg, "gguf", tmp_path / "gguf")
    with pytest.raises(ExportError, match="is not a file"):
        export_package(pkg, "gguf", tmp_path / "gguf", gguf_vocab_from=tmp_path / "none.gguf")
    with pytest.raises(ExportError, match="float32 or float16"):
        export_package(pkg, "gguf", tmp_path / "gguf", dtype=torch.bfloat16,
                       gguf_vocab_from=tmp_path / "none.gguf")
    assert not (tmp_path / "gguf").exists()


def test_reference_library_files_are_optional_extras_with_the_same_tensors(tmp_path):
    """reference_files=true adds eagle-llm's pytorch_model.bin (the head plus the target's
    embedding) and medusa-llm's medusa_lm_head.pt, holding the safetensors' tensors."""
    from safetensors.torch import load_file
    target = make_tiny_target()
    m_cfg = MedusaConfig(num_heads=2, num_layers=1)
    medusa = save_package(tmp_path / "m", "medusa", _randomize(build_medusa(m_cfg, target.model)),
                          m_cfg, target.identity)
    eagle = save_package(tmp_path / "e", "eagle", _eagle1_head(target), EagleConfig(),
                         target.identity)
    for pkg, fmt, name in ((medusa, "medusa", "medusa_lm_head.pt"),
                           (eagle, "eagle", "pytorch_model.bin")):
        plain = export_package(pkg, fmt, tmp_path / f"{fmt}-plain")
        assert not (plain / name).exists()  # not written unless asked
        out = export_package(pkg, fmt, tmp_path / fmt, reference_files=True, target=target)
        _conforms(out, fmt)  # the manifest lists the extra file
        ref = torch.load(out / name, weights_only=True)
        stored = load_file(str(out / export_format(fmt).weights_file))
        assert set(ref) - set(stored) == ({"embed_tokens.weight"} if fmt == "eagle" else set())
        for k, v in stored.items():
            assert torch.equal(ref[k], v), k
    assert torch.equal(ref["embed_tokens.weight"],
                       target.model.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="format=eagle3 has no reference-library layout"):
        export_package(eagle, "eagle3", tmp_path / "x", reference_files=True)
    with pytest.raises(ValueError, match="stores the target's embedding: load the target"):
        export_package(eagle, "eagle", tmp_path / "y", reference_files=True)


def test_advertised_draft_length_is_k_star_only(tmp_path):
    """Only eval/measure.py's ``k_star`` is K*; other keys leave the family default (3)."""
    target = make_tiny_target()
    cfg = DraftLMConfig.matching(target.model.config, 1, init="random")
    draft = build_draft_lm(cfg, target.model)
    pkg = save_package(tmp_path / "lm", "lm", draft, cfg, target.identity,
                       extra_json={"speculation": {"best_k": 7, "K_star": 6}})
    out = export_package(pkg, "hf", tmp_path / "hf")
    assert json.loads((out / MANIFEST).read_text())["num_speculative_tokens"] == 3


def test_medusa_export_layout_and_round_trip(tmp_path):
    target = make_tiny_target()
    cfg = MedusaConfig(num_heads=3, num_layers=2)
    heads = _randomize(build_medusa(cfg, target.model))
    pkg = save_package(tmp_path / "pkg", "medusa", heads, cfg, target.identity)
    out = export_package(pkg, "medusa", tmp_path / "medusa", verifier="org/tiny")
    _conforms(out, "medusa")
    config = json.loads((out / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
    assert config["base_model_name_or_path"] == "org/tiny"
    shapes = tensor_shapes(out / "medusa_lm_head.safetensors")
    h, v = target.model.config.hidden_size, target.model.config.vocab_size
    assert shapes["2.1.linear.weight"] == (h, h) and shapes["2.2.weight"] == (v, h)
    # reference semantics: head i = Sequential(ResBlock x N, Linear(H, V)) on the hidden state
    from safetensors.torch import load_file
    w = load_file(str(out / "medusa_lm_head.safetensors"))
    hidden = torch.randn(2, 4, h)
    x = hidden
    for j in range(2):
        x = x + torch.nn.functional.silu(x @ w[f"1.{j}.linear.weight"].T + w[f"1.{j}.linear.bias"])
    torch.testing.assert_close(x @ w["1.2.weight"].T, heads(hidden)[:, :, 1], rtol=1e-5,
                               atol=1e-5)
    back = import_export(out)
    torch.testing.assert_close(back.module(hidden), heads(hidden), rtol=0, atol=0)


@pytest.mark.parametrize("fmt,engine", [("eagle", "vllm"), ("eagle", "sglang"),
                                        ("speculators", "vllm")])
def test_normed_eagle_head_is_refused_naming_the_fix(tmp_path, fmt, engine):
    target = make_tiny_target()
    cfg = EagleConfig(layout="normed")
    pkg = save_package(tmp_path / "pkg", "eagle", build_eagle(cfg, target.model), cfg,
                       target.identity)
    with pytest.raises(ExportError) as err:
        export_package(pkg, fmt, tmp_path / fmt, engine=engine,
                       legacy_speculators=fmt == "speculators")
    msg = str(err.value)
    assert "layout=normed" in msg and "draft.config.layout=eagle1" in msg
    assert "layer.input_layernorm" in msg and "norm: the head normalises its output" in msg
    # vllm (which also serves the speculators format) builds fc without a bias
    assert ("fc.bias is non-zero" in msg) == (engine == "vllm")
    assert not (tmp_path / fmt).exists()


@pytest.mark.parametrize("cfg,what", [(EagleConfig(fuse_layers=[0, 2]), "fuse_layers=[0, 2]"),
                                      (EagleConfig(draft_vocab_size=40), "draft_vocab_size=40")])
def test_eagle1_head_beyond_any_engine_layout_is_refused(tmp_path, cfg, what):
    target = make_tiny_target()
    counts = torch.arange(target.model.config.vocab_size, dtype=torch.float)
    head = build_eagle(cfg, target.model, token_counts=counts)
    assert cfg.layout == "eagle1"
    pkg = save_package(tmp_path / "pkg", "eagle", head, cfg, target.identity)
    for fmt in ("eagle", "speculators"):
        with pytest.raises(ExportError) as err:
            export_package(pkg, fmt, tmp_path / fmt, legacy_speculators=fmt == "speculators")
        msg = str(err.value)
        assert what in msg and "draft.config.layout=eagle3" in msg and "layout=normed" not in msg
        assert not (tmp_path / fmt).exists()


def _eagle1_head(target, seed=0):
    """A layout=eagle1 head with random (non-trivial) trainable weights."""
    head = build_eagle(EagleConfig(), target.model)
    _randomize(head, seed)
    head.attach_target(target.model)  # frozen parts back to the target's
    return head.eval()


def _engine_eagle1(tensors: dict, fc_prefix: str, layer_prefix: str, tc: LlamaConfig,
                   target_model, feats, ids):
    """What EAGLE-1 engines compute from an export: fc(cat(emb, feat)); layer without input
    norm; no output norm; the target's embedding and LM head."""
    cfg = LlamaConfig(**{**tc.to_dict(), "num_hidden_layers": 1})
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = nn.Identity()
    layer.load_state_dict({k[len(layer_prefix):]: v for k, v in tensors.items()
                           if k.startswith(layer_prefix)})
    emb = target_model.get_input_embeddings()(ids)
    x = torch.cat([emb, feats], -1) @ tensors[f"{fc_prefix}weight"].T
    x = x + tensors.get(f"{fc_prefix}bias", 0)
    pos = torch.arange(ids.shape[1])[None]
    causal = torch.full((ids.shape[1],) * 2, torch.finfo(x.dtype).min).triu(1)[None, None]
    out = layer(x, attention_mask=causal, position_ids=pos,
                position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    return target_model.get_output_embeddings()(out)


@pytest.mark.parametrize("fmt,engine,fc_prefix,layer_prefix", [
    ("eagle", "vllm", "fc.", "layers.0."), ("eagle", "sglang", "fc.", "layers.0."),
    ("speculators", "vllm", "fusion_fc.", "transformer.")])
def test_eagle1_head_exports_exactly(tmp_path, fmt, engine, fc_prefix, layer_prefix):
    from safetensors.torch import load_file
    target = make_tiny_target()
    tc = target.model.config
    head = _eagle1_head(target)
    pkg = save_package(tmp_path / "pkg", "eagle", head, EagleConfig(), target.identity,
                       extra_json={"speculation": {"k_star": 5}})
    out = export_package(pkg, fmt, tmp_path / fmt, engine=engine,
                         legacy_speculators=fmt == "speculators")
    _conforms(out, fmt)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    if fmt == "eagle":
        assert config["architectures"] == [export_formats.EAGLE_ARCH[engine]]
        # sglang always builds fc with a bias: it gets an explicit zero one; vllm gets none
        assert config["bias"] == (engine == "sglang") == ("fc.bias" in tensors)
        if engine == "sglang":
            assert not tensors["fc.bias"].any()
    else:
        assert config["speculators_model_type"] == "eagle" and config["fusion_bias"] is False
        method = config["speculators_config"]["proposal_methods"][0]
        assert method["speculative_tokens"] == 5
        assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    feats = torch.randn(2, 6, tc.hidden_size)
    ids = torch.randint(0, tc.vocab_size, (2, 6))
    ours = head.compute_logits(head(feats, ids))
    engine_logits = _engine_eagle1(tensors, fc_prefix, layer_prefix, tc, target.model, feats, ids)
    torch.testing.assert_close(engine_logits, ours, rtol=1e-4, atol=1e-5)
    back = import_export(out, target=target)
    torch.testing.assert_close(back.module.compute_logits(back.module(feats, ids)), ours,
                               rtol=0, atol=0)


def test_engine_forward_tells_the_layouts_apart(tmp_path):
    """The engine-style forward is a real check: a normed head's weights, read by it, differ."""
    target = make_tiny_target()
    tc = target.model.config
    normed = _randomize(build_eagle(EagleConfig(layout="normed"), target.model))
    normed.attach_target(target.model)
    state = export_formats._ours_to_eagle1(normed.state_dict(), tc.hidden_size)
    feats = torch.randn(2, 6, tc.hidden_size)
    ids = torch.randint(0, tc.vocab_size, (2, 6))
    engine_logits = _engine_eagle1(state, "fc.", "layers.0.", tc, target.model, feats, ids)
    ours = normed.compute_logits(normed(feats, ids))
    assert not torch.allclose(engine_logits, ours, rtol=1e-2, atol=1e-2)


def _eagle3_head(target, fuse=(1, 0), vocab=40, seed=0, width=None):
    """A layout=eagle3 head (reduced vocabulary, layers fused out of ascending order) with random
    trainable weights (an MLP of width ``width``; None: the target's)."""
    cfg = EagleConfig(layout="eagle3", fuse_layers=list(fuse), draft_vocab_size=vocab,
                      intermediate_size=width)
    counts = torch.arange(target.model.config.vocab_size, dtype=torch.float).flip(0)
    head = build_eagle(cfg, target.model, token_counts=counts)
    _randomize(head, seed)
    head.attach_target(target.model)
    return cfg, head.eval()


def _engine_eagle3(tensors: dict, tc: LlamaConfig, target_model, layers: dict,
                   ids, steps: int = 2, residual_normed: bool = False):
    """What EAGLE-3 engines (vllm llama_eagle3.py) compute from an export, by the export alone:
    fc over the captured layers in ascending id order; attention over [input_norm(emb),
    hidden_norm(h)] with h the residual; final norm; draft LM head mapped to target ids with d2t
    offsets (-inf elsewhere); later steps feed the pre-norm output back without fc. Returns the
    target-vocabulary logits of each step at the last position."""
    p = "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."
    cfg = LlamaConfig(**{**tc.to_dict(), "num_hidden_layers": 1})
    h = tc.hidden_size

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + tc.rms_norm_eps))

    rope = LlamaRotaryEmbedding(cfg)
    order = sorted(layers)
    x = torch.cat([layers[i] for i in order], -1) @ tensors["fc.weight"].T  # (1, T, H)
    emb_all = target_model.get_input_embeddings()(ids)
    nh, nkv, hd = tc.num_attention_heads, tc.num_key_value_heads, h // tc.num_attention_heads
    keys, values, outs = [], [], []
    nxt = None
    for s in range(steps):
        n = x.shape[1]
        pos = torch.arange(ids.shape[1] - n, ids.shape[1])[None] + s
        tok = emb_all[:, -n:] if s == 0 else target_model.get_input_embeddings()(nxt)
        hn = rms(x, tensors[f"{p}hidden_norm.weight"])
        a_in = torch.cat([rms(tok, tensors[f"{p}input_layernorm.weight"]), hn], -1)
        q = (a_in @ tensors[f"{p}self_attn.q_proj.weight"].T).view(1, n, nh, hd).transpose(1, 2)
        k = (a_in @ tensors[f"{p}self_attn.k_proj.weight"].T).view(1, n, nkv, hd).transpose(1, 2)
        v = (a_in @ tensors[f"{p}self_attn.v_proj.weight"].T).view(1, n, nkv, hd).transpose(1, 2)
        cos, sin = rope(x, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k)
        values.append(v)
        kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
        kk, vv = kk.repeat_interleave(nh // nkv, 1), vv.repeat_interleave(nh // nkv, 1)
        past = kk.shape[2] - n
        mask = torch.ones(n, kk.shape[2], dtype=torch.bool).tril(past)
        att = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        a = att.transpose(1, 2).reshape(1, n, nh * hd) @ tensors[f"{p}self_attn.o_proj.weight"].T
        r = (hn if residual_normed else x) + a
        m = rms(r, tensors[f"{p}post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(m @ tensors[f"{p}mlp.gate_proj.weight"].T)
               * (m @ tensors[f"{p}mlp.up_proj.weight"].T)) @ tensors[f"{p}mlp.down_proj.weight"].T
        out = r + mlp
        draft = rms(out, tensors["norm.weight"]) @ tensors["lm_head.weight"].T  # (1, n, Vd)
        full = torch.full((*draft.shape[:2], tc.vocab_size), float("-inf"))
        full[..., torch.arange(draft.shape[-1]) + tensors["d2t"]] = draft
        outs.append(full[:, -1])
        nxt = full[:, -1:].argmax(-1)
        x = out[:, -1:]
    return outs


@pytest.mark.parametrize("fmt,width", [("eagle3", None), ("speculators", None), ("eagle3", 24),
                                       ("speculators", 24)])
def test_eagle3_head_exports_exactly(tmp_path, fmt, width):
    """An EAGLE-3 head in format=eagle3 (LlamaForCausalLMEagle3) and speculators' eagle3 type,
    with the target's MLP width or a narrower one: the engines' forward, computed from the
    export's tensors alone, gives our drafts over two steps; the export reads back bit for bit;
    the exported config names the head's MLP width (engines build the layer from it)."""
    from safetensors.torch import load_file
    target = make_tiny_target()
    tc = target.model.config
    cfg, head = _eagle3_head(target, width=width)
    assert head.layer.mlp.gate_proj.out_features == (width or tc.intermediate_size)
    pkg = save_package(tmp_path / "pkg", "eagle", head, cfg, target.identity,
                       extra_json={"speculation": {"k_star": 3}})
    out = export_package(pkg, fmt, tmp_path / fmt, verifier="/models/tiny")
    _conforms(out, fmt)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    layer_cfg = config if fmt == "eagle3" else config["transformer_layer_config"]
    assert layer_cfg["intermediate_size"] == (width or tc.intermediate_size)
    if fmt == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # ascending
        assert config["draft_vocab_size"] == 40 and config["norm_before_residual"] is False
        assert config["rope_theta"] == tc.rope_parameters["rope_theta"]
    else:
        assert config["speculators_model_type"] == "eagle3"
        assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1]
        spec = config["speculators_config"]
        assert spec["proposal_methods"][0]["speculative_tokens"] == 3
        assert spec["verifier"]["name_or_path"] == "/models/tiny"
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    torch.testing.assert_close(tensors["d2t"] + torch.arange(40), head.d2t)  # offsets
    ids = torch.randint(3, tc.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
        layers = {i: hs[i] for i in (0, 1)}
        ours = eagle3_draft_logits(head, layers, ids)
        engine = _engine_eagle3(tensors, tc, target.model, layers, ids)
        for a, b in zip(engine, ours):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # the check can fail: the other residual convention computes other drafts
        twin = _engine_eagle3(tensors, tc, target.model, layers, ids,
                              residual_normed=True)
        assert not torch.allclose(twin[0], ours[0], rtol=1e-2, atol=1e-2)
        back = import_export(out, target=target).module
        for a, b in zip(eagle3_draft_logits(back, layers, ids), ours):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    if fmt == "eagle3":  # SGLang counts captured layers from the output of layer id
        sgl = export_package(pkg, fmt, tmp_path / "sglang", engine="sglang")
        sgl_cfg = json.loads((sgl / "config.json").read_text())
        assert sgl_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0]


def test_eagle3_exports_refuse_what_engines_would_compute_differently(tmp_path):
    target = make_tiny_target()
    n = target.model.config.num_hidden_layers
    cfg, head = _eagle3_head(target, fuse=(0, n))  # n = the final (normed) hidden state
    pkg = save_package(tmp_path / "pkg", "eagle", head, cfg, target.identity)
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(ExportError, match=rf"fuse_layers=\[0, {n}\] holds {n}.*before that "
                                              "norm"):
            export_package(pkg, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    with pytest.raises(ExportError, match="EAGLE-3 head.*format=eagle3 or format=speculators"):
        export_package(pkg, "eagle", tmp_path / "eagle")
    e1 = save_package(tmp_path / "e1", "eagle", _eagle1_head(target), EagleConfig(),
                      target.identity)
    with pytest.raises(ExportError, match="layout=eagle1.*draft.config.layout=eagle3"):
        export_package(e1, "eagle3", tmp_path / "e3")
    # an EAGLE-1 head has only the stale speculators type: refused with the alternatives
    with pytest.raises(ExportError, match=r"dropped after 0\.4\.0\.1.*format=eagle.*layout=eagle3"
                                          r".*legacy_speculators=true"):
        export_package(e1, "speculators", tmp_path / "sp")
    assert not (tmp_path / "sp").exists()


def test_trained_eagle1_head_exports_and_engines_match_it(tmp_path):
    from safetensors.torch import load_file

    from draftsmith.heads.eagle_ttt import distill_targets
    torch.manual_seed(0)
    target = make_tiny_target()
    tc = target.model.config
    cfg = EagleConfig(ttt_steps=2)
    head = build_eagle(cfg, target.model)
    before = {k: v.clone() for k, v in head.trainable_state_dict().items()}
    ids = torch.randint(3, tc.vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target.model.model(ids).last_hidden_state  # (B, T, H) LM-head input
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    lm_w = target.model.get_output_embeddings().weight
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)

    def loss_fn() -> torch.Tensor:
        total = torch.zeros(())
        for tgt in distill_targets(head, ids, hidden, loss_mask):
            log_p = torch.log_softmax(tgt.teacher_hidden @ lm_w.T, -1)  # (B, T, V)
            log_q = torch.log_softmax(tgt.draft_logits, -1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, T)
            total = total + (kl * tgt.mask).sum() / tgt.mask.sum()
        return total

    losses = []
    for _ in range(12):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # it trained
    after = head.trainable_state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in after)  # every trainable tensor moved
    head.eval()
    pkg = save_package(tmp_path / "pkg", "eagle", head, cfg, target.identity)
    out = export_package(pkg, "eagle", tmp_path / "eagle", target=target)
    _conforms(out, "eagle")
    feats = hidden[:, :-1]
    nxt = ids[:, 1:]  # feature f_t pairs with token x_{t+1}
    with torch.no_grad():
        ours = head.compute_logits(head(feats, nxt))
        engine_logits = _engine_eagle1(load_file(str(out / "model.safetensors")), "fc.",
                                       "layers.0.", tc, target.model, feats, nxt)
    torch.testing.assert_close(engine_logits, ours, rtol=1e-4, atol=1e-5)


def test_export_refusals(lm_package, tmp_path):
    _, _, pkg = lm_package
    with pytest.raises(ValueError, match=r"format=medusa exports 'medusa' drafts.*format=hf"):
        export_package(pkg, "medusa", tmp_path / "x")
    with pytest.raises(TargetMismatchError, match="weights_sha256"):
        export_package(pkg, "hf", tmp_path / "x", target=make_tiny_target(seed=5))
    out = export_package(pkg, "hf", tmp_path / "hf")
    data = bytearray((out / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(PackageIntegrityError, match=r"'model\.safetensors' was modified"):
        import_export(out)
    with pytest.raises(TargetMismatchError, match="weights_sha256"):
        import_export(out, target=make_tiny_target(seed=5), allow_unverified=True)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_out_is_the_package_itself_is_refused_and_the_package_kept(lm_package):
    _, _, pkg = lm_package
    before = _snapshot(pkg)
    assert "training_config.yaml" in before
    with pytest.raises(OutPathError, match=r"is the draft package itself: the export would "
                                           r"replace it .* pass a new folder outside"):
        export_package(pkg, "hf", pkg)
    assert _snapshot(pkg) == before
    load_package(pkg)


def test_out_inside_the_package_is_refused_and_the_package_still_loads(lm_package):
    _, _, pkg = lm_package
    before = _snapshot(pkg)
    with pytest.raises(OutPathError, match=r"is inside the draft package .* would no longer load"):
        export_package(pkg, "hf", pkg / "export")
    assert not (pkg / "export").exists() and _snapshot(pkg) == before
    load_package(pkg)


def test_out_holding_the_package_is_refused(lm_package, tmp_path):
    _, _, pkg = lm_package
    before = _snapshot(tmp_path)
    with pytest.raises(OutPathError, match=r"holds the draft package .* would delete the package"):
        export_package(pkg, "hf", tmp_path)
    assert _snapshot(tmp_path) == before
    load_package(pkg)


def test_out_non_empty_foreign_folder_is_refused_and_kept(lm_package, tmp_path):
    _, _, pkg = lm_package
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub" / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(OutPathError, match=r"is a non-empty folder that is not an export of .*"
                                           r"\(3 entries: notes\.txt, sub, sub/data\.bin\); "
                                           r"exporting would delete them"):
        export_package(pkg, "hf", mine)
    assert _snapshot(mine) == {"notes.txt": b"keep me", "sub/data.bin": b"\x00\x01"}
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    import_export(export_package(pkg, "hf", tmp_path / "empty"))


def test_previous_export_is_replaced_only_with_overwrite(lm_package, tmp_path):
    target, draft, pkg = lm_package
    out = export_package(pkg, "hf", tmp_path / "hf")
    before = _snapshot(out)
    with pytest.raises(OutPathError, match=r"already holds a hf export of .*; pass "
                                           r"overwrite=true to replace it"):
        export_package(pkg, "hf", out)
    assert _snapshot(out) == before
    # another package's export is not "previous": refused even with overwrite
    other = save_package(tmp_path / "other", "lm", draft, pkg_config(pkg), target.identity)
    with pytest.raises(OutPathError, match=r"holds an export of another package"):
        export_package(other, "hf", out, overwrite=True)
    assert _snapshot(out) == before
    assert export_package(pkg, "hf", out, overwrite=True) == out
    import_export(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "lm", "other"]  # no .old / .tmp


def pkg_config(pkg: Path) -> DraftLMConfig:
    return DraftLMConfig.from_dict(json.loads((pkg / "draftsmith.json").read_text())["head_config"])


def test_command_line_refuses_out_before_loading_anything(lm_package, tmp_path):
    _, _, pkg = lm_package
    before = _snapshot(pkg)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), f"draft={pkg}",
                           "format=hf", f"out={pkg}", "check_target=true"], check=False,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "is the draft package itself" in proc.stderr
    assert "load_target" not in proc.stderr  # refused before the target was loaded
    assert _snapshot(pkg) == before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_folders_of_dead_writers_are_removed(lm_package, tmp_path, caplog):
    import logging
    import os

    from draftsmith.heads.publish import remove_stale_siblings

    _, _, pkg = lm_package
    out, dead, live = tmp_path / "hf", _dead_pid(), os.getppid()
    for name in (f"hf.tmp-{dead}", f"hf.old-{dead}", f"hf.tmp-{live}", "hf.tmp-notapid"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "half.bin").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.publish"):
        export_package(pkg, "hf", out)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["hf", f"hf.tmp-{live}", "hf.tmp-notapid", "lm"]  # a live writer's kept
    for name in (f"hf.tmp-{dead}", f"hf.old-{dead}"):
        assert f"removing {tmp_path / name}, left by process {dead}" in caplog.text
    # this process's own folder (a live pid) is never removed by the clean-up
    mine = tmp_path / f"x.tmp-{os.getpid()}"
    mine.mkdir()
    assert remove_stale_siblings(tmp_path / "x") == [] and mine.is_dir()
    # without <out>, a dead writer's .old-<pid> is the only previous copy: kept, named
    (tmp_path / f"gone.old-{dead}").mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.publish"):
        assert remove_stale_siblings(tmp_path / "gone") == []
    assert (tmp_path / f"gone.old-{dead}").is_dir() and "kept (move it back with" in caplog.text


@pytest.mark.slow
def test_command_line(lm_package, tmp_path):
    _, _, pkg = lm_package
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), f"draft={pkg}",
                           "format=hf", f"out={out}"], check=False, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _conforms(out, "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "lm"]  # nothing else written


def test_medusa_export_round_trip_gives_identical_greedy_decoding(tmp_path):
    from draftsmith.eval.decoding.decoder import SpeculativeDecoder
    from draftsmith.eval.decoding.proposers_medusa import MedusaProposer

    target = make_tiny_target()
    cfg = MedusaConfig(num_heads=3, num_layers=1)
    heads = _randomize(build_medusa(cfg, target.model))
    pkg = save_package(tmp_path / "pkg", "medusa", heads, cfg, target.identity)
    back = import_export(export_package(pkg, "medusa", tmp_path / "medusa"))
    vocab = target.model.config.vocab_size
    prompt = torch.randint(3, vocab, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for module in (heads, back.module):
        decoder = SpeculativeDecoder(target.model, MedusaProposer(module, vocab), k=3,
                                     adaptive=False, fallback=False)
        results.append(decoder.generate(prompt, max_new_tokens=16))
    assert results[0].output_ids == results[1].output_ids
    assert results[0].stats.accepted_at == results[1].stats.accepted_at  # same proposals accepted
    assert results[0].stats.drafted == results[1].stats.drafted > 0


@pytest.mark.real
def test_hf_export_of_a_real_draft_lm_is_an_assistant_model_for_smollm2(real_target, tmp_path):
    """On the real target: package -> format=hf -> transformers alone -> assistant_model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm
    from draftsmith.heads.package import save_package
    from draftsmith.scripts.export import export_package

    model, tok = real_target.model, real_target.tokenizer
    cfg = DraftLMConfig.matching(model.config, 2, init="target")
    draft = build_draft_lm(cfg, model)
    pkg = save_package(tmp_path / "pkg", "lm", draft, cfg, real_target.identity, tokenizer=tok)
    out = export_package(pkg, "hf", tmp_path / "hf", target=real_target)

    assistant = AutoModelForCausalLM.from_pretrained(out)  # transformers alone, no draftsmith
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    msgs = [{"role": "user", "content": "Write a haiku about autumn leaves."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    assisted = model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant)
    assert assisted.tolist() == plain.tolist()


def test_exported_configs_carry_rope_theta_for_older_loaders(tmp_path):
    """transformers 4.x reads the RoPE base from ``rope_theta`` only (else 10,000, silently)."""
    target = make_tiny_target()
    tc = target.model.config.to_dict()
    base = (tc.get("rope_parameters") or {}).get("rope_theta") or tc.get("rope_theta")
    pkg = save_package(tmp_path / "pkg", "eagle", _eagle1_head(target), EagleConfig(),
                       target.identity)
    cfg = json.loads((export_package(pkg, "eagle", tmp_path / "e") / "config.json").read_text())
    assert base and cfg["rope_theta"] == base
    assert export_formats.readable_by_older_loaders(
        {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}) == {
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "rope_theta": 100000.0}
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    export_formats._portable_tokenizer_config(tok)
    assert json.loads((tok / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast")
