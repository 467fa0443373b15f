"""format=gguf for EAGLE-3 heads and DFlash drafters: llama.cpp's own converter (the vendored
``convert_hf_to_gguf.py``, in the ``llama_server`` environment) on tiny drafts, and the GGUF's
metadata read back: architecture, layer ids, the draft-to-target vocabulary map, block size,
mask id and the target's tokens. llama.cpp itself is not built here (``make engines`` runs it).

The tiny target has 8 layers and SmolLM2's tokenizer (the converter identifies a BPE
pre-tokenizer by its output, so a made-up vocabulary does not convert); the heads fuse layers
[1, 3, 6], where the converter's silent default would be [2, 4, 5].
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.scripts import export_gguf_convert as conv
from draftsmith.scripts.export import export_package
from draftsmith.scripts.export_formats import ExportError
from draftsmith.scripts.export_gguf import GGUF_FILE

FUSE = [1, 3, 6]  # the converter's default for 8 layers is [2, 4, 5]


def test_targets_whose_llama_cpp_graph_lacks_layer_inputs_are_refused_with_the_reason():
    why = conv.target_refusal({"model_type": "qwen2"})
    assert "qwen2" in why and "per-layer inputs" in why and "vLLM" in why
    assert conv.target_refusal({"model_type": "llama"}) is None  # the twin: SmolLM2's graph
    assert conv.target_refusal({"text_config": {"model_type": "qwen3"}}) is None


def test_the_converters_layer_ids_are_read_from_its_log():
    log = ("INFO:hf-to-gguf:EAGLE-3: target_layers = [2, 15, 27] (target model has 30 layers)\n"
           "INFO:hf-to-gguf:EAGLE-3: target_hidden_size = 576")
    assert conv.converter_layers(log) == [2, 15, 27]
    assert conv.converter_layers("INFO: no such line") is None


@pytest.fixture(scope="module")
def tiny_smollm_target(real_target, tmp_path_factory):
    """An 8-layer random Llama with SmolLM2's vocabulary and tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.data.target import load_target

    folder = tmp_path_factory.mktemp("tiny_smollm") / "target"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True, rope_theta=100000.0,
                      bos_token_id=1, eos_token_id=2)  # no padding row: mask id 2 is trained
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(Path(real_target.path) / name, folder / name)
    return load_target(folder)


def _eagle3_package(target, root: Path, vocab: int = 64) -> Path:
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.heads.package import save_package

    cfg = EagleConfig(layout="eagle3", fuse_layers=FUSE, draft_vocab_size=vocab, ttt_steps=2)
    counts = torch.arange(target.model.config.vocab_size, dtype=torch.float).flip(0)
    head = build_eagle(cfg, target.model, token_counts=counts).eval()
    return save_package(root / "eagle3", "eagle", head, cfg, target.identity)


def _dflash_package(target, root: Path) -> Path:
    from draftsmith.heads.family import get_family
    from draftsmith.heads.package import save_package

    family = get_family("dflash")
    cfg = family.head_config({"block_size": 4, "mask_token_id": 2, "fuse_layers": FUSE},
                             target.model.config)
    return save_package(root / "dflash", "dflash", family.build(cfg, target.model).eval(), cfg,
                        target.identity)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.engines("llama_server")
def test_an_eagle3_head_converts_with_its_layer_ids_and_vocabulary_map(tiny_smollm_target,
                                                                       tmp_path, monkeypatch):
    target = tiny_smollm_target
    pkg = _eagle3_package(target, tmp_path)
    out = export_package(pkg, "gguf", tmp_path / "gguf", target=target)
    got = conv.read_gguf(out / GGUF_FILE)
    assert got["arch"] == "eagle3" and got["target_layers"] == FUSE
    from draftsmith.heads.package import load_package

    head = load_package(pkg, target=target)
    assert got["d2t"] == [int(x) for x in head.module.d2t]  # absolute target ids
    assert len(got["tokens"]) == 49152 and got["tokens"][2] == "<|im_end|>"
    # the twin: without the top-level ids the converter silently writes its default, and the
    # export refuses it naming both
    original = conv.stage_eagle3

    def nested_only(p, dst, opts):
        ids = original(p, dst, opts)
        cfg = json.loads((dst / "config.json").read_text())
        del cfg["eagle_aux_hidden_state_layer_ids"]
        (dst / "config.json").write_text(json.dumps(cfg))
        return ids

    monkeypatch.setitem(conv.STAGERS, "eagle3", nested_only)
    with pytest.raises(ExportError, match=r"target layers \[2, 4, 5\].*trained on \[1, 3, 6\]"):
        export_package(pkg, "gguf", tmp_path / "twin", target=target)
    assert not (tmp_path / "twin").exists()


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.engines("llama_server")
def test_a_dflash_drafter_converts_in_z_labs_layout(tiny_smollm_target, tmp_path):
    target = tiny_smollm_target
    out = export_package(_dflash_package(target, tmp_path), "gguf", tmp_path / "gguf",
                         target=target)
    got = conv.read_gguf(out / GGUF_FILE)
    assert (got["arch"], got["target_layers"], got["block_size"], got["mask_token_id"]) == (
        "dflash", FUSE, 4, 2)
    assert got["d2t"] is None and len(got["tokens"]) == 49152


def test_the_metadata_check_names_each_difference(tmp_path):
    """gguf_problems against a GGUF written here with the gguf package: equal metadata passes,
    and each changed field is reported (the twin of the conversion checks above)."""
    import gguf
    import numpy as np

    path = tmp_path / "draft.gguf"
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_array("eagle3.target_layers", FUSE)
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("d2t", np.array([0, 2, 5], dtype=np.int64),
                 raw_dtype=gguf.GGMLQuantizationType.I64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = {"arch": "eagle3", "target_layers": FUSE, "d2t": [0, 2, 5], "tokens": ["a", "b", "c"]}
    assert conv.gguf_problems(path, want) == []
    wrong = {**want, "target_layers": [2, 4, 5], "d2t": [0, 2, 4], "tokens": ["a", "x", "c"]}
    problems = conv.gguf_problems(path, wrong)
    assert len(problems) == 3, problems
    assert any("target_layers: [1, 3, 6] in the GGUF" in p for p in problems)
    assert any("d2t" in p and "1 differ" in p for p in problems)
    assert any("first difference at id 1" in p for p in problems)


def test_a_head_for_a_qwen2_target_is_refused_before_converting(tmp_path, monkeypatch):
    """llama.cpp's qwen2 graph publishes no per-layer inputs: the export stops with that reason
    (nothing converted, nothing written) instead of a GGUF that aborts inside llama.cpp."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from draftsmith.data.identity import TargetIdentity
    from draftsmith.heads.eagle import build_eagle
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.heads.package import save_package

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2)).eval()
    ident = TargetIdentity(name="tiny-qwen2", weights_sha256="q2", tokenizer_sha256="q2-tok",
                           vocab_size=96, hidden_size=32, num_layers=4)
    cfg = EagleConfig(layout="eagle3", fuse_layers=[1, 2, 3])
    pkg = save_package(tmp_path / "pkg", "eagle", build_eagle(cfg, model).eval(), cfg, ident,
                       target_config=model.config)

    def never(*args, **kw):
        raise AssertionError("the converter ran for a qwen2 target")

    monkeypatch.setattr(conv, "run_converter", never)
    with pytest.raises(ExportError, match="qwen2 graph does not publish"):
        export_package(pkg, "gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
