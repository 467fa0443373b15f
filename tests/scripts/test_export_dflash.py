"""``format=dflash``: speculators' ``dflash`` layout as vLLM 0.32 reads it (config fields, tensor
names, the aux-layer id convention), checked by computing vLLM's DFlash forward from the export's
files alone (``qwen3_dflash.py``: context K/V from ``hidden_norm(fc(captured layers))``, the
block through the layers non-causally) and comparing with our drafter. Twins: ids in z-lab's
convention (one lower) or a causal block compute other drafts."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target, randomize
from safetensors.torch import load_file

from draftsmith.heads.exports import export_format, import_export
from draftsmith.heads.family import get_family
from draftsmith.heads.manifest import MANIFEST
from draftsmith.heads.package import save_package
from draftsmith.scripts.export import export_package, tensor_shapes
from draftsmith.scripts.export_formats import ExportError
from draftsmith.scripts.export_layouts import REQUIRED_FILES, layout_problems

FAMILY = get_family("dflash")
LAYERS, FUSE, BLOCK = 4, [3, 0], 4  # out of order: the export sorts the ids and fc's columns


@pytest.fixture(scope="module")
def target():
    """A tiny Llama target with a RoPE theta other than the default (5e4)."""
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    t = make_tiny_target(seed=0, layers=LAYERS)
    cfg = tiny_llama_config(layers=LAYERS)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 5e4}
    torch.manual_seed(0)
    t.model = LlamaForCausalLM(cfg).eval()
    return t


def _package(target, tmp_path, **config):
    cfg = FAMILY.head_config({"block_size": BLOCK, "fuse_layers": FUSE, "mask_token_id": 2,
                              "num_layers": 2, **config}, target.model.config)
    drafter = randomize(FAMILY.build(cfg, target.model), seed=3)
    pkg = save_package(tmp_path / "pkg", "dflash", drafter, cfg, target.identity,
                       target_config=target.model.config, extra_json={"speculation": {"k_star": 1}})
    return drafter, pkg


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x (T, heads, D), neox style
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _engine_dflash(out, target, ids, anchor, aux_shift=0, causal=False):
    """vLLM's DFlash draft logits (slots 1..B-1) for the block at ``anchor``, from the export's
    config.json and model.safetensors; the embedding and LM head are the verifier's."""
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    lc = cfg["transformer_layer_config"]
    eps, theta = lc["rms_norm_eps"], lc["rope_parameters"]["rope_theta"]
    heads, kv, hd = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
    with torch.no_grad():
        hs = target.model(ids[:, :anchor], output_hidden_states=True).hidden_states
        captured = torch.cat([hs[i + aux_shift][0] for i in cfg["aux_hidden_state_layer_ids"]],
                             -1)
        ctx = _rms(captured @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (a, H)
        bs, mask = cfg["block_size"], cfg["mask_token_id"]
        block = torch.tensor([int(ids[0, anchor])] + [mask] * (bs - 1))
        x = target.model.get_input_embeddings().weight[block]
        pos_c, pos_q = torch.arange(anchor), torch.arange(anchor, anchor + bs)
        for i in range(lc["num_hidden_layers"]):
            p = f"layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)

            def proj(t, name, n, p=p):
                return (t @ w[f"{p}self_attn.{name}_proj.weight"].T).view(len(t), n, hd)

            q = _rope(_rms(proj(h, "q", heads), w[p + "self_attn.q_norm.weight"], eps), pos_q,
                      theta)
            k = torch.cat([_rope(_rms(proj(t, "k", kv), w[p + "self_attn.k_norm.weight"], eps),
                                 pos, theta) for t, pos in ((ctx, pos_c), (h, pos_q))])
            v = torch.cat([proj(ctx, "v", kv), proj(h, "v", kv)])
            k, v = (t.repeat_interleave(heads // kv, 1).transpose(0, 1) for t in (k, v))
            scores = q.transpose(0, 1) @ k.transpose(1, 2) / hd ** 0.5  # (heads, B, a + B)
            if causal:
                scores[:, :, anchor:] += torch.full((bs, bs), float("-inf")).triu(1)
            att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(bs, heads * hd)
            x = x + att @ w[p + "self_attn.o_proj.weight"].T
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = _rms(x, w["norm.weight"], eps)
        return (x @ target.model.get_output_embeddings().weight.T)[1:]


def _ours(drafter, target, ids, anchor):
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in drafter.cfg.fuse_layers], -1)
        return drafter.compute_logits(drafter(feats, ids, torch.tensor([[anchor]])))[0, 0, 1:]


def test_dflash_export_fields_names_and_ids(target, tmp_path):
    drafter, pkg = _package(target, tmp_path)
    out = export_package(pkg, "dflash", tmp_path / "df", verifier="/models/tiny",
                         dtype=torch.bfloat16)
    for name in REQUIRED_FILES["dflash"] + (MANIFEST,):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    weights = out / export_format("dflash").weights_file
    assert layout_problems("dflash", cfg, tensor_shapes(weights)) == []
    assert (cfg["speculators_model_type"], cfg["architectures"]) == ("dflash", ["DFlashSpeculator"])
    assert cfg["aux_hidden_state_layer_ids"] == [0, 3]  # transformers' hidden_states ids, sorted
    assert (cfg["block_size"], cfg["mask_token_id"], cfg["draft_vocab_size"],
            cfg["target_hidden_size"]) == (BLOCK, 2, 96, 32)
    assert cfg["sample_from_anchor"] is False and cfg["sliding_window_non_causal"] is True
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["verifier"]["name_or_path"] == "/models/tiny"
    assert spec["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1  # not K* (1)
    lc = cfg["transformer_layer_config"]
    assert (lc["model_type"], lc["hidden_act"], lc["num_hidden_layers"], lc["head_dim"]) == \
        ("qwen3", "silu", 2, 8)
    assert lc["layer_types"] == ["full_attention"] * 2 and lc["attention_bias"] is False
    assert lc["rope_parameters"] == {"rope_theta": 5e4, "rope_type": "default"}
    assert lc["rope_theta"] == 5e4  # also top-level, for 4.x loaders
    tensors = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in tensors)
    assert set(tensors) == set(FAMILY.saved_state(drafter, drafter.cfg))  # a rename-free copy
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    fc = drafter.fc.weight.detach()  # column blocks for [3, 0] -> ascending [0, 3]
    torch.testing.assert_close(tensors["fc.weight"].float(),
                               torch.cat([fc[:, 32:], fc[:, :32]], 1).bfloat16().float())
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["export_format"] == "dflash" and manifest["num_speculative_tokens"] == 3


def test_vllms_forward_from_the_export_gives_our_drafts(target, tmp_path):
    drafter, pkg = _package(target, tmp_path)
    drafter.eval()
    out = export_package(pkg, "dflash", tmp_path / "df")
    ids = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(2))
    for anchor in (1, 6, 13):
        ours = _ours(drafter, target, ids, anchor)
        torch.testing.assert_close(_engine_dflash(out, target, ids, anchor), ours, rtol=1e-4,
                                   atol=1e-4)
    # twins: z-lab's ids (hidden_states[id + 1]) and a causal block compute other drafts
    assert not torch.allclose(_engine_dflash(out, target, ids, 6, aux_shift=1), ours, atol=1e-2)
    assert not torch.allclose(_engine_dflash(out, target, ids, 6, causal=True), ours, atol=1e-2)
    back = import_export(out, target=target).module  # reads back bit for bit
    assert torch.equal(_ours(back, target, ids, 6), _ours(drafter, target, ids, 6))


def test_dflash_export_refusals(target, tmp_path):
    _, pkg = _package(target, tmp_path)
    with pytest.raises(ExportError, match=r"num_speculative_tokens=2: .*pass "
                                          r"num_speculative_tokens=3 or null"):
        export_package(pkg, "dflash", tmp_path / "k2", num_speculative_tokens=2)
    out = export_package(pkg, "dflash", tmp_path / "k3", num_speculative_tokens=3)
    assert json.loads((out / MANIFEST).read_text())["num_speculative_tokens"] == 3
    final = tmp_path / "final"
    final.mkdir()
    _, pkg = _package(target, final, fuse_layers=[1, LAYERS])
    with pytest.raises(ExportError, match=rf"fuse_layers=\[1, {LAYERS}\] holds {LAYERS}"):
        export_package(pkg, "dflash", tmp_path / "fin")
    assert not (tmp_path / "fin").exists()
    with pytest.raises(ValueError, match="format=eagle3 exports 'eagle' drafts"):
        export_package(pkg, "eagle3", tmp_path / "e3")
