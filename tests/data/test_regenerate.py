"""Regeneration of assistant turns by the target: content, resume after a kill."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_target

from draftsmith.data.regenerate import regenerate_conversations, regenerate_splits
from draftsmith.data.sharegpt import Conversation


class Boom(RuntimeError):
    pass


@pytest.fixture(scope="module")
def target():
    tok = make_char_tokenizer()
    t = make_tiny_target(seed=5, vocab=len(tok))
    t.tokenizer = tok
    return t


def convs(n: int) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": "old answer"}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "more"},
                     {"role": "assistant", "content": "old again"}]
        out.append(Conversation(id=f"c{i}", messages=msgs))
    return out


def test_greedy_regeneration_is_the_targets_reply(tmp_path, target):
    (c,) = convs(1)
    (got,) = regenerate_conversations([c], target, tmp_path / "r.jsonl", max_new_tokens=6,
                                      progress=False)
    assert [m["role"] for m in got.messages] == ["user", "assistant", "user", "assistant"]
    assert got.messages[0] == c.messages[0] and got.messages[2] == c.messages[2]
    tok = target.tokenizer
    ids = tok.apply_chat_template(c.messages[:1], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = target.model.generate(ids, max_new_tokens=6, do_sample=False,
                                    pad_token_id=0, eos_token_id=tok.eos_token_id)
    expect = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert got.messages[1]["content"] == expect != "old answer"


def test_killed_run_loses_and_duplicates_nothing(tmp_path, target):
    data = convs(7)
    out = tmp_path / "r.jsonl"
    seen = []

    def kill(n_done):
        seen.append(n_done)
        if n_done >= 4:
            raise Boom

    with pytest.raises(Boom):
        regenerate_conversations(data, target, out, temperature=0.8, max_new_tokens=4,
                                 batch_size=2, progress=False, on_batch=kill)
    with open(out, "a") as f:  # killed in the middle of writing the next line
        f.write('{"id": "c4", "messa')
    calls = []
    result = regenerate_conversations(data, target, out, temperature=0.8, max_new_tokens=4,
                                      batch_size=2, progress=False, on_batch=calls.append)
    assert seen == [2, 4] and calls == [6, 7]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == sorted(c.id for c in data)
    assert [c.id for c in result] == [c.id for c in data]
    fresh = regenerate_conversations(data, target, tmp_path / "fresh.jsonl", temperature=0.8,
                                     max_new_tokens=4, batch_size=2, progress=False)
    assert [c.messages for c in result] == [c.messages for c in fresh]  # seeded per batch


def test_resume_reads_replies_with_unicode_line_breaks(tmp_path, target):
    # json.dumps(ensure_ascii=False) keeps U+2028 / U+0085 / form feeds raw inside a record;
    # reading the file back must split records at "\n" only
    out = tmp_path / "r.jsonl"
    odd = Conversation(id="odd", messages=[{"role": "user", "content": "a\u2028b\x85c\x0cd"},
                                           {"role": "assistant", "content": "e\u2029f"}])
    out.write_text(json.dumps({"id": "odd", "messages": odd.messages}, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    (got,) = regenerate_conversations([odd], target, out, max_new_tokens=2, progress=False)
    assert got.messages == odd.messages  # read back whole, not regenerated


def test_leading_reply_is_dropped_and_long_prompts_stop(tmp_path, target):
    c = Conversation(id="x", messages=[{"role": "assistant", "content": "hello"},
                                       {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "old"}])
    (got,) = regenerate_conversations([c], target, tmp_path / "a.jsonl", max_new_tokens=3,
                                      progress=False)
    assert [m["role"] for m in got.messages] == ["user", "assistant"]
    (short,) = regenerate_conversations([c], target, tmp_path / "b.jsonl", max_new_tokens=3,
                                        max_prompt_tokens=5, progress=False)
    assert [m["role"] for m in short.messages] == ["user"]


def test_bad_arguments(tmp_path, target):
    with pytest.raises(ValueError, match="temperature >= 0"):
        regenerate_conversations(convs(1), target, tmp_path / "r.jsonl", temperature=-1)
    with pytest.raises(ValueError, match="unique"):
        regenerate_conversations(convs(1) * 2, target, tmp_path / "r.jsonl")


def test_max_replies_ends_the_conversation_after_that_many_replies(tmp_path, target):
    (c,) = convs(1)  # user, assistant, user, assistant
    (one,) = regenerate_conversations([c], target, tmp_path / "a.jsonl", max_new_tokens=3,
                                      max_replies=1, progress=False)
    assert [m["role"] for m in one.messages] == ["user", "assistant"]
    (full,) = regenerate_conversations([c], target, tmp_path / "b.jsonl", max_new_tokens=3,
                                       progress=False)
    assert [m["role"] for m in full.messages] == ["user", "assistant"] * 2
    assert full.messages[:2] == one.messages  # the first reply is the same either way
    with pytest.raises(ValueError, match="max_replies"):
        regenerate_conversations([c], target, tmp_path / "c.jsonl", max_replies=0)


def test_batches_are_length_bucketed_and_resume_in_the_same_order(tmp_path, target):
    """Conversations are generated in order of their first prompt's token length (batches of
    similar lengths), the prompt regeneration really answers: a leading assistant turn is not
    part of it (A7 sorts by its 7-character prompt, not as an empty one); the results come back
    in input order."""
    cs = [Conversation(id=f"L{n}", messages=[{"role": "user", "content": "x" * n},
                                             {"role": "assistant", "content": "old"}])
          for n in (9, 1, 5, 3)]
    cs.append(Conversation(id="A7", messages=[{"role": "assistant", "content": "hello"},
                                              {"role": "user", "content": "x" * 7},
                                              {"role": "assistant", "content": "old"}]))
    path = tmp_path / "r.jsonl"
    got = regenerate_conversations(cs, target, path, max_new_tokens=2, batch_size=2,
                                   progress=False)
    assert [c.id for c in got] == ["L9", "L1", "L5", "L3", "A7"]
    written = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert written == ["L1", "L3", "L5", "A7", "L9"]


def test_a_padded_batch_gives_each_conversation_its_own_greedy_reply(tmp_path, target):
    """Batched regeneration (left padding, preallocated cache, native grouped-query attention)
    gives every conversation the reply plain ``generate`` gives it alone."""
    cs = [Conversation(id=f"P{n}", messages=[{"role": "user", "content": "ab" * n},
                                             {"role": "assistant", "content": "old"}])
          for n in (1, 7, 3, 12, 5)]
    got = regenerate_conversations(cs, target, tmp_path / "r.jsonl", max_new_tokens=8,
                                   batch_size=8, progress=False)
    tok = target.tokenizer
    for c, g in zip(cs, got):
        ids = tok.apply_chat_template(c.messages[:1], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            ref = target.model.generate(ids, max_new_tokens=8, do_sample=False,
                                        pad_token_id=0, eos_token_id=tok.eos_token_id)
        assert g.messages[1]["content"] == tok.decode(ref[0, ids.shape[1]:],
                                                      skip_special_tokens=True).strip()


def test_splits_share_batches_and_keep_their_own_files(tmp_path, target):
    """A small split rides in the big split's batches (one generation, not one per split), each
    conversation lands in its own split's file, the replies are those of regenerating each split
    alone, and a killed run resumes across the splits without loss or duplicates."""
    data = convs(5)
    splits = {"train": (data[:4], tmp_path / "train.jsonl"),
              "val": (data[4:], tmp_path / "val.jsonl")}
    batches = []
    got = regenerate_splits(splits, target, max_new_tokens=4, batch_size=5, progress=False,
                            on_batch=batches.append)
    assert batches == [5]  # one batch for both splits
    for name, (part, path) in splits.items():
        assert [c.id for c in got[name]] == [c.id for c in part]
        assert sorted(json.loads(x)["id"] for x in path.read_text().splitlines()) == \
            sorted(c.id for c in part)
        alone = regenerate_conversations(part, target, tmp_path / f"{name}-alone.jsonl",
                                         max_new_tokens=4, batch_size=5, progress=False)
        assert [c.messages for c in got[name]] == [c.messages for c in alone]

    def kill(n_done):
        if n_done >= 2:
            raise Boom

    resumed = {name: (part, tmp_path / f"r-{name}.jsonl") for name, (part, _) in splits.items()}
    with pytest.raises(Boom):
        regenerate_splits(resumed, target, max_new_tokens=4, batch_size=2, progress=False,
                          on_batch=kill)
    again = regenerate_splits(resumed, target, max_new_tokens=4, batch_size=2, progress=False)
    assert {n: [c.messages for c in v] for n, v in again.items()} == \
        {n: [c.messages for c in v] for n, v in got.items()}
    for name, (part, path) in resumed.items():
        assert sorted(json.loads(x)["id"] for x in path.read_text().splitlines()) == \
            sorted(c.id for c in part)
    with pytest.raises(ValueError, match="unique"):
        regenerate_splits({"a": (data[:2], tmp_path / "a.jsonl"),
                           "b": (data[1:3], tmp_path / "b.jsonl")}, target, progress=False)
    with pytest.raises(ValueError, match="own output file"):
        regenerate_splits({"a": (data[:2], tmp_path / "a.jsonl"),
                           "b": (data[2:3], tmp_path / "a.jsonl")}, target, progress=False)
