"""Other trainers' EAGLE-3 checkpoints (speculators, ModelOpt, SpecForge) read into the EAGLE-3
head.

The peer folders are written here in each trainer's own layout from a head of ours (through our
own export writers, then as the trainers store them: speculators' checkpoint keeps the verifier
embedding and has no manifest; ModelOpt's export names layer ``i``'s output ``i`` and has no
``t2d``; SpecForge's SGLang export keeps ``midlayer.*``, names by SGLang's ids, has no ``fc``
bias and no embedding), so the tests need no peer environment.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import eagle3_draft_logits, make_tiny_target, randomize
from safetensors.torch import load_file, save_file

from draftsmith.eval import decode
from draftsmith.heads.eagle import build_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.package import save_package
from draftsmith.heads.peer_format import PeerCheckpointError, peer_format
from draftsmith.heads.peer_import import peer_as_draft, read_peer
from draftsmith.scripts.export import export_package

TRAINER_FLAGS = {"norm_before_fc": False, "fc_norm": False, "norm_output": False,
                 "embed_requires_grad": False}


def _head(model, fuse, vocab=40, seed=3):
    cfg = EagleConfig(layout="eagle3", fuse_layers=list(fuse), draft_vocab_size=vocab)
    counts = torch.arange(model.config.vocab_size, dtype=torch.float).flip(0)
    head = randomize(build_eagle(cfg, model, token_counts=counts), seed)
    head.attach_target(model)
    return cfg, head.eval()


def _strip(folder: Path) -> None:
    """Drop what only draftsmith writes (manifest, signature, card)."""
    for name in ("manifest.json", "model.sig", "README.md", "speculation.json"):
        (folder / name).unlink(missing_ok=True)


def speculators_checkpoint(pkg: Path, out: Path, model, dtype=torch.float32) -> Path:
    """``pkg`` as speculators' trainer saves a checkpoint (``save_pretrained``): our speculators
    export plus the verifier embedding and the trainer's flags, without manifest or signature."""
    export_package(pkg, "speculators", out, verifier="/models/tiny")
    _strip(out)
    state = load_file(str(out / "model.safetensors"))
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    save_file({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()},
              str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(TRAINER_FLAGS)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def modelopt_export(pkg: Path, out: Path) -> Path:
    """``pkg`` as ModelOpt exports an EAGLE-3 draft: ``layers.0.*``, ``d2t`` offsets and no
    ``t2d``; captured layer ids count layer outputs (``hidden_states[i + 1]``)."""
    export_package(pkg, "eagle3", out)
    _strip(out)
    state = load_file(str(out / "model.safetensors"))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items() if k != "t2d"}
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                           "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                           "use_last_layernorm": True, "use_mtp_layernorm": False,
                           "next_layer_regular": True, "parallel_draft_step": 1,
                           "parallel_draft_heads_num_layers": 1}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def specforge_export(pkg: Path, out: Path, listed=None) -> Path:
    """``pkg`` as SpecForge's ``export --to sglang`` writes it: ``midlayer.*``, ``d2t`` offsets,
    ``t2d``, no ``fc.bias`` or embedding; its config is the draft config it trained with, whose
    ``eagle_config`` lists SGLang's ids (``hidden_states[i]`` is id ``i - 1``) in the order
    ``listed`` (SGLang concatenates them in layer order whatever the listed order)."""
    export_package(pkg, "eagle3", out, engine="sglang")
    _strip(out)
    state = load_file(str(out / "model.safetensors"))
    state.pop("fc.bias", None)
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    for key in ("eagle_config", "norm_before_residual", "target_hidden_size"):
        cfg.pop(key, None)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": listed or ids}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _peer_folder(fmt: str, pkg: Path, out: Path, model) -> Path:
    if fmt == "speculators":
        return speculators_checkpoint(pkg, out, model)
    if fmt == "modelopt":
        return modelopt_export(pkg, out)
    return specforge_export(pkg, out, listed=[2, 0, 1])  # hidden_states 3, 1, 2


def _inputs(model, n_layers: int):
    ids = torch.randint(5, model.config.vocab_size, (1, 9),
                        generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return ids, {i: hs[i] for i in range(n_layers)}


@pytest.fixture
def four_layers(tmp_path):
    target = make_tiny_target(layers=4)
    cfg, head = _head(target.model, fuse=(3, 1, 2))  # not ascending: fc's column order matters
    pkg = save_package(tmp_path / "pkg", "eagle", head, cfg, target.identity)
    return target, head, pkg


@pytest.mark.parametrize("fmt", ["speculators", "modelopt", "specforge"])
def test_peer_folder_gives_the_heads_draft_logits(four_layers, tmp_path, fmt, caplog):
    target, head, pkg = four_layers
    folder = _peer_folder(fmt, pkg, tmp_path / fmt, target.model)
    assert peer_format(folder) == fmt and peer_format(pkg) is None
    with caplog.at_level(logging.WARNING):
        back = peer_as_draft(folder, target)
    assert str(folder) in caplog.text and "unsigned import" in caplog.text
    assert back.info["peer"] == fmt and back.head_config.fuse_layers == [1, 2, 3]  # as listed
    ids, layers = _inputs(target.model, 4)
    with torch.no_grad():
        for a, b in zip(eagle3_draft_logits(back.module, layers, ids, 3),
                        eagle3_draft_logits(head, layers, ids, 3)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _rewrite(folder: Path, change) -> None:
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
@pytest.mark.parametrize("broken", ["fc_order", "d2t"])
def test_a_broken_mapping_gives_other_logits(four_layers, tmp_path, broken, fmt):
    """The twin: the same comparison fails on a wrong fc column order or a shifted d2t."""
    target, head, pkg = four_layers
    folder = _peer_folder(fmt, pkg, tmp_path / fmt, target.model)

    def swap_fc(state):
        a, b, c = state["fc.weight"].chunk(3, dim=1)
        state["fc.weight"] = torch.cat([b, a, c], dim=1).contiguous()

    def shift_d2t(state):  # every draft row mapped to its neighbour's target id
        d2t = state["d2t"] + torch.arange(state["d2t"].numel())
        rolled = d2t.roll(1)
        state["d2t"] = rolled - torch.arange(rolled.numel())
        state["t2d"] = torch.zeros_like(state["t2d"]).index_fill_(0, rolled, True)

    _rewrite(folder, swap_fc if broken == "fc_order" else shift_d2t)
    back = peer_as_draft(folder, target)
    ids, layers = _inputs(target.model, 4)
    with torch.no_grad():
        a = eagle3_draft_logits(back.module, layers, ids)[0]
        b = eagle3_draft_logits(head, layers, ids)[0]
    assert not torch.allclose(a, b, rtol=1e-3, atol=1e-3)


def test_what_the_head_cannot_compute_is_refused_by_name(four_layers, tmp_path):
    target, _, pkg = four_layers
    folder = speculators_checkpoint(pkg, tmp_path / "sp", target.model)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("norm_before_fc", "norm_output", "norm_before_residual"):
        (folder / "config.json").write_text(json.dumps({**cfg, key: True}))
        with pytest.raises(PeerCheckpointError, match=key):
            read_peer(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    _rewrite(folder, lambda s: s.update({"t2d": torch.zeros_like(s["t2d"])}))
    with pytest.raises(PeerCheckpointError, match="t2d and d2t disagree"):
        read_peer(folder)
    mo = modelopt_export(pkg, tmp_path / "mo")
    mcfg = json.loads((mo / "config.json").read_text())
    mcfg["eagle_config"]["use_last_layernorm"] = False
    (mo / "config.json").write_text(json.dumps(mcfg))
    with pytest.raises(PeerCheckpointError, match="use_last_layernorm"):
        read_peer(mo)


def test_what_the_head_cannot_compute_is_refused_by_name_in_a_specforge_export(four_layers,
                                                                              tmp_path):
    _, _, pkg = four_layers
    folder = specforge_export(pkg, tmp_path / "sf")
    assert read_peer(folder).fuse_layers == [1, 2, 3]  # readable as written
    cfg = json.loads((folder / "config.json").read_text())
    for change, match in (({"fc_norm": True}, "fc_norm=true"),
                          ({"norm_output": False}, "norm_output=false"),
                          ({"norm_before_residual": True}, "norm_before_residual=true"),
                          ({"target_hidden_size": 2 * cfg["hidden_size"]}, "target_hidden_size"),
                          ({"num_hidden_layers": 2}, "num_hidden_layers=2")):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(PeerCheckpointError, match=match):
            read_peer(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    _rewrite(folder, lambda s: s.update({"fc.bias": torch.full((s["fc.weight"].shape[0],), .1)}))
    with pytest.raises(PeerCheckpointError, match="non-zero fc.bias"):
        read_peer(folder)


def test_a_specforge_export_without_layer_ids_takes_sglangs_default(four_layers, tmp_path):
    _, _, pkg = four_layers
    folder = specforge_export(pkg, tmp_path / "sf")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert peer_format(folder) == "specforge"
    assert read_peer(folder, num_target_layers=30).fuse_layers == [2, 15, 27]
    with pytest.raises(PeerCheckpointError, match="0 fused layer ids"):
        read_peer(folder)  # no target: no default


def test_a_checkpoint_of_another_target_is_refused(four_layers, tmp_path):
    target, _, pkg = four_layers
    folder = speculators_checkpoint(pkg, tmp_path / "sp", target.model)
    other = make_tiny_target(seed=5, layers=4)  # same shapes, another embedding
    with pytest.raises(PeerCheckpointError, match="embedding is not the target's"):
        peer_as_draft(folder, other)
    wide = make_tiny_target(layers=4, heads=8, kv=4)  # another head count
    with pytest.raises(PeerCheckpointError, match="num_attention_heads"):
        peer_as_draft(folder, wide)


def test_a_peer_checkpoint_is_never_written_back_as_ours(four_layers, tmp_path):
    from draftsmith.heads.signing import sign_folder
    from draftsmith.scripts.release import release

    target, _, pkg = four_layers
    folder = speculators_checkpoint(pkg, tmp_path / "sp", target.model)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(PeerCheckpointError, match="unsigned import.*does not sign"):
        sign_folder(folder)
    with pytest.raises(PeerCheckpointError, match="does not load as a package"):
        export_package(folder, "eagle3", tmp_path / "out")
    with pytest.raises(PeerCheckpointError, match="does not release"):
        release(folder, tmp_path / "rel")
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "rel").exists()


@pytest.mark.slow
def test_speculators_checkpoint_decodes_greedy_identically_through_decode(decode_setup,
                                                                         tmp_path):
    """bf16 weights as the trainer saves them, decoded by eval/decode.py draft=FOLDER: the
    outputs are plain decoding's in the same run and in a plain run."""
    loaded = decode_setup["loaded"]
    cfg, head = _head(loaded.model, fuse=(1, 0), vocab=60)
    pkg = save_package(tmp_path / "pkg", "eagle", head, cfg, loaded.identity)
    folder = speculators_checkpoint(pkg, tmp_path / "sp", loaded.model, dtype=torch.bfloat16)
    run = decode.run_overrides([f"draft={folder}", f"target_path={decode_setup['target']}",
                                f"prompts={decode_setup['questions']}", "max_new_tokens=12",
                                "limit=2", "temperature=0", "k=3", "suffix=false", "fallback=false",
                                "adaptive_k=false"])
    summary = run["summary"]
    assert summary["draft_kind"] == "eagle" and summary["lossless"] is True
    assert summary["matches_baseline"] == 1.0  # the share of prompts
    assert summary["target_forwards"] > 0 and summary["tokens_generated"] > 0
    plain = decode.run_overrides([f"target_path={decode_setup['target']}", "draft=none",
                                  f"prompts={decode_setup['questions']}", "max_new_tokens=12",
                                  "limit=2", "temperature=0", "baseline=false"])
    assert [s["output_ids"] for s in run["samples"]] == [s["output_ids"]
                                                          for s in plain["samples"]]
    shutil.rmtree(folder)
