"""Feature-cache dtype ``auto``: float16 unless the target's hidden states overflow it (probed on
the first batch before any shard), recorded in the spec, reused and resumed as chosen."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target

from draftsmith.data import features
from draftsmith.data.cache_spec import FeatureCacheError
from draftsmith.data.feature_data import FeatureDataset
from draftsmith.data.features import build_feature_cache, probe_cache_dtype


def rows(n: int = 6, vocab: int = 96) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        t = 4 + i
        out.append({"input_ids": torch.randint(3, vocab, (t,), generator=g).tolist(),
                    "loss_mask": [True] * t})
    return out


def loud_target():
    """A tiny target whose final hidden states reach about 1e6: past float16's 65,504."""
    t = make_tiny_target(seed=1)
    with torch.no_grad():
        t.model.model.norm.weight.fill_(1e6)
    return t


class Boom(RuntimeError):
    pass


def test_probe_picks_float16_for_small_and_bfloat16_for_large_hidden_states():
    quiet, loud = make_tiny_target(), loud_target()
    dtype, peak = probe_cache_dtype(quiet.model, rows(), [1])
    assert dtype == "float16" and 0 < peak < 100
    dtype, peak = probe_cache_dtype(loud.model, rows(), [1])
    assert dtype == "bfloat16" and peak > torch.finfo(torch.float16).max


def test_probe_keeps_headroom_below_the_float16_range():
    t = make_tiny_target(seed=1)
    _, peak = probe_cache_dtype(t.model, rows(), [])
    scale = 0.75 * torch.finfo(torch.float16).max / peak  # fits float16, but with no headroom
    with torch.no_grad():
        t.model.model.norm.weight.mul_(scale)
    assert probe_cache_dtype(t.model, rows(), [])[0] == "bfloat16"


def test_auto_caches_bfloat16_where_float16_overflows(tmp_path, caplog):
    target = loud_target()
    with pytest.raises(FeatureCacheError, match="'hidden' overflows torch.float16"):
        build_feature_cache(target, rows(), tmp_path / "fp16", dtype="float16", progress=False)
    with caplog.at_level("INFO", logger="draftsmith.data.cache_spec"):
        man = build_feature_cache(target, rows(), tmp_path / "auto", dtype="auto",
                                  shard_size=4, progress=False)
    assert "feature cache dtype auto: bfloat16" in caplog.text
    assert man["dtype"] == "bfloat16" and man["dtype_requested"] == "auto"
    spec = json.loads((tmp_path / "auto" / "spec.json").read_text())
    assert spec["dtype"] == "auto" and spec["dtype_chosen"] == "bfloat16"
    item = FeatureDataset(tmp_path / "auto")[0]
    assert item["hidden"].dtype == torch.bfloat16 and torch.isfinite(item["hidden"]).all()


def test_auto_is_float16_for_a_quiet_target_and_reused_without_a_probe(tmp_path, monkeypatch):
    target = make_tiny_target()
    man = build_feature_cache(target, rows(), tmp_path, progress=False)  # auto by default
    assert man["dtype"] == "float16"
    assert FeatureDataset(tmp_path)[0]["hidden"].dtype == torch.float16

    def no_probe(*a, **k):
        raise AssertionError("a complete cache is reused without probing")

    monkeypatch.setattr(features, "probe_cache_dtype", no_probe)
    assert build_feature_cache(target, rows(), tmp_path, progress=False) == man


def test_a_resumed_auto_build_keeps_the_dtype_it_chose(tmp_path, monkeypatch):
    target = loud_target()

    def kill(k):
        raise Boom

    with pytest.raises(Boom):
        build_feature_cache(target, rows(), tmp_path, shard_size=2, progress=False,
                            on_shard=kill)
    probes = []
    monkeypatch.setattr(features, "probe_cache_dtype",
                        lambda *a, **k: probes.append(1) or ("float16", 0.0))
    man = build_feature_cache(target, rows(), tmp_path, shard_size=2, progress=False)
    assert not probes and man["dtype"] == "bfloat16"
    assert all(FeatureDataset(tmp_path)[i]["hidden"].dtype == torch.bfloat16 for i in range(6))


def test_auto_that_meets_an_overflow_later_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(features, "probe_cache_dtype", lambda *a, **k: ("float16", 1.0))
    with pytest.raises(FeatureCacheError, match="auto chose float16 .* data.cache.dtype=bfloat16"):
        build_feature_cache(loud_target(), rows(), tmp_path, progress=False)


def test_prepare_data_with_auto_reuses_a_float16_cache_of_the_same_data(tmp_path):
    from test_features import _chat_target_and_data

    from draftsmith.data.prepare import prepare_data

    target, cfg = _chat_target_and_data(tmp_path)
    cfg.num_conversations = 12
    cfg.split = {"val": 0.25, "test": 0.0}
    cfg.cache.dtype = "float16"
    train, val, _ = prepare_data(cfg, target, tmp_path / "out")
    cfg.cache.dtype = "auto"
    again = prepare_data(cfg, target, tmp_path / "out", is_main=False)  # nothing is built
    assert again[:2] == (train, val)
    fresh, _, rep = prepare_data(cfg, target, tmp_path / "fresh")
    assert json.loads((fresh / "manifest.json").read_text())["dtype"] == "float16"
    assert rep["config"]["cache"]["dtype"] == "auto" and fresh.parent.name != train.parent.name
