"""Evaluation prompt sets."""
from __future__ import annotations

import json

import pytest
from conftest import MT_BENCH

from draftsmith.data.prompts import PromptSetError, load_prompts


def test_mt_bench_question_file():
    prompts = load_prompts(MT_BENCH)
    assert len(prompts) == 80
    assert all(len(p.turns) == 1 for p in prompts)
    two = load_prompts(MT_BENCH, all_turns=True)
    assert all(len(p.turns) == 2 for p in two)
    assert two[0].turns[0] == prompts[0].turns[0]
    first = json.loads(MT_BENCH.read_text().splitlines()[0])
    assert (two[0].id, two[0].category, two[0].turns) == (
        str(first["question_id"]), first["category"], first["turns"])
    assert len(load_prompts(str(MT_BENCH), limit=5)) == 5


def test_humaneval():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0"
    assert prompts[0].turns[0].lstrip().startswith(("from", "def", "import"))


def test_sharegpt_test_split_first_turns():
    from draftsmith.data.chat import split_of

    prompts = load_prompts("sharegpt", limit=20)
    assert len(prompts) == 20
    assert all(split_of(p.id, 0.02, 0.02) == "test" and len(p.turns) == 1 for p in prompts)


def test_errors(tmp_path):
    with pytest.raises(PromptSetError, match="unknown prompt set 'mtbench'"):
        load_prompts("mtbench")
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["a"]}\n{"id": 2}\n')
    with pytest.raises(PromptSetError, match="q.jsonl:2"):
        load_prompts(bad)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(PromptSetError, match="no questions"):
        load_prompts(tmp_path / "e.jsonl")


def test_a_question_without_turns_is_refused_naming_file_line_and_id(tmp_path):
    from draftsmith.data.prompts import check_prompt_set

    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 81, "turns": ["hi"]}\n\n'
                    '{"question_id": 82, "category": "x", "turns": []}\n')
    want = rf"{path}:3: question 82 has no turns \('turns': \[\]\); give it at least one"
    with pytest.raises(ValueError, match=want):
        load_prompts(path)
    with pytest.raises(ValueError, match=want):  # the CLIs' check before any model loads
        check_prompt_set(path)
    with pytest.raises(PromptSetError, match=r"unknown prompt set '.*/none\.jsonl': no such file"):
        check_prompt_set(tmp_path / "none.jsonl")
