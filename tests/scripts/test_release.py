"""scripts/release.py: a 16-bit copy of a head package that loads and verifies like the original."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file

from heads.eagle import EagleConfig, build_eagle
from heads.family import WEIGHTS
from heads.package import (
    MANIFEST,
    SIGNATURE,
    PackageIntegrityError,
    PackageSignatureError,
    load_package,
    save_package,
    verify_package,
)
from heads.signing import RELEASE_KEYS, _load_public, fingerprint, public_key_of, sign_folder
from scripts.release import release

COMMITTED = Path(__file__).resolve().parents[2] / "releases" / "eagle3-smollm2-135m"


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
    assert pkg.info["signer"] == fingerprint(_load_public(public_key_of()))  # signed anew
    assert SIGNATURE not in json.loads((out / MANIFEST).read_text())["files"]
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
    sign_folder(src, private_key=tmp_path / "someone-else.pem")  # an untrusted source
    with pytest.raises(PackageSignatureError, match="not trusted"):
        release(src, tmp_path / "rel2")
    with pytest.raises(ValueError, match="dtype"):
        release(src, tmp_path / "x", dtype="int8")


def test_the_committed_release_is_signed_by_the_committed_release_key(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_SIGNING_KEY", str(tmp_path / "no-local-key.pem"))
    release_fp = fingerprint(_load_public(RELEASE_KEYS / "draftsmith-release.pub"))
    manifest, signer = verify_package(COMMITTED)  # signature, then every file listed and intact
    assert signer == release_fp == manifest["signer"]["fingerprint"]
    assert not (tmp_path / "no-local-key.pem").exists()  # verifying makes no key


@pytest.mark.real
def test_the_committed_release_loads_verifies_and_drafts_inside_its_vocabulary(real_target):
    root = COMMITTED
    pkg = load_package(root, target=real_target)  # signature, manifest, target identity checked
    assert pkg.info["signer"] == fingerprint(_load_public(RELEASE_KEYS / "draftsmith-release.pub"))
    head = pkg.module
    # the engines' EAGLE-3 layout: fused layers below the final norm, so it exports exactly
    assert pkg.kind == "eagle" and head.reduced and head.cfg.fuse_layers == [2, 15, 27]
    assert head.cfg.layout == "eagle3"
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
