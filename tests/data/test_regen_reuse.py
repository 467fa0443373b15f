"""data.regenerate.reuse: an earlier run's regenerated replies taken instead of generated again,
only from a folder made by the same target and settings, only for the same requests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_char_tokenizer, make_tiny_target
from omegaconf import OmegaConf

from draftsmith.data import regenerate
from draftsmith.data.prepare import prepare_data
from draftsmith.data.regen_reuse import PROVENANCE_FILE


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A tiny chat target, a data config over 40 two-turn conversations (sampled replies of at
    most 5 tokens, the first only), and the list of conversation ids each generated batch held."""
    tok = make_char_tokenizer()
    target = make_tiny_target(seed=3, vocab=len(tok))
    target.tokenizer = tok
    recs = [{"id": f"q{i}_0", "conversations": [
        {"from": "human", "value": f"ask {i}"}, {"from": "gpt", "value": "old reply"},
        {"from": "human", "value": "and then?"}, {"from": "gpt", "value": "old again"}]}
        for i in range(40)]
    (tmp_path / "sg.json").write_text(json.dumps(recs))
    cfg = OmegaConf.load(Path(__file__).parents[2] / "conf" / "data" / "sharegpt.yaml")
    cfg.path = str(tmp_path / "sg.json")
    cfg.split = {"val": 0.2, "test": 0.1}
    cfg.regenerate = {"enabled": True, "temperature": 1.0, "max_new_tokens": 5,
                      "batch_size": 64, "max_replies": 1}
    generated: list[str] = []
    real = regenerate._regenerate_batch
    monkeypatch.setattr(regenerate, "_regenerate_batch", lambda model, tk, convs, *a: (
        generated.extend(c.id for c in convs) or real(model, tk, convs, *a)))
    return target, cfg, generated


def _replies(root: Path) -> dict[str, list]:
    out = {}
    for split in ("train", "val"):
        for line in (root / f"regenerated-{split}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out[rec["id"]] = (split, rec["messages"])
    return out


def test_a_larger_run_takes_the_earlier_replies_and_generates_only_the_rest(tmp_path, setup):
    target, cfg, generated = setup
    cfg.num_conversations = 20
    train, _, first = prepare_data(cfg, target, tmp_path / "a")
    earlier = train.parent
    assert json.loads((earlier / PROVENANCE_FILE).read_text())["max_new_tokens"] == 5
    before = {p.name: p.read_bytes() for p in earlier.glob("regenerated-*.jsonl")}
    assert len(generated) == first["split"]["train"] + first["split"]["val"]

    generated.clear()
    cfg.num_conversations = 30
    cfg.regenerate.reuse = [str(earlier)]
    train, _, rep = prepare_data(cfg, target, tmp_path / "b")
    old, new = _replies(earlier), _replies(train.parent)
    assert set(old) < set(new)
    assert sorted(generated) == sorted(set(new) - set(old))  # only the ten new ones generated
    assert all(new[i] == old[i] for i in old)  # same split, same messages
    assert {p.name: p.read_bytes() for p in earlier.glob("regenerated-*.jsonl")} == before

    # the twin: the same run without reuse generates every conversation again
    generated.clear()
    cfg.regenerate.reuse = []
    train, _, twin = prepare_data(cfg, target, tmp_path / "c")
    assert twin["key"] == rep["key"]  # reuse is not part of the cache's name
    assert sorted(generated) == sorted(new)


def test_folders_of_other_settings_or_requests_are_refused(tmp_path, setup):
    target, cfg, _ = setup
    cfg.num_conversations = 10
    train, _, _ = prepare_data(cfg, target, tmp_path / "a")
    earlier = train.parent
    cfg.num_conversations = 12

    cfg.regenerate.max_new_tokens = 6
    cfg.regenerate.reuse = [str(earlier)]
    with pytest.raises(ValueError, match="max_new_tokens: 5 != 6"):
        prepare_data(cfg, target, tmp_path / "b")
    cfg.regenerate.max_new_tokens = 5
    other = make_tiny_target(seed=4, vocab=len(target.tokenizer))
    other.tokenizer = target.tokenizer
    with pytest.raises(ValueError, match="target.weights_sha256"):
        prepare_data(cfg, other, tmp_path / "b")

    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("regenerated-train.jsonl", "regenerated-val.jsonl"):
        (copy / name).write_bytes((earlier / name).read_bytes())
    cfg.regenerate.reuse = [str(copy)]
    with pytest.raises(ValueError, match=f"has no {PROVENANCE_FILE}"):
        prepare_data(cfg, target, tmp_path / "b")
    (copy / PROVENANCE_FILE).write_bytes((earlier / PROVENANCE_FILE).read_bytes())
    lines = (copy / "regenerated-train.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["messages"][0]["content"] = "another request"
    (copy / "regenerated-train.jsonl").write_text(
        "\n".join([json.dumps(rec)] + lines[1:]) + "\n" + '{"id": "q3')  # and half a line
    with pytest.raises(ValueError, match=f"conversation '{rec['id']}' in .*other requests"):
        prepare_data(cfg, target, tmp_path / "b")
    assert (copy / "regenerated-train.jsonl").read_text().endswith('{"id": "q3')  # only read

    for bad, msg in (([str(tmp_path / "nowhere")], "is not a folder"),
                     (str(earlier), "give a list of folders")):
        cfg.regenerate.reuse = bad
        with pytest.raises(ValueError, match=msg):
            prepare_data(cfg, target, tmp_path / "b")
    cfg.regenerate.reuse = [str(earlier)]
    cfg.regenerate.enabled = False
    with pytest.raises(ValueError, match="data.regenerate.enabled is false"):
        prepare_data(cfg, target, tmp_path / "b")
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").rglob("*.jsonl"))
