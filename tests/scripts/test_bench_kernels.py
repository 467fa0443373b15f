"""scripts/bench_kernels.py on a tiny target: both copies timed at every width, the stored
tables, settings checked before anything loads."""
from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.eval.decoding.kernels import packing_unsupported
from draftsmith.scripts import bench_kernels


def _cfg(decode_setup, tmp_path, **kw):
    return OmegaConf.merge(OmegaConf.load(bench_kernels.CONF_FILE), {
        "target_path": str(decode_setup["target"]), "name": "tiny", "widths": [1, 2, 4],
        "context": 20, "repeats": 1, "rounds": 1, "out_dir": str(tmp_path / "kernels"), **kw})


@pytest.mark.skipif(packing_unsupported(torch.float32, torch.device("cpu")) is not None,
                    reason="this torch build or CPU cannot prepack fp32 linears")
def test_forward_costs_of_both_kernels_on_a_tiny_target(decode_setup, tmp_path):
    entry = bench_kernels.run(_cfg(decode_setup, tmp_path))
    rows = {r["dtype"]: r for r in entry["dtypes"]}
    assert set(rows) == {"float32", "bfloat16"}
    fp32 = rows["float32"]
    assert fp32["widths"] == [1, 2, 4]
    assert all(ms > 0 for ms in fp32["default_ms"] + fp32["packed_ms"])
    bf16 = rows["bfloat16"]  # timed where oneDNN packs bf16, else the reason is kept
    assert bf16.get("packed_ms") or bf16["why"].startswith("oneDNN cannot pack")
    stored = json.loads((tmp_path / "kernels" / "results.json").read_text())
    assert set(stored) == {"tiny"}
    md = (tmp_path / "kernels" / "results.md").read_text()
    assert "## tiny:" in md and "| 4 |" in md and "in plain steps" in md


def test_settings_are_checked_before_loading(decode_setup, tmp_path):
    for key, value, says in (("dtypes", ["float64"], "dtypes"), ("widths", [2, 4], "including 1"),
                             ("repeats", 0, "repeats"), ("name", "a b", "name")):
        with pytest.raises(ValueError, match=says):
            bench_kernels.run(_cfg(decode_setup, tmp_path, **{key: value}))
