"""dtype=auto: the faster of fp32 and bf16, from a measurement on this machine."""
from __future__ import annotations

import pytest

from draftsmith.data import dtype as dt


def test_auto_picks_bf16_only_when_it_is_clearly_faster(monkeypatch):
    for rates, want in (({"float32": 200.0, "bfloat16": 700.0}, "bfloat16"),
                        ({"float32": 250.0, "bfloat16": 60.0}, "float32"),
                        ({"float32": 200.0, "bfloat16": 220.0}, "float32")):  # under the margin
        monkeypatch.setattr(dt, "matmul_rates", lambda device, r=rates: r)
        assert dt.fastest_dtype("cpu") == want
        assert dt.resolve_dtype("auto") == want
    assert dt.resolve_dtype("float16") == "float16"
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        dt.resolve_dtype("fp8")


def test_matmul_rates_are_measured_per_dtype():
    rates = dt.matmul_rates("cpu", 64, 32, 64, repeats=2)
    assert set(rates) == {"float32", "bfloat16"} and all(r > 0 for r in rates.values())
