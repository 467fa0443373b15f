"""Draft package format: round trips, manifest checks, refusals, atomic writes."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from draftsmith.data.identity import TargetMismatchError, sha256_file
from draftsmith.heads.draft_lm import DraftLMConfig, build_draft_lm
from draftsmith.heads.manifest import MANIFEST, SIGNATURE, PackageIntegrityError
from draftsmith.heads.medusa import MedusaConfig, build_medusa
from draftsmith.heads.package import PACKAGE_JSON, load_package, save_package, update_package_json
from draftsmith.heads.weights import WEIGHTS

REPO = Path(__file__).resolve().parents[2]


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter random values (zero-initialised blocks would hide key mix-ups)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _medusa_package(tmp_path: Path, target, name: str = "pkg", **extra) -> tuple[Path, object]:
    cfg = MedusaConfig(num_heads=3, num_layers=2)
    heads = _randomize(build_medusa(cfg, target.model))
    out = save_package(tmp_path / name, "medusa", heads, cfg, target.identity, **extra)
    return out, heads


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_medusa_round_trip_same_outputs(tmp_path):
    target = make_tiny_target()
    out, heads = _medusa_package(tmp_path, target, train_config={"optim": {"lr": 1e-3}},
                                 extra_json={"speculation": {"k_star": 3}})
    pkg = load_package(out, target=target)
    hidden = torch.randn(2, 5, target.model.config.hidden_size)
    assert pkg.family.name == "medusa"
    assert pkg.head_config == MedusaConfig(num_heads=3, num_layers=2)
    assert pkg.speculation == {"k_star": 3}
    assert pkg.identity == target.identity
    torch.testing.assert_close(pkg.module(hidden), heads(hidden), rtol=0, atol=0)
    # loading without a target also works for Medusa (sizes come from the identity)
    alone = load_package(out)
    torch.testing.assert_close(alone.module(hidden), heads(hidden), rtol=0, atol=0)


def test_draft_lm_round_trip_is_a_plain_hf_model(tmp_path):
    target = make_tiny_target()
    tc = target.model.config
    cfg = DraftLMConfig.matching(tc, 1, init="random")
    draft = _randomize(build_draft_lm(cfg, target.model))
    out = save_package(tmp_path / "lm", "lm", draft, cfg, target.identity)
    for name in ("config.json", "generation_config.json", "model.safetensors", PACKAGE_JSON):
        assert (out / name).is_file(), name
    pkg = load_package(out, target=target)
    ids = torch.randint(0, tc.vocab_size, (2, 7))
    torch.testing.assert_close(pkg.module(ids).logits, draft(ids).logits, rtol=0, atol=0)


def test_manifest_records_every_file_and_the_provenance(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target, train_config={"seed": 7},
                             extra_json={"validation.json": {"a_hat": [0.5]}})
    manifest = json.loads((out / MANIFEST).read_text())
    on_disk = sorted(p.name for p in out.iterdir() if p.name not in (MANIFEST, SIGNATURE))
    assert sorted(manifest["files"]) == on_disk
    assert (out / SIGNATURE).is_file() and len(manifest["signer"]["fingerprint"]) == 16
    assert {"training_config.yaml", "validation.json", WEIGHTS, PACKAGE_JSON} <= set(on_disk)
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(out / name)
        assert entry["size"] == (out / name).stat().st_size
    assert manifest["draft_kind"] == "medusa"
    assert manifest["target"] == target.identity.to_dict()
    assert manifest["format_version"] == 1
    assert manifest["training_config"] == {"seed": 7}


def test_flipped_byte_is_refused(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    _flip_byte(out / WEIGHTS)
    with pytest.raises(PackageIntegrityError, match=r"'model\.safetensors' was modified"):
        load_package(out, target=target)


def test_truncated_file_is_refused(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    data = (out / WEIGHTS).read_bytes()
    (out / WEIGHTS).write_bytes(data[: len(data) - 100])
    with pytest.raises(PackageIntegrityError) as err:
        load_package(out, target=target)
    msg = str(err.value)
    assert "'model.safetensors' is truncated" in msg
    assert f"{len(data) - 100} bytes on disk, {len(data)} bytes" in msg
    assert "was modified" not in msg


def test_missing_file_is_refused(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target, extra_json={"speculation": {"k_star": 2}})
    (out / "speculation.json").unlink()
    with pytest.raises(PackageIntegrityError,
                       match=r"'speculation\.json' is listed .* but missing"):
        load_package(out, target=target)


def test_extra_unlisted_weight_file_is_refused(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    (out / "model-00002.safetensors").write_bytes(b"not listed")
    with pytest.raises(PackageIntegrityError, match=r"'model-00002\.safetensors' is not listed"):
        load_package(out, target=target)


def test_draft_for_another_target_is_refused(tmp_path):
    target = make_tiny_target(seed=0)
    out, _ = _medusa_package(tmp_path, target)
    other = make_tiny_target(seed=1)  # same shapes, other weights
    with pytest.raises(TargetMismatchError) as err:
        load_package(out, target=other)
    msg = str(err.value)
    assert "weights_sha256" in msg
    assert repr(target.identity.weights_sha256) in msg
    assert repr(other.identity.weights_sha256) in msg
    assert "tokenizer_sha256" not in msg  # only the differing field is named


def test_draft_for_another_tokenizer_is_refused(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    other = make_tiny_target()
    other.identity = replace(target.identity, tokenizer_sha256="other-tok")
    with pytest.raises(TargetMismatchError, match=r"tokenizer_sha256: .*'tiny-tok'.*'other-tok'"):
        load_package(out, target=other)


def test_allow_unverified_loads_with_a_loud_warning(tmp_path, caplog):
    target = make_tiny_target()
    out, heads = _medusa_package(tmp_path, target)
    (out / "notes.bin").write_bytes(b"x")  # an unlisted weight-like file; weights untouched
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.package"):
        pkg = load_package(out, target=target, allow_unverified=True)
    assert "UNVERIFIED" in caplog.text and "notes.bin" in caplog.text
    hidden = torch.randn(1, 3, target.model.config.hidden_size)
    torch.testing.assert_close(pkg.module(hidden), heads(hidden), rtol=0, atol=0)


def test_update_package_json_keeps_the_manifest_valid_and_tamper_evident(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    update_package_json(out, "speculation.json", {"k_star": 4, "alpha": [0.7]})
    assert load_package(out, target=target).speculation == {"k_star": 4, "alpha": [0.7]}
    _flip_byte(out / WEIGHTS)  # tampered before the next update: refused, not re-signed
    with pytest.raises(PackageIntegrityError, match=r"'model\.safetensors' was modified"):
        update_package_json(out, "speculation", {"k_star": 5})
    assert json.loads((out / "speculation.json").read_text()) == {"k_star": 4, "alpha": [0.7]}
    with pytest.raises(PackageIntegrityError, match="was modified"):
        load_package(out, target=target)


def test_failed_save_leaves_the_old_package(tmp_path, monkeypatch):
    target = make_tiny_target()
    out, heads = _medusa_package(tmp_path, target)
    before = (out / MANIFEST).read_text()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    from draftsmith.heads import package
    monkeypatch.setattr(package, "write_manifest", boom)
    new_heads = _randomize(build_medusa(MedusaConfig(num_heads=3, num_layers=2), target.model), 1)
    with pytest.raises(RuntimeError, match="disk full"):
        save_package(out, "medusa", new_heads, MedusaConfig(num_heads=3, num_layers=2),
                     target.identity)
    assert (out / MANIFEST).read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]  # no temporary folder left behind
    hidden = torch.randn(1, 2, target.model.config.hidden_size)
    torch.testing.assert_close(load_package(out).module(hidden), heads(hidden), rtol=0, atol=0)


@pytest.mark.slow
def test_process_killed_mid_write_leaves_old_package_or_none(tmp_path):
    """A hard kill (no cleanup) while the new package is half written."""
    target = make_tiny_target()
    out, heads = _medusa_package(tmp_path, target)
    fresh = tmp_path / "fresh"
    script = textwrap.dedent(f"""
        import os
        from draftsmith.heads import package
        from conftest import make_tiny_target
        from draftsmith.heads.medusa import MedusaConfig, build_medusa
        def killed(root, meta):  # weights written, manifest not yet: die like SIGKILL
            os._exit(9)
        package.write_manifest = killed
        t = make_tiny_target()
        cfg = MedusaConfig(num_heads=3, num_layers=2)
        for dest in ({str(out)!r}, {str(fresh)!r}):
            pid = os.fork()
            if pid == 0:
                package.save_package(dest, "medusa", build_medusa(cfg, t.model), cfg, t.identity)
            os.waitpid(pid, 0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=300, cwd=REPO / "tests")  # conftest from the cwd
    assert proc.returncode == 0, proc.stderr
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert any(".tmp-" in name for name in leftovers)  # the half-written folders stay aside
    assert not fresh.exists()  # no package rather than half of one
    hidden = torch.randn(1, 2, target.model.config.hidden_size)
    torch.testing.assert_close(load_package(out).module(hidden), heads(hidden), rtol=0, atol=0)
    assert os.path.isdir(out)


def test_eagle_round_trip_with_and_without_target(tmp_path):
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig

    target = make_tiny_target()
    tc = target.model.config
    cfg = EagleConfig(fuse_layers=[0, 2])
    head = build_eagle(cfg, target.model)
    _randomize(head)
    head.attach_target(target.model)  # frozen parts back to the target's
    out = save_package(tmp_path / "eagle", "eagle", head, cfg, target.identity)
    from safetensors import safe_open
    with safe_open(str(out / WEIGHTS), "pt") as f:
        stored = set(f.keys())
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in stored)  # frozen: not saved
    feats = torch.randn(2, 5, 2 * tc.hidden_size)
    ids = torch.randint(0, tc.vocab_size, (2, 5))
    want = head.compute_logits(head(feats, ids))
    pkg = load_package(out, target=target)
    torch.testing.assert_close(pkg.module.compute_logits(pkg.module(feats, ids)), want,
                               rtol=0, atol=0)
    alone = load_package(out)  # rebuilt from the stored target config, then attached
    assert not alone.module.target_attached  # the frozen parts wait for their target
    alone.module.attach_target(target.model)
    assert alone.module.target_attached
    torch.testing.assert_close(alone.module.compute_logits(alone.module(feats, ids)), want,
                               rtol=0, atol=0)


# ----------------------------------------------------------------------------- every file listed
def _rewrite_manifest(out: Path, change) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    change(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))


def test_unlisted_speculation_json_is_refused_a_listed_one_is_read(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    assert load_package(out).speculation is None
    (out / "speculation.json").write_text('{"k_star": 9}')  # dropped in: would set K*
    with pytest.raises(PackageIntegrityError) as err:
        load_package(out, target=target)
    assert ("file 'speculation.json' is not listed in manifest.json (unlisted files are refused)"
            in str(err.value))
    with pytest.raises(PackageIntegrityError, match=r"'token_frequency\.json' is not listed"):
        (out / "speculation.json").unlink()
        (out / "token_frequency.json").write_text("{}")
        load_package(out)
    (out / "token_frequency.json").unlink()
    update_package_json(out, "speculation", {"k_star": 2})  # listed (and signed): read
    assert load_package(out, target=target).speculation == {"k_star": 2}


@pytest.mark.parametrize("entry", ["../../../../etc/hostname", "/etc/hostname", "sub/../../x",
                                   "./model.safetensors", "a\\b", "a//b"])
def test_manifest_paths_outside_the_package_are_refused_unopened(tmp_path, monkeypatch, entry):
    from draftsmith.heads import manifest as manifest_mod

    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    _rewrite_manifest(out, lambda m: m["files"].__setitem__(
        entry, {"sha256": "0" * 64, "size": 1}))
    opened = []
    real = manifest_mod.sha256_file
    monkeypatch.setattr(manifest_mod, "sha256_file", lambda p: opened.append(Path(p)) or real(p))
    with pytest.raises(PackageIntegrityError) as err:
        load_package(out, target=target)
    assert f"entry {entry!r} in manifest.json" in str(err.value)
    assert opened == []  # refused before any file is hashed: nothing outside is ever read


def test_symlinks_are_refused_even_to_identical_content(tmp_path):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((out / WEIGHTS).read_bytes())
    (out / WEIGHTS).unlink()
    (out / WEIGHTS).symlink_to(outside)  # the listed hash still matches through the link
    with pytest.raises(PackageIntegrityError) as err:
        load_package(out, target=target)
    assert ("'model.safetensors' is a symbolic link (links are refused: they can point outside "
            "the package)") in str(err.value)
    (out / WEIGHTS).unlink()
    (out / WEIGHTS).write_bytes(outside.read_bytes())  # the real file back: loads
    load_package(out, target=target)
    (out / "extra").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(PackageIntegrityError, match=r"'extra' is a symbolic link"):
        load_package(out, target=target)


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m["files"][WEIGHTS].pop("size"),
     "entry 'model.safetensors' in manifest.json has no 'size'"),
    (lambda m: m["files"][WEIGHTS].pop("sha256"),
     "entry 'model.safetensors' in manifest.json has no 'sha256'"),
    (lambda m: m["files"][WEIGHTS].__setitem__("size", "12"),
     "entry 'model.safetensors' in manifest.json: 'size' '12' is not a non-negative integer"),
    (lambda m: m["files"][WEIGHTS].__setitem__("sha256", 5),
     "entry 'model.safetensors' in manifest.json: 'sha256' 5 is not 64 lowercase hex digits"),
    (lambda m: m["files"].__setitem__(WEIGHTS, "abc"),
     "entry 'model.safetensors' in manifest.json is not an object with sha256 and size"),
    (lambda m: m.__setitem__("files", ["model.safetensors"]),
     "'files' in 'manifest.json' is not an object"),
    (lambda m: m.pop("files"), "'files' in 'manifest.json' is missing"),
])
def test_malformed_manifest_is_an_integrity_error_naming_the_entry(tmp_path, change, message):
    target = make_tiny_target()
    out, _ = _medusa_package(tmp_path, target)
    _rewrite_manifest(out, change)
    with pytest.raises(PackageIntegrityError) as err:
        load_package(out, target=target)
    assert message in str(err.value)
    (out / MANIFEST).write_text("[1, 2]")
    with pytest.raises(PackageIntegrityError, match="'manifest.json' is not a JSON object"):
        load_package(out, target=target)
