"""scripts/quantize.py: an int8 copy of a draft package that loads (signed, verified), keeps the
decoder lossless and drafts close to the float draft."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import draft_package

from draftsmith.eval.decoding.decoder import SpeculativeDecoder
from draftsmith.eval.draft import build_proposer, load_draft, settle
from draftsmith.heads.manifest import PackageIntegrityError
from draftsmith.heads.package import PACKAGE_JSON, load_package
from draftsmith.heads.quantize import Int4Linear, Int8Linear
from draftsmith.heads.signing import sign_folder
from draftsmith.scripts.quantize import quantize_package
from tests.scripts.test_release import _eagle3_package

CHAIN = {"k": 3, "tree": "chain", "tree_size": None, "tree_topk": 8, "medusa_branching": None,
         "draft_vocab": "full", "device": "cpu", "dtype": "float32"}


def _reduced_eagle(tmp_path, layout: str = "eagle1"):
    pkg, _, target = _eagle3_package(tmp_path, layout)
    return pkg, target


def _proposer(path, target):
    pkg = load_draft(path, target)
    plan = settle(CHAIN, pkg, measured=False)
    return build_proposer(pkg, plan, target, int(target.model.config.vocab_size))


@pytest.mark.parametrize("scheme", ["int8", "int8_dynamic", "int4"])
def test_int8_eagle_copy_is_lossless_and_drafts_like_the_float_head(tmp_path, scheme):
    src, target = _reduced_eagle(tmp_path)
    out = quantize_package(src, tmp_path / "int8", scheme)
    info = json.loads((out / PACKAGE_JSON).read_text())["quantization"]
    assert info["scheme"] == scheme and "lm_head" in info["modules"]
    assert "fc" not in info["modules"] and "layer.mlp.down_proj" in info["modules"]
    pkg = load_package(out, target=target)  # signed anew, verified
    qlinear = {"int8": Int8Linear, "int4": Int4Linear}.get(
        scheme, torch.ao.nn.quantized.dynamic.Linear)
    assert isinstance(pkg.module.layer.mlp.down_proj, qlinear)
    assert isinstance(pkg.module.lm_head, qlinear) and isinstance(pkg.module.fc, torch.nn.Linear)
    model = target.model.float().eval()
    prompt = [1, 5, 9, 13, 5, 9]
    plain = SpeculativeDecoder(model, _proposer(src, target), k=0).generate(prompt, 24)
    f32 = SpeculativeDecoder(model, _proposer(src, target), k=3, adaptive=False,
                             fallback=False).generate(prompt, 24)
    i8 = SpeculativeDecoder(model, _proposer(out, target), k=3, adaptive=False,
                            fallback=False).generate(prompt, 24)
    assert i8.output_ids == f32.output_ids == plain.output_ids  # lossless whatever q says
    # the quantized head's drafts: logits within rounding of the float head's
    fh, qh = load_package(src, target=target).module, pkg.module
    feats = torch.randn(1, 5, fh.fc.in_features - fh.hidden_size)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    a, b = fh.compute_logits(fh(feats, ids)), qh.compute_logits(qh(feats, ids))
    assert (a - b).abs().max() < (0.1 if scheme == "int4" else 0.05) * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_int8_weights_are_per_channel_and_run_in_bf16():
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight[3] *= 100  # one large row: a per-tensor scale would flatten the others
    q = Int8Linear(lin)
    err = (q.weight - lin.weight).abs().amax(1) / lin.weight.abs().amax(1)
    assert float(err.max()) <= 0.5 / 127 + 1e-6  # half a step of each row's own scale
    x = torch.randn(5, 64)
    rel = (q(x) - lin(x)).abs().amax(0) / lin(x).abs().amax(0)  # per output feature
    assert float(rel.max()) < 0.05
    qb = q.to(torch.bfloat16)  # the int8 weights stay int8, the scales follow the dtype
    assert qb.weight_int8.dtype == torch.int8 and qb(x.bfloat16()).dtype == torch.bfloat16


def test_int4_weights_are_per_group_and_the_kernel_multiplies_by_them():
    """Each group of 32 inputs keeps its own scale and zero point: every weight within half a
    step of its group's range (a scale per row, or a zero point off by the kernel's offset of
    8 steps, fails it); the packed kernel's product equals the product by the dequantized
    weights, in fp32 and bf16."""
    lin = torch.nn.Linear(96, 48)
    with torch.no_grad():
        lin.weight[:, 40:50] *= 50  # one loud group per row: a per-row scale would flatten the rest
    q = Int4Linear(lin)
    w = lin.weight.detach().view(48, 3, 32)
    step = (w.amax(-1) - w.amin(-1)) / 15
    err = (q.weight.view(48, 3, 32) - w).abs().amax(-1)
    assert bool((err <= step / 2 + 1e-5).all())
    x = torch.randn(7, 96)
    dense = torch.nn.functional.linear(x, q.weight, q.bias)
    assert q.kernel == "int4pack", q.kernel  # torch's CPU int4 kernel exists on this machine
    assert torch.allclose(q(x), dense, rtol=1e-4, atol=1e-4)
    qb = q.to(torch.bfloat16)
    assert qb.weight_int4.dtype == torch.uint8
    got, ref = qb(x.bfloat16()).float(), dense
    assert float((got - ref).norm() / ref.norm()) < 1e-2
    with pytest.raises(ValueError, match="divisible by the group size"):
        Int4Linear(torch.nn.Linear(40, 8))


def test_int8_draft_lm_keeps_its_lm_head_and_decodes_greedily_like_the_target(decode_setup,
                                                                              tmp_path):
    src, _ = draft_package(decode_setup, "lm")
    out = quantize_package(src, tmp_path / "lm-int8")
    info = json.loads((out / PACKAGE_JSON).read_text())["quantization"]
    assert "lm_head" not in info["modules"] and any("q_proj" in m for m in info["modules"])
    loaded = decode_setup["loaded"]
    model = loaded.model.float().eval()
    prompt = [1, 5, 9, 13]
    plain = SpeculativeDecoder(model, _proposer(src, loaded), k=0).generate(prompt, 16)
    got = SpeculativeDecoder(model, _proposer(out, loaded), k=3, adaptive=False,
                             fallback=False).generate(prompt, 16)
    assert got.output_ids == plain.output_ids


def test_bad_quantization_records_and_devices_are_refused(tmp_path):
    src, target = _reduced_eagle(tmp_path)
    out = quantize_package(src, tmp_path / "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_package(out, tmp_path / "again")
    with pytest.raises(ValueError, match="inside it"):
        quantize_package(src, src / "int8")
    with pytest.raises(ValueError, match="CPU only"):
        pkg = load_draft(out, target)
        build_proposer(pkg, settle(CHAIN, pkg, measured=False), target, 64, device="cuda")
    info = json.loads((out / PACKAGE_JSON).read_text())
    info["quantization"]["modules"].append("no_such_layer")
    (out / PACKAGE_JSON).write_text(json.dumps(info))
    with pytest.raises(PackageIntegrityError):  # the edit is caught by the manifest first
        load_package(out, target=target)
    from draftsmith.heads.manifest import write_manifest

    old = json.loads((out / "manifest.json").read_text())
    write_manifest(out, {k: v for k, v in old.items() if k not in ("files", "signer")})
    sign_folder(out)  # a signed package whose record names a module the draft lacks
    with pytest.raises(PackageIntegrityError, match="no_such_layer"):
        load_package(out, target=target)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_weight_only_copy_exports_its_dequantized_weights(tmp_path, scheme):
    """Engines load float layouts: the export of an int8 / int4 copy carries the weights the copy
    multiplies by, so the engine's head drafts as the copy does (not as the float source)."""
    from draftsmith.heads.exports import import_export
    from draftsmith.heads.manifest import MANIFEST
    from draftsmith.scripts.export import export_package

    src, target = _reduced_eagle(tmp_path, "eagle3")  # the layout EAGLE-3 engines serve
    out = quantize_package(src, tmp_path / scheme, scheme)
    exp = export_package(out, "eagle3", tmp_path / "export", target=target)
    assert json.loads((exp / MANIFEST).read_text())["dequantized_from"] == scheme
    copy = load_package(out, target=target).module
    back = import_export(exp, target=target).module
    assert isinstance(back.layer.mlp.down_proj, torch.nn.Linear)
    torch.testing.assert_close(back.layer.mlp.down_proj.weight, copy.layer.mlp.down_proj.weight)
    torch.testing.assert_close(back.lm_head.weight, copy.lm_head.weight)
    float_head = load_package(src, target=target).module
    assert not torch.allclose(back.lm_head.weight, float_head.lm_head.weight, atol=1e-6)


def test_a_copy_quantized_per_call_is_not_exported(tmp_path):
    from draftsmith.scripts.export import export_package

    src, target = _reduced_eagle(tmp_path, "eagle3")
    out = quantize_package(src, tmp_path / "int8_dynamic", "int8_dynamic")
    with pytest.raises(ValueError, match="export the package it was made from"):
        export_package(out, "eagle3", tmp_path / "export", target=target)
