"""Chat tokenization with assistant masks, and the id-hashed split."""
from __future__ import annotations

import pytest
from conftest import make_char_tokenizer

from draftsmith.data.chat import (
    ChatTemplateError,
    assistant_spans,
    split_conversations,
    split_of,
    tokenize_conversation,
    tokenize_conversations,
)
from draftsmith.data.sharegpt import Conversation


def conv(cid: str, *pairs: tuple[str, str]) -> Conversation:
    return Conversation(id=cid, messages=[{"role": r, "content": c} for r, c in pairs])


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def _masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_assistant_mask_covers_replies_and_end_of_turn(tok):
    c = conv("a", ("user", "hi there"), ("assistant", "hello"), ("user", "and?"),
             ("assistant", "ok."))
    ids, mask, truncated = tokenize_conversation(tok, c.messages)
    assert not truncated
    assert ids == tok.apply_chat_template(c.messages, tokenize=True)["input_ids"]
    assert _masked_text(tok, ids, mask) == "hello<|im_end|>ok.<|im_end|>"
    assert sum(mask) == len("hello") + 1 + len("ok.") + 1


def test_leading_assistant_turn_and_system_message(tok):
    c = conv("b", ("system", "sys"), ("assistant", "first"), ("user", "q"), ("assistant", "ans"))
    ids, mask, _ = tokenize_conversation(tok, c.messages)
    assert _masked_text(tok, ids, mask) == "first<|im_end|>ans<|im_end|>"
    text, spans = assistant_spans(tok, conv("c", ("assistant", "solo")).messages)
    assert [text[s:e] for s, e in spans] == ["solo<|im_end|>"]


def test_content_equal_to_role_word_is_masked_at_the_right_place(tok):
    # the reply text also appears in the prompt; only the reply itself may be masked
    c = conv("d", ("user", "assistant"), ("assistant", "assistant"))
    ids, mask, _ = tokenize_conversation(tok, c.messages)
    first = mask.index(True)
    assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
    assert _masked_text(tok, ids, mask) == "assistant<|im_end|>"


def test_truncation_and_dropping_conversations_without_assistant_tokens(tok):
    long = conv("long", ("user", "x" * 40), ("assistant", "y" * 40))
    no_reply = conv("none", ("user", "only a question"))
    empty = conv("empty")  # what regeneration leaves when there is nothing to answer
    ds, report = tokenize_conversations([long, no_reply, empty], tok, max_length=90)
    assert report.conversations == 3 and report.kept == 1
    assert report.dropped["no_assistant_tokens"] == 1 and report.dropped["empty"] == 1
    assert report.truncated == 1
    assert len(ds[0]["input_ids"]) == 90 and ds[0]["id"] == "long"
    assert sum(ds[0]["loss_mask"]) == report.assistant_tokens > 0
    # truncated before the reply starts -> nothing to learn -> dropped
    ds2, rep2 = tokenize_conversations([long], tok, max_length=70)
    assert len(ds2) == 0 and rep2.dropped["no_assistant_tokens"] == 1


def test_missing_chat_template_is_a_clear_error(tok):
    bare = make_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_conversation(bare, conv("e", ("user", "a"), ("assistant", "b")).messages)


def test_split_is_deterministic_and_stable_when_records_are_appended():
    ids = [f"conv{i}_0" for i in range(3000)]
    first = {i: split_of(i, 0.1, 0.1) for i in ids}
    more = ids + [f"new{i}_0" for i in range(500)]
    convs = [conv(i, ("user", "q"), ("assistant", "a")) for i in more]
    grouped = split_conversations(convs, 0.1, 0.1)
    again = {c.id: s for s, cs in grouped.items() for c in cs}
    assert all(again[i] == first[i] for i in ids)
    frac = {s: sum(v == s for v in first.values()) / len(ids) for s in ("val", "test")}
    assert 0.07 < frac["val"] < 0.13 and 0.07 < frac["test"] < 0.13
    assert sum(len(v) for v in grouped.values()) == len(more)


def test_parts_of_one_sharegpt_chat_share_a_split():
    for i in range(200):
        assert len({split_of(f"abc{i}_{p}", 0.3, 0.3) for p in range(4)}) == 1


def test_bad_split_fractions():
    with pytest.raises(ValueError, match="val \\+ test < 1"):
        split_of("x", 0.6, 0.5)
