"""target.chat_template: the tokenizer's own template, the plain completion format of base
models (assistant spans, generation prompt, regeneration), a custom Jinja template."""
from __future__ import annotations

import pytest
from conftest import make_char_tokenizer, make_tiny_target, tiny_llama
from transformers import AutoTokenizer

from draftsmith.data.chat import assistant_spans, tokenize_conversation
from draftsmith.data.chat_format import PLAIN_CHAT_TEMPLATE, PLAIN_STOP_STRINGS, apply_chat_format
from draftsmith.data.feature_data import FeatureDataset
from draftsmith.data.identity import tokenizer_sha256
from draftsmith.data.regenerate import (
    cut_reply,
    regenerate_conversations,
    stop_criteria,
    stop_strings,
)
from draftsmith.data.sharegpt import Conversation
from draftsmith.data.target import load_target

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": " And 3 plus 3? "},
        {"role": "assistant", "content": "6, of course.\n"}]


def base_tokenizer():
    tok = make_char_tokenizer()
    tok.chat_template = None  # a base model ships none
    return tok


def test_a_base_tokenizer_gets_the_plain_format(caplog):
    tok = base_tokenizer()
    with caplog.at_level("INFO", logger="draftsmith.data.chat_format"):
        assert apply_chat_format(tok, None, "base") == "plain"
    assert tok.chat_template == PLAIN_CHAT_TEMPLATE
    assert "plain completion format" in caplog.text and "no chat template" in caplog.text
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<s>Be brief.\n\nUser: What is 2 plus 2?\n\nAssistant: It is 4.<|im_end|>\n\n"
                    "User: And 3 plus 3?\n\nAssistant: 6, of course.<|im_end|>\n\n")
    prompt = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False)
    assert prompt == "<s>Be brief.\n\nUser: What is 2 plus 2?\n\nAssistant:"
    assert text.startswith(prompt)


def test_assistant_spans_of_the_plain_format_are_the_replies_and_eos():
    tok = base_tokenizer()
    apply_chat_format(tok)
    text, spans = assistant_spans(tok, CHAT)
    assert [text[s:e] for s, e in spans] == [" It is 4.<|im_end|>",
                                             " 6, of course.<|im_end|>"]
    ids, mask, _ = tokenize_conversation(tok, CHAT)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == " It is 4.<|im_end|> 6, of course.<|im_end|>"
    # a leading assistant turn (no prompt before it) is found by its trimmed content
    lead = [{"role": "assistant", "content": " Hello. "}, *CHAT[1:3]]
    text, spans = assistant_spans(tok, lead)
    assert [text[s:e] for s, e in spans] == ["Hello.<|im_end|>", " It is 4.<|im_end|>"]


def test_plain_forces_the_format_and_a_jinja_string_is_used_as_is():
    tok = make_char_tokenizer()
    assert apply_chat_format(tok, None) == "tokenizer"
    assert tok.chat_template == make_char_tokenizer().chat_template
    assert apply_chat_format(tok, "plain") == "plain" and tok.chat_template == PLAIN_CHAT_TEMPLATE
    custom = "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    assert apply_chat_format(tok, custom) == "custom"
    assert tok.apply_chat_template(CHAT[1:3], tokenize=False) == (
        "user> What is 2 plus 2?\nassistant> It is 4.\n")
    for bad in ("plian", "", 3):
        with pytest.raises(ValueError, match="target.chat_template=.* is not a chat format"):
            apply_chat_format(tok, bad)


def test_load_target_keeps_the_tokenizers_own_hash(tmp_path):
    tiny_llama(seed=2).save_pretrained(tmp_path)
    base_tokenizer().save_pretrained(tmp_path)
    own = tokenizer_sha256(AutoTokenizer.from_pretrained(tmp_path))
    t = load_target(tmp_path)
    assert t.chat_format == "plain" and t.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    assert t.identity.tokenizer_sha256 == own  # caches and packages made before still match
    forced = load_target(tmp_path, chat_template="{{ messages[0]['content'] }}")
    assert forced.chat_format == "custom" and forced.identity == t.identity
    with pytest.raises(ValueError, match="not a chat format"):
        load_target(tmp_path / "missing", chat_template="plian")  # refused before loading


def test_regeneration_works_in_the_plain_format(tmp_path):
    tok = base_tokenizer()
    apply_chat_format(tok)
    target = make_tiny_target(seed=5, vocab=len(tok))
    target.tokenizer = tok
    assert stop_strings(tok) == PLAIN_STOP_STRINGS and stop_criteria(tok) is not None
    chat = make_char_tokenizer()
    assert stop_strings(chat) == () and stop_criteria(chat) is None
    conv = Conversation(id="a", messages=CHAT[1:3])
    (got,) = regenerate_conversations([conv], target, tmp_path / "r.jsonl", temperature=1.0,
                                      max_new_tokens=8, progress=False)
    assert [m["role"] for m in got.messages] == ["user", "assistant"]
    assert got.messages[1]["content"] != "It is 4."
    assert not any(s.strip() in got.messages[1]["content"] for s in PLAIN_STOP_STRINGS)


def test_a_reply_is_cut_at_the_turn_the_model_invents():
    assert cut_reply(" Paris.\n\nUser: and Spain?\n\nAssistant: Madrid", PLAIN_STOP_STRINGS) \
        == "Paris."
    assert cut_reply(" Paris.\nAssistant: more", PLAIN_STOP_STRINGS) == "Paris."
    assert cut_reply(" Paris. User: stays ", ()) == "Paris. User: stays"


def test_a_chat_format_other_than_the_tokenizers_gets_its_own_feature_cache(tmp_path):
    """The identity hashes the tokenizer's own template only, so the cache key carries the
    format that made the token ids when it is another one."""
    from test_features import _chat_target_and_data

    from draftsmith.data.prepare import prepare_data

    target, cfg = _chat_target_and_data(tmp_path)
    cfg.num_conversations = 8
    cfg.split = {"val": 0.25, "test": 0.0}
    own, _, _ = prepare_data(cfg, target, tmp_path / "out")
    target.chat_format = apply_chat_format(target.tokenizer, "plain")
    plain, _, rep = prepare_data(cfg, target, tmp_path / "out")
    assert plain.parent != own.parent and "chat_template" in rep["config"]
    first = FeatureDataset(plain)[0]["input_ids"].tolist()
    assert target.tokenizer.decode(first).startswith("<s>User: question")
