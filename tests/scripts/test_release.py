"""scripts/release.py: a 16-bit copy of a head package that loads and verifies like the original."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file

from draftsmith.heads.eagle import build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.keys import RELEASE_KEYS, _load_public, fingerprint, public_key_of
from draftsmith.heads.manifest import MANIFEST, SIGNATURE, PackageIntegrityError
from draftsmith.heads.package import load_package, save_package, verify_package
from draftsmith.heads.signing import PackageSignatureError, sign_folder
from draftsmith.heads.vocab import TOKEN_FREQUENCY, frequency_record
from draftsmith.heads.weights import WEIGHTS, WEIGHTS_INDEX, load_weights
from draftsmith.scripts.release import recipe_steps, release, run_recipe

COMMITTED = Path(__file__).resolve().parents[2] / "releases" / "eagle3-smollm2-135m"
RELEASE_RECIPES = Path(__file__).resolve().parents[2] / "conf" / "release"


def _eagle3_package(tmp_path, layout: str = "eagle1"):
    target = make_tiny_target()
    fuse = [0, 2] if layout == "eagle1" else [0, 1]  # eagle3: layers before the final norm
    cfg = EagleConfig(fuse_layers=fuse, draft_vocab_size=16, layout=layout)
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


def test_release_weights_over_the_shard_size_are_stored_in_signed_shards(tmp_path):
    src, _, target = _eagle3_package(tmp_path)
    whole = load_weights(src)
    out = release(src, tmp_path / "rel", command="test", max_shard_mb=0.008)  # 8,000 bytes
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / WEIGHTS).exists()
    assert all(f.stat().st_size <= 8_000 + 1_000 for f in shards)  # bound + header
    index = json.loads((out / WEIGHTS_INDEX).read_text())
    assert set(index["weight_map"]) == set(whole)
    listed = json.loads((out / MANIFEST).read_text())["files"]
    assert {f.name for f in shards} | {WEIGHTS_INDEX} <= set(listed)  # each shard signed
    pkg = load_package(out, target=target)
    for name, tensor in pkg.module.trainable_state_dict().items():
        torch.testing.assert_close(tensor, whole[name].to(torch.bfloat16).to(tensor.dtype))
    again = release(out, tmp_path / "rel2", command="test")  # a sharded source: one file again
    assert (again / WEIGHTS).is_file() and not (again / WEIGHTS_INDEX).exists()
    data = bytearray(shards[1].read_bytes())  # the twin: a changed shard is refused
    data[-1] ^= 1
    shards[1].write_bytes(bytes(data))
    with pytest.raises(PackageIntegrityError, match=shards[1].name):
        load_package(out, target=target)


def test_an_int8_package_is_released_as_the_int8_weights_its_decode_uses(tmp_path):
    from draftsmith.scripts.quantize import quantize_package

    src, _, target = _eagle3_package(tmp_path)
    q = quantize_package(src, tmp_path / "int8")
    out = release(q, tmp_path / "rel", command="test")
    stored = load_file(str(out / WEIGHTS))
    modules = json.loads((out / "draftsmith.json").read_text())["quantization"]["modules"]
    assert modules and all(f"{m}.weight" not in stored for m in modules)
    assert all(stored[f"{m}.weight_int8"].dtype == torch.int8 for m in modules)
    assert stored["fc.weight"].dtype == torch.bfloat16  # left float by scripts/quantize.py
    assert json.loads((out / "release.json").read_text())["int8_modules"] == len(modules)
    bf16 = release(src, tmp_path / "rel16", command="test")
    assert (out / WEIGHTS).stat().st_size < 0.75 * (bf16 / WEIGHTS).stat().st_size
    feats = torch.randn(1, 5, 2 * target.model.config.hidden_size, dtype=torch.bfloat16)
    ids = torch.randint(0, target.model.config.vocab_size, (1, 5))
    logits = []
    for pkg_dir in (q, out):  # the float int8 copy and the stored int8 release draft the same
        head = load_package(pkg_dir, target=target).module.to(torch.bfloat16).eval()
        with torch.no_grad():
            logits.append(head.compute_logits(head(feats, ids)).float())
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    head = load_package(src, target=target).module.to(torch.bfloat16).eval()
    with torch.no_grad():  # (the twin: the float head drafts other logits)
        assert not torch.equal(head.compute_logits(head(feats, ids)).float(), logits[0])


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


def test_a_release_keeps_its_folders_card_not_its_sources(tmp_path):
    """The model card (README.md, unsigned) describes its folder: a source's card is not copied,
    and releasing again over a folder keeps that folder's card."""
    src, _, target = _eagle3_package(tmp_path)
    (src / "README.md").write_text("the source's card\n")
    out = release(src, tmp_path / "rel")
    assert not (out / "README.md").exists()
    (out / "README.md").write_text("the release's card\n")
    release(src, out)
    assert (out / "README.md").read_text() == "the release's card\n"
    assert "README.md" not in json.loads((out / MANIFEST).read_text())["files"]
    load_package(out, target=target)


def test_a_release_recipe_is_its_commands_in_order(tmp_path, capsys):
    out = str(tmp_path / "rel")
    steps = recipe_steps("eagle3-smollm2-135m", out=out)
    argvs = [step.argv for step in steps]
    trains = [argv for argv in argvs if "train/distill.py" in argv]
    assert len(trains) == 2 and all(Path(argv[0]).name == "accelerate" for argv in trains)
    assert "experiment=eagle3_cpu" in trains[0] and "name=eagle3_engine" in trains[0]
    assert "draft.init_from=outputs/eagle3_engine/release" in trains[1]
    releases = [argv[2:] for argv in argvs if argv[1] == "scripts/release.py"]
    assert releases == [["draft=outputs/eagle3_engine/draft", "out=outputs/eagle3_engine/release"],
                        ["draft=outputs/eagle3_long/draft", f"out={out}"]]
    assert not any("{out}" in arg for argv in argvs for arg in argv)
    run_recipe("eagle3-smollm2-135m", out=out, dry_run=True)  # prints, runs nothing
    assert capsys.readouterr().out.count("=== recipe=eagle3-smollm2-135m step") == len(steps)
    assert not Path(out).exists()
    with pytest.raises(ValueError, match="there is no conf/release/nope.yaml"):
        recipe_steps("nope")


def test_a_recipe_step_with_unless_is_skipped_once_its_file_exists(tmp_path, monkeypatch, capsys):
    """A recipe rerun after a later step continued a training run (more steps on the same
    checkpoints) must not rerun the earlier, shorter step: the trainer would refuse it."""
    import draftsmith.scripts.release as rel

    (tmp_path / "r.yaml").write_text(
        "name: r\nout: rel\nsteps:\n"
        "  - run: [-c, \"open('one.txt', 'a').write('x')\"]\n    unless: one.txt\n"
        "  - run: [-c, \"open('two.txt', 'a').write('x')\"]\n")
    monkeypatch.setattr(rel, "RECIPES", tmp_path)
    monkeypatch.setattr(rel, "REPO", tmp_path)
    assert [s.unless for s in recipe_steps("r")] == ["one.txt", None]
    run_recipe("r")
    run_recipe("r")
    assert (tmp_path / "one.txt").read_text() == "x"  # the second run skipped it
    assert (tmp_path / "two.txt").read_text() == "xx"
    assert "skipped: one.txt exists" in capsys.readouterr().out


def test_a_recipe_step_with_a_misspelt_key_is_refused_by_name(tmp_path, monkeypatch):
    """A misspelt `unless` would otherwise be ignored and the step rerun."""
    import draftsmith.scripts.release as rel

    (tmp_path / "r.yaml").write_text("name: r\nout: rel\nsteps:\n"
                                     "  - run: [-c, pass]\n    unles: one.txt\n")
    monkeypatch.setattr(rel, "RECIPES", tmp_path)
    with pytest.raises(ValueError, match=r"step 1 has unknown keys \['unles'\]"):
        recipe_steps("r")


@pytest.mark.parametrize("folder", sorted(p for p in COMMITTED.parent.iterdir()
                                           if p.is_dir() and p.name != "keys"),
                         ids=lambda p: p.name)
def test_every_committed_release_has_a_card(folder):
    assert (folder / "README.md").is_file(), (
        f"{folder} has no model card README.md: target, data, the one command that reproduces "
        "it, tokens trained, alpha-hat per position, served tau / speedup with the file behind "
        "each figure, the engines that load it, its signer (see releases/eagle3-smollm2-135m)")


def test_a_release_recipe_and_its_card_name_each_other():
    recipes = sorted(RELEASE_RECIPES.glob("*.yaml"))
    assert COMMITTED.name in [p.stem for p in recipes]
    for recipe in recipes:
        card = (COMMITTED.parent / recipe.stem / "README.md").read_text()
        assert f"python scripts/release.py recipe={recipe.stem}" in card


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
    assert pkg.family.name == "eagle" and head.reduced and head.cfg.fuse_layers == [2, 15, 27]
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


def test_release_draft_vocab_keeps_the_most_frequent_ids_and_their_rows(tmp_path):
    _, head, target = _eagle3_package(tmp_path)  # 16 draft ids
    counts = torch.arange(target.model.config.vocab_size, dtype=torch.long)  # rise with the id
    src = save_package(tmp_path / "counted", "eagle", head, head.cfg, target.identity,
                       extra_json={TOKEN_FREQUENCY: frequency_record(counts, "test")})
    out = release(src, tmp_path / "rel", command="test", draft_vocab=6)
    pkg = load_package(out, target=target)
    d2t = pkg.module.d2t
    eos = target.model.config.eos_token_id
    forced = {eos} if isinstance(eos, int) and bool(head.t2d[eos]) else set()
    top = sorted(head.d2t.tolist())[::-1]  # the head's ids, most frequent first (counts = id)
    want = sorted(set(top[:6 - len(forced - set(top[:6]))]) | forced)
    assert d2t.tolist() == want and pkg.info["head_config"]["draft_vocab_size"] == 6
    assert torch.equal(torch.nonzero(pkg.module.t2d).flatten(), d2t)
    rows = torch.isin(head.d2t, d2t).nonzero().flatten()
    full = head.lm_head.weight.detach()[rows].to(torch.bfloat16)
    assert torch.equal(pkg.module.lm_head.weight.detach().to(torch.bfloat16), full)
    assert json.loads((out / "release.json").read_text())["draft_vocab_cut"] == 6
    with pytest.raises(ValueError, match="draft_vocab=16: the head drafts over 16 ids"):
        release(src, tmp_path / "rel2", command="test", draft_vocab=16)
