"""A causal LM sharing the target's vocabulary as a draft LM: off the shelf in the decoder (a
warning, no package), and refused when its vocabulary is another's."""
from __future__ import annotations

import json
import logging

import pytest
from conftest import make_char_tokenizer, tiny_llama

from draftsmith.eval import decode
from draftsmith.heads.foreign import is_model_source, model_as_draft, vocabulary_problems


@pytest.fixture
def sibling(tmp_path, decode_setup):
    """A smaller model of the tiny target's vocabulary in a plain transformers folder (no
    draftsmith.json: not a draft package)."""
    folder = tmp_path / "sibling"
    tiny_llama(seed=7, layers=1).save_pretrained(folder)
    tok = make_char_tokenizer()
    tok.chat_template = "{{ messages }}"  # another chat template: drafts see ids only
    tok.save_pretrained(folder)
    return folder


def test_a_sibling_model_drafts_off_the_shelf_losslessly(decode_setup, sibling, caplog):
    assert is_model_source(sibling) and is_model_source("pkg:qwen2p5_coder_0p5b")
    assert not is_model_source(decode_setup["lm"])  # a draft package
    with caplog.at_level(logging.WARNING):
        res = decode.run_overrides([f"draft={sibling}", f"target_path={decode_setup['target']}",
                                    f"prompts={decode_setup['questions']}", "limit=2",
                                    "max_new_tokens=12", "temperature=0", "k=3"])
    assert f"draft={sibling} is not a draft package" in caplog.text and "unsigned" in caplog.text
    summary = res["summary"]
    assert summary["draft_kind"] == "lm" and summary["matches_baseline"] == 1.0  # lossless
    assert summary["target_forwards"] < summary["tokens_generated"]  # drafts were accepted


def test_a_model_with_another_vocabulary_is_refused(tmp_path, decode_setup):
    other = tmp_path / "other"
    tiny_llama(seed=7, layers=1).save_pretrained(other)
    tok = make_char_tokenizer()
    vocab = json.loads(tok.backend_tokenizer.to_str())
    vocab["model"]["vocab"] = {t: (i + 1) % len(vocab["model"]["vocab"]) if i > 5 else i
                               for t, i in vocab["model"]["vocab"].items()}  # ids shuffled
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    shuffled = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(vocab)),
                                       pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                       unk_token="<unk>")
    shuffled.save_pretrained(other)
    assert vocabulary_problems(shuffled, decode_setup["loaded"].tokenizer)
    assert not vocabulary_problems(make_char_tokenizer(), decode_setup["loaded"].tokenizer)
    with pytest.raises(ValueError, match="cannot draft for the target.*vocabularies differ"):
        model_as_draft(other, decode_setup["loaded"])


def test_a_sibling_model_is_measured_into_a_file_never_into_its_folder(decode_setup, sibling,
                                                                       tmp_path):
    from draftsmith.eval import measure

    args = [f"draft={sibling}", f"target_path={decode_setup['target']}",
            f"prompts={decode_setup['questions']}", "limit=2", "max_new_tokens=8",
            "temperature=0", "k_measure=2", "repeats=2", "min_reached=1", "tree_sizes=[]"]
    before = sorted(p.name for p in sibling.iterdir())
    with pytest.raises(ValueError, match="not a draft package.*write=false out=FILE"):
        measure.run_overrides(args)  # write=true by default: there is no package to write into
    out = tmp_path / "sibling_speculation.json"
    rec = measure.run_overrides([*args, "write=false", f"out={out}"])
    assert json.loads(out.read_text())["k_star"] == rec["k_star"] and rec["draft_kind"] == "lm"
    assert sorted(p.name for p in sibling.iterdir()) == before  # nothing written there
