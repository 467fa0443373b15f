"""scripts/release.py: a 16-bit copy of a head package that loads and verifies like the original."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file

from heads.eagle import EagleConfig, build_eagle
from heads.family import WEIGHTS
from heads.package import PackageIntegrityError, load_package, save_package
from scripts.release import release


def _eagle3_package(tmp_path):
    target = make_tiny_target()
    cfg = EagleConfig(fuse_layers=[0, 2], draft_vocab_size=16)
    counts = torch.arange(target.model.config.vocab_size, dtype=torch.long)
    head = build_eagle(cfg, target.model, token_counts=counts)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return save_package(tmp_path / "pkg", "eagle", head, cfg, target.identity), head, target


def test_release_stores_16_bit_weights_keeps_the_maps_and_verifies(tmp_path):
    src, head, target = _eagle3_package(tmp_path)
    out = release(src, tmp_path / "rel", command="test")
    state = load_file(str(out / WEIGHTS))
    assert state["fc.weight"].dtype == torch.bfloat16
    assert state["d2t"].dtype == torch.long and torch.equal(state["d2t"], head.d2t)
    assert state["t2d"].dtype == torch.bool
    rec = json.loads((out / "release.json").read_text())
    assert rec["weights_dtype"] == "bfloat16" and len(rec["source_manifest_sha256"]) == 64
    pkg = load_package(out, target=target)
    feats = torch.randn(1, 4, 2 * target.model.config.hidden_size)
    ids = torch.randint(0, target.model.config.vocab_size, (1, 4))
    bf16 = head.to(torch.bfloat16)
    want = bf16.compute_logits(bf16(feats, ids)).float()
    got = pkg.module.to(torch.bfloat16)
    torch.testing.assert_close(got.compute_logits(got(feats, ids)).float(), want,
                               rtol=0, atol=0)
    assert (out / "training_config.yaml").exists() == (src / "training_config.yaml").exists()


def test_release_is_checked_by_the_manifest_and_refuses_to_overwrite_its_source(tmp_path):
    src, _, target = _eagle3_package(tmp_path)
    out = release(src, tmp_path / "rel")
    data = bytearray((out / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (out / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(PackageIntegrityError):
        load_package(out, target=target)
    for bad in (src, src / "inner"):
        with pytest.raises(ValueError, match="inside it"):
            release(src, bad)
    with pytest.raises(ValueError, match="dtype"):
        release(src, tmp_path / "x", dtype="int8")


@pytest.mark.real
def test_the_committed_release_loads_verifies_and_drafts_inside_its_vocabulary(real_target):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "releases" / "eagle3-smollm2-135m"
    pkg = load_package(root, target=real_target)  # manifest + target identity checked
    head = pkg.module
    assert pkg.kind == "eagle" and head.reduced and head.cfg.fuse_layers == [2, 15, 30]
    assert load_file(str(root / WEIGHTS))["fc.weight"].dtype == torch.bfloat16
    assert pkg.speculation is not None and pkg.speculation["dtype"] in ("bfloat16", "float32")
    # d2t / t2d: a round trip, and every proposal maps into the draft vocabulary
    d2t, t2d = head.d2t, head.t2d
    assert int(t2d.sum()) == d2t.numel() == 8192 and bool(t2d[d2t].all())
    assert torch.equal(torch.nonzero(t2d).flatten(), d2t)
    h = real_target.model.config.hidden_size
    feats = torch.randn(1, 6, 3 * h)
    ids = torch.randint(0, real_target.model.config.vocab_size, (1, 6))
    with torch.no_grad():
        draft_ids = head.compute_logits(head(feats, ids)).argmax(-1)
    proposed = head.to_target_ids(draft_ids)
    assert bool(t2d[proposed].all())
    rec = json.loads((root / "release.json").read_text())
    assert rec["weights_dtype"] == "bfloat16" and rec["command"].startswith("python scripts/")
