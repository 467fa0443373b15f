"""Target-feature cache: contents, resume after a kill, idempotence, refusal to mix targets."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from draftsmith.data.cache_spec import FeatureCacheError
from draftsmith.data.feature_data import (
    FeatureDataset,
    collate_features,
    read_manifest,
    verify_cache,
)
from draftsmith.data.features import build_feature_cache
from draftsmith.data.identity import TargetMismatchError
from draftsmith.data.teacher import teacher_logits


def make_rows(n: int = 11, vocab: int = 96, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = 3 + (i * 7) % 17
        ids = torch.randint(3, vocab, (t,), generator=g).tolist()
        mask = [k >= t // 2 for k in range(t)]
        rows.append({"input_ids": ids, "loss_mask": mask})
    return rows


class Boom(RuntimeError):
    pass


def test_cache_holds_the_targets_final_hidden_states_and_layers(tmp_path, tiny_target):
    rows = make_rows()
    man = build_feature_cache(tiny_target, rows, tmp_path, layers=[0, 2], batch_size=4,
                              shard_size=4, progress=False)
    assert [s["sequences"] for s in man["shards"]] == [4, 4, 3]
    assert man["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert man["target"] == tiny_target.identity.to_dict() and man["layers"] == [0, 2]
    # layer 2 of the 2-layer target is the final hidden state: served by `hidden`, not stored twice
    assert man["bytes_per_token"] == 32 * 2 * 2 + 9
    verify_cache(tmp_path)
    ds = FeatureDataset(tmp_path, target=tiny_target.identity)
    assert len(ds) == len(rows)
    model = tiny_target.model
    for i in (0, 5, 10):
        item = ds[i]
        ids = torch.tensor([rows[i]["input_ids"]])
        with torch.no_grad():
            out = model.model(ids, output_hidden_states=True)
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert item["loss_mask"].tolist() == rows[i]["loss_mask"]
        assert item["hidden"].dtype == torch.float16
        torch.testing.assert_close(item["hidden"].float(), out.last_hidden_state[0],
                                   atol=2e-3, rtol=2e-3)
        assert item["layers"].shape == (2, len(rows[i]["input_ids"]), 32)
        torch.testing.assert_close(item["layers"][1].float(), out.hidden_states[2][0],
                                   atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(item["layers"][0].float(), out.hidden_states[0][0],
                                   atol=2e-3, rtol=2e-3)
        # the teacher's log-normaliser of the hidden state as stored (what training recomputes)
        w = model.get_output_embeddings().weight
        want = torch.logsumexp(teacher_logits(item["hidden"].float(), w), dim=-1)
        assert item["teacher_lse"].dtype == torch.float32
        torch.testing.assert_close(item["teacher_lse"], want, atol=1e-5, rtol=0)


def test_collate_pads_to_the_longest(tmp_path, tiny_target):
    rows = make_rows(5)
    build_feature_cache(tiny_target, rows, tmp_path, layers=[1], progress=False)
    ds = FeatureDataset(tmp_path)
    batch = collate_features([ds[0], ds[3]], pad_id=0)
    lens = [len(rows[0]["input_ids"]), len(rows[3]["input_ids"])]
    T = max(lens)
    assert batch["input_ids"].shape == (2, T) and batch["hidden"].shape == (2, T, 32)
    assert batch["layers"].shape == (2, 1, T, 32)
    assert batch["attention_mask"].sum(1).tolist() == lens
    short = lens.index(min(lens))
    assert not batch["loss_mask"][short, min(lens):].any()
    assert (batch["hidden"][short, min(lens):] == 0).all()
    assert batch["teacher_lse"].shape == (2, T)
    assert torch.equal(batch["teacher_lse"][short, :min(lens)], ds[3 * short]["teacher_lse"])


def test_killed_run_resumes_at_the_next_missing_shard(tmp_path, tiny_target):
    rows = make_rows(10)
    done = []

    def kill_after_second(k):
        done.append(k)
        if len(done) == 2:
            raise Boom

    with pytest.raises(Boom):
        build_feature_cache(tiny_target, rows, tmp_path / "c", shard_size=3, progress=False,
                            on_shard=kill_after_second)
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert not list((tmp_path / "c").glob("*.tmp-*"))
    resumed = []
    man = build_feature_cache(tiny_target, rows, tmp_path / "c", shard_size=3, progress=False,
                              on_shard=resumed.append)
    assert done == [0, 1] and resumed == [2, 3]
    clean = build_feature_cache(tiny_target, rows, tmp_path / "clean", shard_size=3,
                                progress=False)
    assert [s["sha256"] for s in man["shards"]] == [s["sha256"] for s in clean["shards"]]


def test_rerun_with_same_inputs_does_nothing(tmp_path, tiny_target):
    rows = make_rows(6)
    build_feature_cache(tiny_target, rows, tmp_path, shard_size=2, progress=False)
    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    calls = []
    build_feature_cache(tiny_target, rows, tmp_path, shard_size=2, progress=False,
                        on_shard=calls.append)
    assert calls == []
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == mtimes


def test_refuses_to_mix_targets_or_inputs(tmp_path, tiny_target):
    rows = make_rows(4)
    build_feature_cache(tiny_target, rows, tmp_path, progress=False)
    other = make_tiny_target(seed=1)
    msg = "weights_sha256: 'tiny-0-weights' != 'tiny-1-weights'"
    with pytest.raises(TargetMismatchError, match=msg):
        build_feature_cache(other, rows, tmp_path, progress=False)
    with pytest.raises(TargetMismatchError, match="weights_sha256"):
        FeatureDataset(tmp_path, target=other.identity)
    with pytest.raises(FeatureCacheError, match="inputs_sha256"):
        build_feature_cache(tiny_target, make_rows(4, seed=1), tmp_path, progress=False)
    with pytest.raises(FeatureCacheError, match="layers"):
        build_feature_cache(tiny_target, rows, tmp_path, layers=[1], progress=False)


def test_tampered_shard_and_incomplete_cache_are_detected(tmp_path, tiny_target):
    build_feature_cache(tiny_target, make_rows(4), tmp_path, shard_size=2, progress=False)
    shard = tmp_path / read_manifest(tmp_path)["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(FeatureCacheError, match="shard-00001"):
        verify_cache(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(FeatureCacheError, match="no manifest.json"):
        FeatureDataset(tmp_path)


def test_bad_arguments(tmp_path, tiny_target):
    with pytest.raises(ValueError, match="out of range 0..2"):
        build_feature_cache(tiny_target, make_rows(2), tmp_path, layers=[3])
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_feature_cache(tiny_target, make_rows(2), tmp_path, dtype="float32")


def test_teacher_logits_match_the_lm_head(tiny_target):
    model = tiny_target.model
    ids = torch.tensor([make_rows(1)[0]["input_ids"]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    got = teacher_logits(out.hidden_states[-1], model.lm_head.weight)
    torch.testing.assert_close(got, out.logits, atol=1e-5, rtol=1e-5)
    hot = teacher_logits(out.hidden_states[-1], model.lm_head.weight, temperature=2.0)
    torch.testing.assert_close(hot, out.logits / 2, atol=1e-5, rtol=1e-5)


def test_the_final_layer_is_served_by_the_final_hidden_state(tmp_path, tiny_target):
    """An EAGLE-3 head fusing the last hidden-state id reads `hidden` there: the shard holds no
    second copy, the dataset returns it bitwise, and the estimate matches the shard sizes."""
    from safetensors import safe_open

    rows = make_rows(6)
    man = build_feature_cache(tiny_target, rows, tmp_path / "a", layers=[1, 2], progress=False)
    with safe_open(str(tmp_path / "a" / man["shards"][0]["file"]), framework="pt") as f:
        assert sorted(f.keys()) == ["hidden", "input_ids", "layer_1", "loss_mask", "offsets",
                                    "teacher_lse"]
    ds = FeatureDataset(tmp_path / "a")
    for i in range(len(ds)):
        item = ds[i]
        assert torch.equal(item["layers"][1], item["hidden"])
    with_final = build_feature_cache(tiny_target, rows, tmp_path / "b", layers=[1], progress=False)
    assert man["bytes_per_token"] == with_final["bytes_per_token"] == 32 * 2 * 2 + 9
    size = sum((tmp_path / "a" / s["file"]).stat().st_size for s in man["shards"])
    assert abs(size - man["tokens"] * man["bytes_per_token"]) < 0.05 * size + 4096


def _tv(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Total-variation distance per row between softmax(p) and softmax(q)."""
    return 0.5 * (p_logits.softmax(-1) - q_logits.softmax(-1)).abs().sum(-1)


@pytest.mark.real
def test_fp16_cache_reproduces_the_real_target_distribution(tmp_path, real_target):
    from draftsmith.data.chat import tokenize_conversations
    from draftsmith.data.sharegpt import read_sharegpt

    convs, _ = read_sharegpt(limit=4)
    ds, _ = tokenize_conversations(convs, real_target.tokenizer, max_length=96)
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in ds]
    build_feature_cache(real_target, rows, tmp_path, batch_size=2, shard_size=2, progress=False)
    cache = FeatureDataset(tmp_path, target=real_target.identity)
    model = real_target.model
    tvs, shifted = [], []
    for i in range(len(cache)):
        item = cache[i]
        with torch.no_grad():
            logits = model(item["input_ids"][None]).logits[0]  # (T, V)
        teacher = teacher_logits(item["hidden"], model.lm_head.weight)
        tvs.append(_tv(teacher, logits))
        shifted.append(_tv(teacher[1:], logits[:-1]))  # twin: off-by-one hidden states
    tv, tv_shift = torch.cat(tvs), torch.cat(shifted)
    print(f"max TV fp16 cache vs target: {tv.max():.2e} over {tv.numel()} tokens; "
          f"off-by-one twin median {tv_shift.median():.3f}")
    assert tv.max() < 1e-2, f"max TV {tv.max():.3e}"
    assert tv_shift.median() > 1e-2  # the check detects a broken cache


def test_manifest_is_json_with_per_shard_sha(tmp_path, tiny_target):
    build_feature_cache(tiny_target, make_rows(3), tmp_path, shard_size=2, progress=False)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert [len(s["sha256"]) for s in m["shards"]] == [64, 64]
    assert m["dtype"] == "float16" and m["sequences"] == 3


def _chat_target_and_data(tmp_path):
    """A tiny target with a chat tokenizer and the data config over a small ShareGPT file."""
    from conftest import make_char_tokenizer
    from omegaconf import OmegaConf

    tok = make_char_tokenizer()
    target = make_tiny_target(vocab=len(tok))
    target.tokenizer = tok
    cfg = OmegaConf.load(Path(__file__).parents[2] / "conf" / "data" / "sharegpt.yaml")
    cfg.path = str(_sharegpt_file(tmp_path / "sg.json"))
    return target, cfg


def _sharegpt_file(path, n=30):
    recs = [{"id": f"p{i}_0", "conversations": [
        {"from": "human", "value": f"question {i}?"},
        {"from": "gpt", "value": f"answer {i}, fine."}]} for i in range(n)]
    path.write_text(json.dumps(recs))
    return path


def test_prepare_data_builds_then_reuses_caches(tmp_path):
    from draftsmith.data.prepare import prepare_data

    target, cfg = _chat_target_and_data(tmp_path)
    cfg.num_conversations = 25
    cfg.split = {"val": 0.2, "test": 0.2}
    cfg.cache.shard_size = 4
    train, val, rep = prepare_data(cfg, target, tmp_path / "out", layers=[1])
    assert rep["read"]["kept"] == 25 and sum(rep["split"].values()) == 25
    assert rep["split"]["val"] > 0 and rep["split"]["test"] > 0
    tr, va = FeatureDataset(train, target.identity), FeatureDataset(val, target.identity)
    assert len(tr) == rep["split"]["train"] and len(va) == rep["split"]["val"]
    assert tr.layers == [1]
    stamp = (train / "manifest.json").stat().st_mtime_ns
    again = prepare_data(cfg, target, tmp_path / "out", layers=[1], is_main=False)
    assert again[:2] == (train, val) and (train / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(FeatureCacheError, match="main process"):
        prepare_data(cfg, target, tmp_path / "other", is_main=False)
    target.model.to(torch.bfloat16)  # same identity, other dtype: not the same teacher
    with pytest.raises(FeatureCacheError, match="main process"):
        prepare_data(cfg, target, tmp_path / "out", layers=[1], is_main=False)
    target.model.to(torch.float32)
    cfg.max_lenght = 5
    with pytest.raises(ValueError, match="unknown data config keys \\['max_lenght'\\]"):
        prepare_data(cfg, target, tmp_path / "out")


def test_prepare_data_regenerates_every_split_in_shared_batches(tmp_path, monkeypatch):
    """data.regenerate: train and val replies come from one regeneration run (a small val split
    does not pay a generation of its own), each split's replies in its own file, and the caches
    hold the regenerated conversations."""
    from draftsmith.data import regenerate
    from draftsmith.data.chat import tokenize_conversations
    from draftsmith.data.prepare import prepare_data
    from draftsmith.data.sharegpt import Conversation

    target, cfg = _chat_target_and_data(tmp_path)
    cfg.num_conversations = 12
    cfg.split = {"val": 0.25, "test": 0.1}
    # sampled: the tiny model's greedy replies are blank lines, which leave no assistant tokens
    cfg.regenerate = {"enabled": True, "temperature": 1.0, "max_new_tokens": 6, "batch_size": 64,
                      "max_replies": 1}
    batches = []
    real = regenerate._regenerate_batch
    monkeypatch.setattr(regenerate, "_regenerate_batch",
                        lambda model, tk, convs, *a: batches.append(len(convs)) or
                        real(model, tk, convs, *a))
    train, val, rep = prepare_data(cfg, target, tmp_path / "out")
    assert batches == [rep["split"]["train"] + rep["split"]["val"]]  # one batch, both splits
    root = train.parent
    for split, cache in (("train", train), ("val", val)):
        lines = (root / f"regenerated-{split}.jsonl").read_text().splitlines()
        convs = [Conversation(**json.loads(x)) for x in lines]
        assert len(convs) == rep["split"][split]
        ds, _ = tokenize_conversations(convs, target.tokenizer, cfg.max_length)
        cached = {tuple(x["input_ids"].tolist()) for x in FeatureDataset(cache, target.identity)}
        assert cached == {tuple(r["input_ids"]) for r in ds}


def _long_rows(n: int, length: int, vocab: int = 96) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
             "loss_mask": [True] * length} for _ in range(n)]


def test_skip_conversations_reads_the_ones_after(tmp_path):
    """skip=10, n=15 trains on exactly the conversations 10..24 that n=25 adds to n=10 (the split
    is by id, so each keeps its split); ignoring the skip would re-read 0..14."""
    from draftsmith.data.prepare import prepare_data

    target, cfg = _chat_target_and_data(tmp_path)
    cfg.split = {"val": 0.2, "test": 0.2}

    def train_seqs(skip, n):
        cfg.skip_conversations, cfg.num_conversations = skip, n
        train, _, rep = prepare_data(cfg, target, tmp_path / "out")
        assert rep["read"]["kept"] == skip + n
        return {tuple(x["input_ids"].tolist()) for x in FeatureDataset(train, target.identity)}

    first, later, both = train_seqs(0, 10), train_seqs(10, 15), train_seqs(0, 25)
    assert later and not first & later and first | later == both
    for bad in (-1, 2.5, True):
        cfg.skip_conversations = bad
        with pytest.raises(ValueError, match="data.skip_conversations"):
            prepare_data(cfg, target, tmp_path / "out")


def test_select_keeps_a_task_type_and_counts_within_it(tmp_path):
    """data.select keeps the conversations whose first user message matches include and not
    exclude, and skip / num count within that subset: skip 2 / n 3 of the even-numbered
    conversations reads exactly 4, 6, 8, 14, 16 (10 and 12 excluded); filtering after the count
    (conversations 2-6, then the even ones) would give 2, 4, 6 and fail."""
    from draftsmith.data.prepare import prepare_data

    target, cfg = _chat_target_and_data(tmp_path)
    cfg.split = {"val": 0.5, "test": 0.0}
    cfg.num_conversations = 40  # more than the file has: a selection reads all of it anyway
    cfg.select.include = r"question (\d*[02468])\?"
    cfg.select.exclude = r"question 1[02]\?"  # drops 10 and 12 of the even ones
    _, _, rep = prepare_data(cfg, target, tmp_path / "out")
    assert rep["read"]["kept"] == 30 and rep["selected"] == 13  # 15 even, less 10 and 12
    cfg.skip_conversations, cfg.num_conversations = 2, 5
    train, val, rep = prepare_data(cfg, target, tmp_path / "out")
    seqs = [FeatureDataset(d, target.identity) for d in (train, val)]
    texts = {target.tokenizer.decode(x["input_ids"].tolist()) for ds in seqs for x in ds}
    assert sum(rep["split"].values()) == 5
    got = {int(q) for t in texts for q in re.findall(r"question (\d+)\?", t)}
    assert got == {4, 6, 8, 14, 16}
    cfg.select.include = "question ("  # a bad pattern is refused, naming the option
    with pytest.raises(ValueError, match="data.select.include"):
        prepare_data(cfg, target, tmp_path / "out")


@pytest.mark.parametrize("start", [1, 2, 3])
def test_the_final_hidden_state_is_recomputed_from_a_cached_layer(start):
    """final_from_layer(hidden_states[L]) is the model's own final-norm output for every L, on
    right-padded rows (padding after a row's tokens does not reach them); starting one layer
    late (hidden_states[L] fed to layers L+1..) gives other numbers."""
    from draftsmith.data.final_layer import final_from_layer

    model = make_tiny_target(layers=4).model.float()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0  # the second row is 6 tokens, right-padded
    out = model.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    got = final_from_layer(model, out.hidden_states[start], start)
    want = out.last_hidden_state
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert torch.allclose(got[1, :6], want[1, :6], atol=1e-5)
    late = final_from_layer(model, out.hidden_states[start], start + 1)  # the twin
    assert not torch.allclose(late[0], want[0], atol=1e-3)


def test_a_cache_without_the_final_hidden_state_recomputes_it_per_batch(tmp_path):
    """build_feature_cache(final_from=L) stores no ``hidden`` (one H-wide row less per token) and
    RecomputedFinal's batches carry the final hidden states and teacher the stored cache has
    (within the cache dtype's rounding of layer L); a final_from that is not a stored layer
    below the last is refused."""
    from draftsmith.data.feature_data import RecomputedFinal, open_features

    target = make_tiny_target(layers=3)
    rows = _long_rows(5, 20)
    full = build_feature_cache(target, rows, tmp_path / "full", layers=[1, 2], progress=False)
    part = build_feature_cache(target, rows, tmp_path / "part", layers=[1, 2], progress=False,
                               final_from=2)
    assert full["bytes_per_token"] - part["bytes_per_token"] == 32 * 2
    from safetensors import safe_open

    with safe_open(str(tmp_path / "part" / part["shards"][0]["file"]), "pt") as f:
        assert "hidden" not in set(f.keys()) and "layer_2" in set(f.keys())
    a = open_features(tmp_path / "full")
    b = open_features(tmp_path / "part", target.model)
    assert isinstance(b, RecomputedFinal) and len(a) == len(b) == 5
    with pytest.raises(FeatureCacheError, match="need the target model"):
        open_features(tmp_path / "part")
    ba, bb = collate_features([a[i] for i in range(5)]), b.collate([b[i] for i in range(5)])
    assert set(ba) == set(bb) and torch.equal(ba["teacher_lse"], bb["teacher_lse"])
    m = ba["loss_mask"]
    assert torch.allclose(bb["hidden"][m].float(), ba["hidden"][m].float(), atol=2e-2, rtol=1e-2)
    w = target.model.lm_head.weight
    pa, pb = (teacher_logits(x["hidden"][m], w).softmax(-1) for x in (ba, bb))
    assert float(0.5 * (pa - pb).abs().sum(-1).max()) < 1e-2  # the cache's teacher bound
    for bad in (3, 0):  # the final layer itself; a layer not stored
        with pytest.raises(ValueError, match="final_from"):
            build_feature_cache(target, rows, tmp_path / f"bad{bad}", layers=[1, 2],
                                progress=False, final_from=bad)


def test_the_storage_estimate_is_within_one_percent_of_the_cache_it_builds(tmp_path, tiny_target,
                                                                          caplog):
    import logging

    rows = _long_rows(24, 300)
    with caplog.at_level(logging.INFO, logger="draftsmith.data.cache_spec"):
        man = build_feature_cache(tiny_target, rows, tmp_path / "c", layers=[1], shard_size=8,
                                  progress=False)
    line = next(r.getMessage() for r in caplog.records if "bytes per token" in r.getMessage())
    estimate = man["tokens"] * man["bytes_per_token"]
    assert f"7,200 tokens x {man['bytes_per_token']} bytes per token" in line
    assert f"{estimate / 1e9:.2f} GB" in line
    size = sum((tmp_path / "c" / s["file"]).stat().st_size for s in man["shards"])
    assert abs(size - estimate) <= 0.01 * size, (size, estimate)


def test_a_cache_larger_than_the_free_disk_is_refused_before_any_shard(tmp_path, tiny_target,
                                                                      monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(FeatureCacheError, match=r"needs 0\.00 GB more but its disk has 0\.00 GB "
                                                r"free: .*data\.cache\.dir"):
        build_feature_cache(tiny_target, _long_rows(4, 50), tmp_path / "c", progress=False)
    assert not list((tmp_path / "c").glob("shard-*"))


def test_caching_hands_freed_heap_pages_back_after_every_batch(tmp_path, tiny_target,
                                                              monkeypatch):
    """Each batch's (n, V) log-normaliser temporaries grow with the sorted lengths; under the
    tuned allocator they fragmented the heap until the kernel killed a Qwen 1.5B cache at 24 GB.
    The valve (data/malloc.py) is asked after every batch, so memory over its limit goes back."""
    from draftsmith.data import features

    calls = []
    monkeypatch.setattr(features, "trim_freed_memory", lambda: calls.append(1) or False)
    build_feature_cache(tiny_target, make_rows(10), tmp_path, batch_size=4, shard_size=6,
                        progress=False)
    assert len(calls) == 2 + 1  # shards of 6 and 4 rows: batches of 4 + 2, then 4
